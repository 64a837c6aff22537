"""The supervisor agent's hands on its node (shipped with agent.py): the node's docker over its unix socket, the
rank container's state, log and usage as the agent's API answers them, and the memory guard that docker brings
back after a reboot."""

from __future__ import annotations

import http.client
import io
import json
import socket
import tarfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components.gates.observations import parse_docker_logs
from components.supervisor import boot

GENERATION_LABEL = "dsv41-exl3.generation"
STOP_GRACE_S = 10
# One read of a rank's log: a boot's log is a few hundred lines; a flood is read on in the next look.
MAX_LOG_BYTES = 4 << 20


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} supervisor: {message}", flush=True)


# --- the node's docker, over its unix socket ---------------------------------------------------------------


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class Docker:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def _call(self, method: str, path: str, timeout: float = 30.0, limit: int | None = None) -> tuple[int, bytes]:
        conn = _UnixConnection(self.socket_path, timeout)
        try:
            conn.request(method, path, headers={"Content-Length": "0"} if method == "POST" else {})
            reply = conn.getresponse()
            return reply.status, reply.read() if limit is None else reply.read(limit)
        finally:
            conn.close()

    def inspect(self, name: str) -> dict[str, Any] | None:
        status, body = self._call("GET", f"/containers/{urllib.parse.quote(name)}/json")
        if status == 404:
            return None
        if status != 200:
            raise OSError(f"docker inspect {name}: HTTP {status} {body[:200]!r}")
        data: dict[str, Any] = json.loads(body)
        return data

    def read_file(self, name: str, path: str, limit: int = 65536) -> bytes | None:
        """One small file's bytes as the container sees it (docker's archive API, a running or stopped container);
        None when the container or the file is not there."""
        query = urllib.parse.urlencode({"path": path})
        status, body = self._call("GET", f"/containers/{urllib.parse.quote(name)}/archive?{query}", limit=limit + 4096)
        if status == 404:
            return None
        if status != 200:
            raise OSError(f"docker cp {name}:{path}: HTTP {status} {body[:200]!r}")
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            member = next((m for m in tar.getmembers() if m.isfile()), None)
            extracted = tar.extractfile(member) if member is not None else None
            return extracted.read(limit) if extracted is not None else None

    def logs(self, name: str, since: str) -> bytes:
        """The container's stdout and stderr since `since` (unix seconds), timestamped, as docker frames them."""
        query = urllib.parse.urlencode({"stdout": 1, "stderr": 1, "timestamps": 1, "since": since})
        status, body = self._call("GET", f"/containers/{urllib.parse.quote(name)}/logs?{query}", limit=MAX_LOG_BYTES)
        if status != 200:
            raise OSError(f"docker logs {name}: HTTP {status} {body[:200]!r}")
        return body

    def stats(self, name: str) -> dict[str, Any]:
        status, body = self._call("GET", f"/containers/{urllib.parse.quote(name)}/stats?stream=false&one-shot=true")
        if status != 200:
            raise OSError(f"docker stats {name}: HTTP {status} {body[:200]!r}")
        data: dict[str, Any] = json.loads(body)
        return data

    def act(self, name: str, verb: str, query: str = "") -> None:
        status, body = self._call("POST", f"/containers/{urllib.parse.quote(name)}/{verb}{query}", timeout=90)
        if status not in (204, 304):
            raise OSError(f"docker {verb} {name}: HTTP {status} {body[:200]!r}")


def mem_available_gib(meminfo: str = "/proc/meminfo") -> float | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) / 1048576, 2)
    except OSError:
        pass
    return None


def rank_state(docker: Docker, container: str, node: str) -> dict[str, Any]:
    data = docker.inspect(container)
    out: dict[str, Any] = {
        "node": node,
        "container": container,
        "exists": data is not None,
        "mem_available_gib": mem_available_gib(),
    }
    if data is not None:
        state = data.get("State", {})
        out.update(
            running=bool(state.get("Running")),
            status=state.get("Status"),
            exit_code=state.get("ExitCode"),
            oom_killed=bool(state.get("OOMKilled")),
            started_at=state.get("StartedAt"),
            finished_at=state.get("FinishedAt"),
            generation=(data.get("Config", {}).get("Labels") or {}).get(GENERATION_LABEL, ""),
        )
    return out


def rank_logs(docker: Docker, container: str, since: str) -> dict[str, Any]:
    """`GET /rank/logs?since=<unix>`: the rank's log lines since then, each with docker's timestamp."""
    since = boot.valid_since(since)
    data = docker.inspect(container)
    if data is None:
        return {"exists": False, "lines": []}
    text = boot.demultiplex(docker.logs(container, since), bool((data.get("Config") or {}).get("Tty")))
    return {"exists": True, "lines": [{"at": ln.at, "text": ln.text} for ln in parse_docker_logs(text)]}


def rank_usage(docker: Docker, container: str) -> dict[str, Any]:
    """`GET /rank/usage`: the rank container's memory and block I/O, for the ready gate's stall rule."""
    return boot.usage_of_stats(docker.stats(container))


def rank_get(docker: Docker, container: str, node: str, target: str) -> dict[str, Any] | None:
    """What an agent answers to GET `target` about its own rank; None: no such path."""
    parts = urllib.parse.urlsplit(target)
    if parts.path == "/rank":
        return rank_state(docker, container, node)
    if parts.path == "/rank/logs":
        return rank_logs(docker, container, urllib.parse.parse_qs(parts.query).get("since", [""])[0])
    if parts.path == "/rank/usage":
        return rank_usage(docker, container)
    return None


def stop_rank(docker: Docker, container: str) -> None:
    data = docker.inspect(container)
    if data is None or not data.get("State", {}).get("Running"):
        return
    docker.act(container, "stop", f"?t={STOP_GRACE_S}")


# --- the memory guard: the watchdog's rule, in a process docker brings back after a reboot ----------------


class MemoryGuard:
    """Kills this node's rank when MemAvailable stays under the floor for `samples` samples in a row (the host
    watchdog's rule, watchdog.*). The leader then sees a dead rank, stops the others and waits for memory before
    it restarts the group."""

    def __init__(
        self,
        docker: Docker,
        container: str,
        *,
        floor_gib: float,
        sample_s: float,
        samples: int,
        meminfo: str = "/proc/meminfo",
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.docker, self.container = docker, container
        self.floor_gib, self.sample_s, self.samples = floor_gib, sample_s, samples
        self.meminfo, self.sleep = meminfo, sleep
        self.low = 0
        self.trips = 0

    def sample(self) -> bool:
        """One sample; True when it killed the rank."""
        mem = mem_available_gib(self.meminfo)
        self.low = self.low + 1 if mem is not None and mem < self.floor_gib else 0
        if self.low < self.samples:
            return False
        self.low = 0
        data = self.docker.inspect(self.container)
        if data is None or not data.get("State", {}).get("Running"):
            return False
        log(
            f"STOP: MemAvailable {mem} GiB below the floor {self.floor_gib:g} GiB for {self.samples} samples: "
            f"killing {self.container}"
        )
        self.docker.act(self.container, "kill")
        self.trips += 1
        return True

    def run(self) -> None:
        while True:
            try:
                self.sample()
            except (OSError, http.client.HTTPException, ValueError) as error:
                log(f"memory guard: {error}")
            self.sleep(self.sample_s)
