"""The operator's view of the supervisor, from any machine that reaches the head:

    python -m components.supervisor status --stack NAME [--json]
    python -m components.supervisor pause --stack NAME      # no action until resume (survives a reboot)
    python -m components.supervisor resume --stack NAME     # also clears a give-up once the cause is fixed

The leading agent's address and token come from the stack's `supervisor` output (Automation API, read only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import requests

from components.supervisor import policy

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    pass


def read_supervisor(stack_name: str) -> tuple[str, str]:
    """(url, token) from the stack's `supervisor` output."""
    from pulumi import automation as auto

    work_dir = str(Path(__file__).resolve().parents[2])
    try:
        outputs = auto.select_stack(stack_name, work_dir=work_dir).outputs()
    except auto.errors.CommandError as error:
        first = next((x for x in str(error).splitlines() if "error:" in x), str(error).splitlines()[0])
        raise UsageError(f"cannot read stack {stack_name!r}: {first.strip()}") from None
    value = outputs.get("supervisor")
    data = value.value if value is not None else None
    if not isinstance(data, dict) or not data.get("url") or not data.get("token"):
        raise UsageError(f"stack {stack_name!r} has no supervisor (supervisor.enabled false, or no verified up yet)")
    return str(data["url"]), str(data["token"])


def _ago(at: float | None, now: float) -> str:
    return "never" if not at else f"{now - float(at):.0f} s ago"


def format_status(status: dict[str, Any]) -> str:
    now = float(status.get("now") or time.time())
    lines = [f"supervisor on {status.get('node')}: {status.get('doing', 'starting')}"]
    if status.get("paused"):
        lines.append("paused: yes (python -m components.supervisor resume)")
    if status.get("lock_holder"):
        lines.append(f"update lock: {status['lock_holder']}")
    if status.get("given_up"):
        lines.append(f"gave up: {status['given_up']}")
    if status.get("state_error"):
        lines.append(f"state: {status['state_error']} (paused until resume)")
    if gap := policy.not_armed(status):
        lines.append(gap)
    probe = status.get("last_probe") or {}
    lines.append(f"last probe: {probe.get('state', '-')} {_ago(probe.get('at'), now)}: {probe.get('seen', '')}")
    verified = status.get("last_verified") or {}
    lines.append(
        f"last verified: {_ago(verified.get('at'), now)}, generation {verified.get('generation', '-')}, "
        f"logprobs {json.dumps(verified.get('logprobs', []), ensure_ascii=False)}"
    )
    restarts = status.get("restarts") or []
    lines.append(f"restarts: {len(restarts)}")
    for r in restarts[-5:]:
        lines.append(
            f"  {_ago(r.get('at'), now)}: {r.get('cause')} -> {r.get('result')}"
            + (f" in {r['seconds']} s" if r.get("seconds") is not None else "")
        )
    return "\n".join(lines)


def main(
    argv: Sequence[str] | None = None,
    read: Callable[[str], tuple[str, str]] = read_supervisor,
    session: requests.Session | None = None,
) -> int:
    parser = argparse.ArgumentParser(prog="python -m components.supervisor", allow_abbrev=False)
    parser.add_argument("action", choices=("status", "pause", "resume"))
    parser.add_argument("--stack", required=True, metavar="NAME")
    parser.add_argument("--json", action="store_true", help="status as JSON")
    options = parser.parse_args(argv)
    http = session or requests.Session()
    try:
        url, token = read(options.stack)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    headers = {"Authorization": f"Bearer {token}"}
    try:
        if options.action == "status":
            reply = http.get(f"{url}/status", headers=headers, timeout=10)
        else:
            reply = http.post(f"{url}/{options.action}", headers=headers, json={}, timeout=10)
    except requests.RequestException as error:
        print(
            f"error: the supervisor at {url} does not answer ({type(error).__name__}); is the head up? "
            f"`docker ps` on it should show the supervisor container",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if reply.status_code != 200:
        print(f"error: the supervisor at {url} answered HTTP {reply.status_code}", file=sys.stderr)
        return EXIT_FAILED
    data = reply.json()
    if options.action != "status":
        print(f"supervisor of {options.stack}: {'paused' if data.get('paused') else 'resumed'}")
    elif options.json:
        print(json.dumps(data, indent=1, sort_keys=True))
    else:
        print(format_status(data))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
