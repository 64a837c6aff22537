"""Reading the supervisor of a deployed sim stack: the end-to-end tests and `make bench-heal` (bench/heal.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import requests

from components import labels
from sim.deploy import Deployment, docker_on


def leader(d: Deployment) -> tuple[str, dict[str, str]]:
    value = d.stack.outputs()["supervisor"].value
    return value["url"], {"Authorization": f"Bearer {value['token']}"}


def status(d: Deployment) -> dict[str, Any]:
    url, headers = leader(d)
    reply = requests.get(f"{url}/status", headers=headers, timeout=10)
    reply.raise_for_status()
    data: dict[str, Any] = reply.json()
    return data


def wait_for(d: Deployment, what: str, done: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            last = status(d)
        except requests.RequestException as error:
            last = {"error": str(error)}
        if done(last):
            return last
        time.sleep(1)
    raise AssertionError(
        f"supervisor: {what} not within {timeout_s:g} s; last status:\n{json.dumps(last, indent=1)}"
        f"\n{supervisor_logs(d)}"
    )


def supervisor_logs(d: Deployment) -> str:
    out = []
    prefix = labels.stack_prefix("dsv41-exl3", d.name)
    for n in d.sim["nodes"]:
        name = f"{prefix}-supervisor-node-{n['index']}"
        logs = docker_on(n["index"], "logs", "--tail", "30", name)
        ps = docker_on(n["index"], "ps", "-a", "--filter", f"name={name}", "--format", "{{.Status}}").stdout
        out.append(f"--- {name} ({ps.strip()}):\n{logs.stdout}{logs.stderr}")
    return "\n".join(out)


def armed(d: Deployment) -> dict[str, Any]:
    return wait_for(d, "armed", lambda s: bool(s.get("armed_generation")) and not s.get("lock_holder"), 120)


def restarts(s: dict[str, Any]) -> list[dict[str, Any]]:
    return list(s.get("restarts") or [])


def restarted(before: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
    """A status with one more restart than `before`, finished (verified or not)."""
    return lambda s: len(restarts(s)) > len(restarts(before)) and restarts(s)[-1].get("result") not in (None, "running")
