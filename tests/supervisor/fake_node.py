"""A node as the supervisor's agent sees it, for the agent's tests: a docker daemon whose rank containers replay
a scripted log (real vLLM's recorded lines, time-compressed) after each start, and the head's OpenAI endpoint.

The fake answers what the agent asks the Engine API: inspect, start/stop/kill, the logs (framed as docker frames
a container without a TTY: `[stream, 0, 0, 0, size]` then the bytes) and stats."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from components.gates import log_patterns
from components.gates.decisions import GateBounds
from components.supervisor import node_docker
from components.supervisor.agent_config import AgentConfig, AgentNode, LeaderConfig
from tests.support import recorded

# Real vLLM's boot is ~93 s (head) and ~61 s (worker): replayed at 1/100 it takes about a second.
SCALE = 0.01


@dataclass
class Script:
    """What a rank prints after each start (seconds after it, text) and how it ends, if it does."""

    lines: list[tuple[float, str]] = field(default_factory=list)
    exits_at: float | None = None
    exit_code: int = 0
    oom_killed: bool = False


def real_boot(role: str, scale: float = SCALE) -> Script:
    """A rank's recorded real-vLLM boot (tests/support/fixtures/real-vllm/boot), `scale`d in time."""
    return Script(lines=[(ln.t * scale, ln.text) for ln in recorded.log("boot", role)])


def first_at(script: Script, predicate: Any) -> float:
    return next(t for t, text in script.lines if predicate(text))


def head_ready_at(script: Script) -> float:
    return first_at(script, log_patterns.is_ready_line)


def joined_at(script: Script) -> float:
    return first_at(script, log_patterns.is_join_line)


def rfc3339(at: float) -> str:
    seconds = int(at)
    nanos = int(round((at - seconds) * 1e9))
    if nanos >= 1_000_000_000:
        seconds, nanos = seconds + 1, nanos - 1_000_000_000
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos:09d}Z"


def frame(kind: int, payload: bytes) -> bytes:
    return bytes([kind, 0, 0, 0]) + len(payload).to_bytes(4, "big") + payload


class FakeDocker:
    """One node's daemon: containers by name; every start/stop/kill recorded in one shared log."""

    def __init__(self, node: str, log: list[str], generation: str = "g1") -> None:
        self.node = node
        self.log = log
        self.containers: dict[str, dict[str, Any]] = {}
        self.scripts: dict[str, Script] = {}
        self.started: dict[str, float] = {}
        self.booted: set[str] = set()  # started by a test's restart: their scripts' exits apply
        self.generation = generation
        self.lock = threading.Lock()
        self.log_reads = 0

    def add(self, name: str, running: bool = True, env: list[str] | None = None, script: Script | None = None) -> None:
        now = time.time()
        self.containers[name] = {
            "State": {
                "Running": running,
                "Status": "running" if running else "exited",
                "ExitCode": 0 if running else 137,
                "OOMKilled": False,
                "StartedAt": rfc3339(now),
            },
            "Config": {"Labels": {node_docker.GENERATION_LABEL: self.generation}, "Env": env or [], "Tty": False},
        }
        self.scripts[name] = script or Script()
        self.started[name] = now - 3600  # the boot before the tests: long done

    def _settle(self, name: str) -> None:
        """A scripted exit whose time has come."""
        state, script = self.containers[name]["State"], self.scripts[name]
        if (
            name in self.booted
            and state["Running"]
            and script.exits_at is not None
            and time.time() >= self.started[name] + script.exits_at
        ):
            state.update(Running=False, Status="exited", ExitCode=script.exit_code, OOMKilled=script.oom_killed)

    def inspect(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            if name not in self.containers:
                return None
            self._settle(name)
            copy: dict[str, Any] = json.loads(json.dumps(self.containers[name]))
            return copy

    def act(self, name: str, verb: str, query: str = "") -> None:
        with self.lock:
            self.log.append(f"{verb} {self.node}")
            state = self.containers[name]["State"]
            if verb == "start":
                now = time.time()
                self.started[name] = now
                self.booted.add(name)
                state.update(Running=True, Status="running", ExitCode=0, OOMKilled=False, StartedAt=rfc3339(now))
            else:
                state.update(Running=False, Status="exited", ExitCode=137 if verb == "kill" else 143)

    def logs(self, name: str, since: str) -> bytes:
        """What the container printed from `since` (inclusive, as docker's) until now, stdout and stderr framed."""
        with self.lock:
            self.log_reads += 1
            self._settle(name)
            start, script, state = self.started[name], self.scripts[name], self.containers[name]["State"]
            end = time.time() if state["Running"] else start + (script.exits_at or 0)
            out = b""
            for i, (t, text) in enumerate(script.lines):
                at = start + t
                if float(since) - 1e-6 <= at <= end:
                    out += frame(1 + i % 2, f"{rfc3339(at)} {text}\n".encode())
            return out

    def stats(self, name: str) -> dict[str, Any]:
        return {
            "memory_stats": {"usage": 3 << 30, "stats": {"inactive_file": 1 << 30}},
            "blkio_stats": {"io_service_bytes_recursive": [{"op": "read", "value": 5 << 20}]},
        }


class FakeEndpoint:
    """The head's OpenAI API on loopback: /health 200 at all times (as real vLLM's head answers it with its
    worker gone), /v1/models lists `model`; every path asked is recorded with its time."""

    def __init__(self, model: str = "m") -> None:
        self.model = model
        self.asked: list[tuple[float, str]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_GET(self) -> None:  # noqa: N802
                endpoint.asked.append((time.time(), self.path))
                if self.path == "/health":
                    body = b""
                elif self.path == "/v1/models":
                    body = json.dumps({"object": "list", "data": [{"id": endpoint.model, "object": "model"}]}).encode()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def first(self, path: str) -> float | None:
        return next((t for t, p in self.asked if p == path), None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def without(script: Script, predicate: Any) -> Script:
    return Script([(t, x) for t, x in script.lines if not predicate(x)], script.exits_at, script.exit_code)


def until(script: Script, predicate: Any, then: Sequence[tuple[float, str]] = ()) -> Script:
    """The script's lines before the first one `predicate` picks, then `then` (times after the start)."""
    cut = first_at(script, predicate)
    return Script([(t, x) for t, x in script.lines if t < cut] + list(then))


def lines_of(scenario: str, role: str, scale: float = SCALE, offset: float = 0.0) -> Iterator[tuple[float, str]]:
    """A recorded scenario's lines after its fault (t > 0), shifted to `offset` seconds after the start."""
    for ln in recorded.log(scenario, role):
        if ln.t > 0:
            yield offset + ln.t * scale, ln.text


def agent_config(state_dir: str, worker_port: int | None = None, **overrides: Any) -> AgentConfig:
    """The head's agent config (components/supervisor/agent_config.py) for a leader on node-1 with a worker agent
    on node-2 at `worker_port` (None: no worker); `overrides` replace leader fields, bounds by their own names."""
    limits = {k: float(overrides.pop(k)) for k in list(overrides) if k in GateBounds.field_names()}
    nodes = [AgentNode(name="node-1", url="http://127.0.0.1:1", container="rank-1", min_mem_gib=0)]
    if worker_port is not None:
        nodes.append(AgentNode(name="node-2", url=f"http://127.0.0.1:{worker_port}", container="rank-2", min_mem_gib=0))
    leader = {
        "nodes": tuple(nodes),
        "endpoint": "http://127.0.0.1:9/v1",
        "generation": "",
        "model": "m",
        "expected_answer": "",
        "probe_seconds": 60,
        "probe_timeout_s": 5.0,
        "max_restarts": 2,
        "window_s": 3600,
        "backoff_s": 0,
        "mem_wait_s": 10,
        "bounds": GateBounds(**{"rendezvous_timeout_s": 20.0, "ready_timeout_s": 20.0, "stall_s": 20.0, **limits}),
        "boot_poll_s": 0.05,
        "verify_timeout_s": 5.0,
        "notify_command": "",
        **overrides,
    }
    return node_config("node-1", "rank-1", state_dir, leader=LeaderConfig(**leader))


def node_config(node: str, container: str, state_dir: str = "", leader: LeaderConfig | None = None) -> AgentConfig:
    """An agent's config on `node` (a worker's, unless `leader` is given)."""
    return AgentConfig(
        stack="dev",
        node=node,
        listen_hosts=("127.0.0.1",),
        listen_port=0,
        token_file="",
        state_dir=state_dir,
        docker_socket="",
        container=container,
        leader=leader,
    )
