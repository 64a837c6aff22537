"""Prometheus' own tools for the observability tests: promtool and a throwaway Prometheus on loopback.

Debian's `prometheus` package provides both (CI installs it: .ci/run). Absent, the tests skip with the fix,
except in CI (`CI=true`) or with DSV41_REQUIRE_PROMETHEUS=1, where an absent tool is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
OBSERVABILITY = REPO / "components" / "observability"


def required() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get("DSV41_REQUIRE_PROMETHEUS") == "1"


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        why = f"{name} is not installed: `apt-get install prometheus` (Debian's package has promtool and prometheus)"
        if required():
            pytest.fail(f"{why}; CI and DSV41_REQUIRE_PROMETHEUS=1 require it")
        pytest.skip(why)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def api(base: str, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
    """GET `path` of Prometheus' HTTP API; the decoded JSON, errors included (Prometheus answers 400 with a body)."""
    url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=10) as reply:
            data: dict[str, Any] = json.loads(reply.read())
    except urllib.error.HTTPError as err:
        data = json.loads(err.read())
    return data


@contextmanager
def prometheus(tmp: Path, config: str = "global: {}\n") -> Iterator[str]:
    """A Prometheus on 127.0.0.1 with an empty TSDB under `tmp`; yields its base URL and stops it after."""
    binary = tool("prometheus")
    port = free_port()
    (tmp / "prometheus.yml").write_text(config)
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if api(base, "/api/v1/status/buildinfo").get("status") == "success":
                    break
            except (OSError, ValueError):  # not listening yet, or a plain-text 503 while its TSDB opens
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start:\n{(tmp / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
