"""The exporter process against a stand-in agent on loopback: token, /rank, /status, the watchdog log."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from components.observability.exporter import AgentCollector, agent_get
from components.observability.metrics import ExporterConfig

TOKEN = "t0ken"


@pytest.fixture
def agent() -> Iterator[dict[str, Any]]:
    """An agent stand-in: answers /rank and /status with a bearer token, counts what it was asked."""
    state: dict[str, Any] = {
        "rank": {"exists": True, "running": True, "mem_available_gib": 3.0, "generation": "g"},
        "status": {"paused": False, "restarts": [], "last_probe": {"at": 1.0, "state": "healthy", "seen": "ok"}},
        "asked": [],
    }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:  # noqa: N802
            state["asked"].append(self.path)
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.send_response(401)
                self.end_headers()
                return
            body = json.dumps(state[self.path.strip("/")]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


def config(url: str, tmp: Path, *, leader: bool) -> ExporterConfig:
    return ExporterConfig(
        stack="sim",
        node="head",
        leader=leader,
        generation="g",
        image_id="sha256:1",
        probe_seconds=60,
        watchdog_floor_gib=1.0,
        agent_url=url,
        leader_url=url,
        watchdog_log=str(tmp / "watchdog.log"),
        token_file=str(tmp / "token"),
        listen_host="127.0.0.1",
        listen_port=0,
    )


def exposition(collector: AgentCollector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_the_head_exporter_reads_rank_status_and_its_watchdog_log(agent: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "watchdog.log").write_text("x node=head container=c STOP: MemAvailable below\n")
    text = exposition(AgentCollector(config(agent["url"], tmp_path, leader=True), TOKEN))
    assert 'dsv41_rank_up{node="head"} 1.0' in text
    assert 'dsv41_watchdog_trips_total{node="head"} 1.0' in text
    assert "dsv41_supervisor_up 1.0" in text
    assert 'dsv41_probe_state{state="healthy"} 1.0' in text
    assert agent["asked"] == ["/rank", "/status"]


def test_a_worker_exporter_never_asks_for_status(agent: dict[str, Any], tmp_path: Path) -> None:
    text = exposition(AgentCollector(config(agent["url"], tmp_path, leader=False), TOKEN))
    assert agent["asked"] == ["/rank"]
    assert "dsv41_supervisor_up" not in text
    # No log yet (the watchdog never tripped, or never ran here): zero trips.
    assert 'dsv41_watchdog_trips_total{node="head"} 0.0' in text


def test_a_wrong_token_or_a_dead_agent_reads_as_agent_down(agent: dict[str, Any], tmp_path: Path) -> None:
    assert agent_get(agent["url"], "/rank", "wrong") is None
    text = exposition(AgentCollector(config(agent["url"], tmp_path, leader=True), "wrong"))
    assert 'dsv41_agent_up{node="head"} 0.0' in text
    assert "dsv41_supervisor_up 0.0" in text
    assert agent_get("http://127.0.0.1:9", "/rank", TOKEN, timeout_s=1) is None
