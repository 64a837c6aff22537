"""The program's exporter: one per node, in a container of the serving image beside the supervisor's agent.

On every scrape it asks this node's agent for `GET /rank` (and, on the head, the leading agent for
`GET /status`) with the supervisor's token, reads this node's lines of the stack's watchdog log, and answers
with metrics.py's families. Nothing is polled between scrapes: Prometheus' interval is the only clock.

Usage: python3 -m components.observability.exporter CONFIG.json
"""

from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY, Metric
from prometheus_client.registry import Collector

from components.observability import metrics

AGENT_TIMEOUT_S = 3.0
# A log read is bounded: the file only grows with trips and watchdog starts, but it is never truncated by us.
MAX_LOG_BYTES = 8 << 20


def agent_get(url: str, path: str, token: str, timeout_s: float = AGENT_TIMEOUT_S) -> dict[str, Any] | None:
    """The agent's JSON answer to GET `path`, or None when it does not answer 200 with a JSON object."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        reply = conn.getresponse()
        body = reply.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    if reply.status != 200:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def read_log(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - MAX_LOG_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None


class AgentCollector(Collector):
    def __init__(self, cfg: metrics.ExporterConfig, token: str) -> None:
        self.cfg = cfg
        self.agent_url = cfg.agent_url
        self.leader_url = cfg.leader_url or cfg.agent_url
        self.watchdog_log = cfg.watchdog_log
        self.token = token
        self.restarts = metrics.RestartCounter()

    def collect(self) -> Iterator[Metric]:
        rank = agent_get(self.agent_url, "/rank", self.token)
        status = agent_get(self.leader_url, "/status", self.token) if self.cfg.leader else None
        seen = metrics.Observed(
            now=time.time(),
            rank=rank,
            status=status,
            watchdog_log=read_log(self.watchdog_log) if self.watchdog_log else None,
        )
        yield from metrics.families(self.cfg, seen, self.restarts)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print((__doc__ or "").strip().splitlines()[-1], file=sys.stderr)
        return 2
    cfg = metrics.ExporterConfig.from_json(Path(argv[1]).read_text())
    token = Path(cfg.token_file).read_text().strip()
    REGISTRY.register(AgentCollector(cfg, token))
    server, thread = start_http_server(cfg.listen_port, addr=cfg.listen_host)
    print(f"exporter for {cfg.node} on {cfg.listen_host}:{cfg.listen_port}", flush=True)
    thread.join()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
