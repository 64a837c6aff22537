"""The supervisor's process: one per node, in a container of the serving image that docker restarts (after
its own crash and at boot). Stdlib plus `requests` (every vLLM image has it), and the verifier's own modules.

Every node's agent owns its node's rank container through the node's docker socket and answers, on
`supervisor.port` of the node's fabric address (the head's also on the head's address, where the operator's
machine reaches it), with a bearer token:

    GET  /rank           the rank container's state and the node's MemAvailable
    GET  /rank/logs?since=<unix>   its log lines since then (docker's, timestamped)
    GET  /rank/usage     its container's memory and block I/O (what `docker stats` shows)
    POST /rank/stop      stop it (10 s, then kill)          POST /rank/start   start the same container

The head's agent also leads: it looks at every rank once a second and probes the endpoint every
`supervisor.probeSeconds` with the drift probe's rules; on a dead group it stops every rank, waits for memory,
starts the workers then the head, waits on the gates' rendezvous and ready rules over every rank's log
(boot.py), and verifies with the verifier's verdict (policy.py decides, this acts).
It also serves `GET /status`, `POST /pause|/resume` and the update lock (`POST|DELETE /lock`).

Usage: python3 -m components.supervisor.agent CONFIG.json
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import components.verify.client as verify_client  # the package forwards unknown names to verifier.py (pulumi)
from components.gates.decisions import ModelsEndpoint
from components.gates.observations import GateFailure, RankSpec, parse_docker_logs
from components.supervisor import boot, policy
from components.supervisor.agent_config import AgentConfig, AgentNode, LeaderConfig

GENERATION_LABEL = "dsv41-exl3.generation"
AGENT_TIMEOUT_S = 5.0
STOP_GRACE_S = 10
HISTORY = 50
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


# --- state that survives the agent's restart and the node's reboot ----------------------------------------


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {}
        if path.exists():
            try:
                loaded = json.loads(path.read_text())
                if not isinstance(loaded, dict):
                    raise ValueError(f"not a JSON object: {type(loaded).__name__}")
                self.data = loaded
            except (OSError, ValueError) as error:
                # What it held (a pause above all) is unknown: never act against the operator on a guess.
                kept = path.with_suffix(".unreadable")
                with contextlib.suppress(OSError):
                    os.replace(path, kept)
                self.data = {"paused": True, "state_error": f"{path} could not be read ({error}); kept as {kept}"}
                log(f"state: {self.data['state_error']}: paused until `resume`")
        self.data.setdefault("restarts", [])
        self.data.setdefault("events", [])
        self.data.setdefault("paused", False)

    def update(self, **fields: Any) -> None:
        with self.lock:
            self.data.update(fields)
            self._save()

    def append(self, key: str, item: dict[str, Any]) -> None:
        with self.lock:
            self.data[key] = [*self.data.get(key, []), item][-HISTORY:]
            self._save()

    def _save(self) -> None:
        # Written, synced, then renamed (and the rename synced): a power cut leaves the old state or the new one.
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(self.data, indent=1, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            copy: dict[str, Any] = json.loads(json.dumps(self.data))
            return copy


# --- the leader ---------------------------------------------------------------------------------------------


class Leader:
    def __init__(
        self, cfg: AgentConfig, docker: Docker, token: str, store: Store, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if cfg.leader is None:
            raise ValueError(f"the agent on {cfg.node} has no leader config: only the head's agent leads")
        self.cfg = cfg
        self.lead: LeaderConfig = cfg.leader
        self.docker = docker
        self.token = token
        self.store = store
        self.clock = clock
        self.budget = policy.Budget(
            max_restarts=self.lead.max_restarts, window_s=self.lead.window_s, backoff_s=self.lead.backoff_s
        )
        self.next_probe = 0.0
        self.lease = threading.Lock()  # the update lock's check-and-set
        self.own_check = ""  # the generation the supervisor last verified itself after an update armed it
        self.drift_streak = 0
        self.last_drift = ""
        self.hard_drift = False

    # the nodes, through their agents (the head's own rank through its docker)
    def _agent(self, node: AgentNode, method: str, path: str, timeout: float = AGENT_TIMEOUT_S) -> Any:
        if node.name == self.cfg.node:
            if path == "/rank/stop":
                stop_rank(self.docker, node.container)
            elif path == "/rank/start":
                self.docker.act(node.container, "start")
            elif method == "GET":
                answer = rank_get(self.docker, node.container, node.name, path)
                if answer is None:
                    raise ValueError(f"no {path}")
                return answer
            return rank_state(self.docker, node.container, node.name)
        parts = urllib.parse.urlsplit(node.url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        try:
            conn.request(method, path, headers={"Authorization": f"Bearer {self.token}", "Content-Length": "0"})
            reply = conn.getresponse()
            body = reply.read()
        finally:
            conn.close()
        if reply.status != 200:
            raise OSError(f"agent on {node.name}: HTTP {reply.status} {body[:200]!r}")
        return json.loads(body)

    def look(self) -> list[policy.RankView]:
        views = []
        for node in self.lead.nodes:
            try:
                views.append(policy.RankView.from_json(node.name, self._agent(node, "GET", "/rank")))
            except (OSError, http.client.HTTPException, ValueError) as error:
                views.append(policy.RankView(node=node.name, reachable=False, error=str(error)))
        return views

    def api_key(self) -> str | None:
        head = self.docker.inspect(self.lead.nodes[0].container) or {}
        for item in head.get("Config", {}).get("Env") or []:
            if item.startswith("VLLM_API_KEY="):
                return str(item.split("=", 1)[1])
        return None

    def notify(self, kind: str, **fields: Any) -> None:
        item = policy.event(kind, self.cfg.stack, at=time.time(), **fields)
        self.store.append("events", item)
        log(f"{kind}: {json.dumps(fields, sort_keys=True)}")
        command = self.lead.notify_command
        if not command:
            return
        try:
            done = subprocess.run(
                ["sh", "-c", command], input=json.dumps(item), text=True, capture_output=True, timeout=30
            )
            if done.returncode != 0:
                log(f"notifyCommand exited {done.returncode}: {done.stderr.strip()[-300:]}")
        except (OSError, subprocess.TimeoutExpired) as error:
            log(f"notifyCommand failed: {error}")

    def lock_holder(self) -> str | None:
        return policy.lock_holder(self.store.snapshot().get("lock"), time.time())

    def verify(self, budget_s: float) -> verify_client.Outcome:
        return verify_client.verify_endpoint(
            self.lead.endpoint,
            self.lead.model,
            self.api_key(),
            timeout_s=min(120.0, budget_s),
            retry_window_s=budget_s,
            warmup_timeout_s=budget_s,
            expected_answer=self.lead.expected_answer,
        )

    def arm(self, outcome: verify_client.Passed, before: list[policy.RankView]) -> bool:
        """Record a passed verification for the generation `before` saw, only if the same ranks still run and no
        update took the lock meanwhile: a late answer must never arm what runs no more (issue 43)."""
        why = self._stop_if_held() or policy.changed_during(before, self.look())
        if why:
            log(f"a passed verification of generation {before[0].generation or '?'} is not recorded: {why}")
            self.store.update(last_probe={"at": time.time(), "state": "unverified", "seen": f"dropped: {why}"})
            return False
        self.record_verified(outcome, before[0].generation)
        return True

    def record_verified(self, outcome: verify_client.Passed, generation: str) -> None:
        self.store.update(
            armed_generation=generation,
            last_verified={
                "at": time.time(),
                "generation": generation,
                "answer": outcome.answer,
                "logprobs": [[t.token, t.logprob] for t in outcome.logprobs],
            },
        )

    def probe(self) -> None:
        found = verify_client.probe_endpoint(
            self.lead.endpoint, self.lead.model, self.api_key(), timeout_s=self.lead.probe_timeout_s
        )
        self.store.update(last_probe={"at": time.time(), "state": found.state, "seen": found.seen})
        if found.state == "drift":
            self.drift_streak += 1
            self.last_drift = found.seen
            self.hard_drift = not found.confirm
            self.next_probe = self.clock() + 5  # confirm soon
        else:
            self.drift_streak, self.hard_drift = 0, False
            self.next_probe = self.clock() + self.lead.probe_seconds

    def arm_for_the_update(self, ranks: list[policy.RankView]) -> None:
        """Arm for the generation the update that installed this config verified, once the head runs it: that
        update's verifier passed it moments before (the install waits on it), whatever ran or was armed before."""
        deployed = self.lead.generation
        head = ranks[0]
        if not deployed or not (head.reachable and head.exists) or head.generation != deployed:
            return
        if self.store.snapshot().get("armed_generation") == deployed:
            return
        self.store.update(armed_generation=deployed)
        self.notify("armed", generation=deployed, by="the update that verified it")

    def verify_now(self, ranks: list[policy.RankView]) -> bool:
        """The verifier's request now; True when it passed and was recorded for the ranks `ranks` saw."""
        self.next_probe = self.clock() + self.lead.probe_seconds
        outcome = self.verify(self.lead.verify_timeout_s)
        if isinstance(outcome, verify_client.Passed):
            return self.arm(outcome, ranks)
        self.store.update(last_probe={"at": time.time(), "state": "unverified", "seen": outcome.message})
        return False

    def own_verification_due(self, snap: dict[str, Any], ranks: list[policy.RankView]) -> bool:
        head = ranks[0].generation
        verified = str((snap.get("last_verified") or {}).get("generation") or "")
        return bool(head) and verified != head and self.own_check != head

    def step(self) -> policy.Decision:
        ranks = self.look()
        self.arm_for_the_update(ranks)
        snap = self.store.snapshot()
        decision = policy.decide(
            ranks,
            paused=bool(snap.get("paused")),
            lock_holder=self.lock_holder(),
            given_up=snap.get("given_up"),
            armed_generation=str(snap.get("armed_generation") or ""),
            probe_due=self.clock() >= self.next_probe,
            drift_streak=self.drift_streak,
            last_drift=self.last_drift,
            hard_drift=self.hard_drift,
        )
        if decision.why != snap.get("doing"):
            self.store.update(doing=decision.why)
        # What the head runs, beside what the supervisor is armed for: status, the preview's line and the
        # Dsv41SupervisorNotArmed alert compare the two (a gap means a dead rank is left to `pulumi up`).
        running = ranks[0].generation if ranks[0].reachable and ranks[0].exists else ""
        if running != snap.get("running_generation"):
            self.store.update(running_generation=running)
        if decision.action == "verify" and self.clock() >= self.next_probe:
            if self.verify_now(ranks):
                self.notify("armed", generation=ranks[0].generation)
        elif decision.action == "probe" and self.own_verification_due(snap, ranks):
            # Armed by the update that verified this generation: the supervisor's own verification of it, once,
            # records what it answered (status, the last-verified metrics); after that the probe's rules decide.
            self.own_check = ranks[0].generation
            self.verify_now(ranks)
        elif decision.action == "probe":
            self.probe()
        elif decision.action == "heal":
            self.heal(decision.why)
        return decision

    def _stop_if_held(self) -> str | None:
        snap = self.store.snapshot()
        if snap.get("paused"):
            return "paused by the operator"
        holder = self.lock_holder()
        return f"an update took the lock ({holder})" if holder else None

    def heal(self, cause: str) -> None:
        snap = self.store.snapshot()
        # A resume after a give-up starts a fresh budget: the operator says the cause is fixed.
        since = float(snap.get("budget_since") or 0)
        times = [float(r["at"]) for r in snap.get("restarts", []) if r.get("at") and float(r["at"]) >= since]
        when, why = policy.next_attempt(times, time.time(), self.budget)
        if when is None:
            reason = f"{why}; last cause: {cause}"
            self.store.update(given_up=reason)
            self.notify("gave-up", reason=reason, cause=cause)
            return
        while time.time() < when:
            if self._stop_if_held():
                return
            time.sleep(min(1.0, when - time.time()))
        started = time.time()
        self.store.append("restarts", {"at": started, "cause": cause, "result": "running"})
        self.notify("restarting", cause=cause, why=why)
        phases: dict[str, float] = {}
        result = self._restart_group(phases)
        self.drift_streak, self.hard_drift = 0, False
        self.next_probe = self.clock() + self.lead.probe_seconds
        restarts = self.store.snapshot()["restarts"]
        restarts[-1] = {**restarts[-1], "result": result, "seconds": round(time.time() - started, 1), "phases": phases}
        self.store.update(restarts=restarts)
        self.notify(
            "restarted" if result == "verified" else "restart-failed",
            cause=cause,
            result=result,
            seconds=round(time.time() - started, 1),
        )

    def _restart_group(self, phases: dict[str, float]) -> str:
        """Stop, wait for memory, start, boot, verify; each phase's seconds go into `phases`."""
        nodes = self.lead.nodes
        mark = [time.time()]

        def phase(name: str) -> None:
            now = time.time()
            phases[name] = round(now - mark[0], 2)
            mark[0] = now

        for node in nodes:  # every rank: a rank left running would hold the old group's rendezvous
            try:
                self._agent(node, "POST", "/rank/stop", timeout=STOP_GRACE_S + 30)
            except (OSError, http.client.HTTPException, ValueError) as error:
                return f"could not stop the rank on {node.name}: {error}"
        phase("stop")
        deadline = time.time() + self.lead.mem_wait_s
        floors = {node.name: float(node.min_mem_gib) for node in nodes}
        while True:
            low = [
                (v.node, v.mem_available_gib, floors[v.node])
                for v in self.look()
                if v.mem_available_gib is None or v.mem_available_gib < floors[v.node]
            ]
            if not low:
                break
            if time.time() >= deadline:
                name, mem, floor = low[0]
                return (
                    f"gave up waiting for memory: MemAvailable {mem} GiB on {name} stayed below its floor {floor:g} "
                    f"GiB (preflight.minMemAvailableGiB) for {self.lead.mem_wait_s} s"
                )
            time.sleep(1)
        phase("memory")
        if held := self._stop_if_held():
            return f"not started: {held}"
        for node in [*nodes[1:], nodes[0]]:  # the workers, then the head
            try:
                self._agent(node, "POST", "/rank/start", timeout=60)
            except (OSError, http.client.HTTPException, ValueError) as error:
                return f"could not start the rank on {node.name}: {error}"
        try:
            booted = self.wait_for_boot()
        except boot.Interrupted as held:
            phase("boot")
            return f"left to {held}"
        except GateFailure as failure:
            phase("boot")  # until the gates' verdict: a fatal line or an exit ends it at once
            log(f"the restart's boot failed: {failure}")
            return f"boot failed: {boot.cause_of(str(failure))}"
        phase("boot")  # from the first start to the gates' ready: every rank joined, the head logged ready
        log(f"booted: rendezvous {booted.rendezvous_s:g} s, then ready {booted.ready_s:g} s")
        booted_ranks = self.look()
        outcome = self.verify(self.lead.verify_timeout_s)
        phase("verify")
        if isinstance(outcome, verify_client.Passed):
            if not self.arm(outcome, booted_ranks):
                return "not recorded: the ranks changed while they were verified"
            return "verified"
        return f"not verified: {outcome.message}"

    def rank_specs(self) -> list[RankSpec]:
        """The ranks as the gates name them: rank i on node i, observed through that node's agent."""
        specs = []
        for i, node in enumerate(self.lead.nodes):
            url = urllib.parse.urlsplit(node.url)
            specs.append(
                RankSpec(
                    rank=i,
                    node=node.name,
                    host=url.hostname or "",
                    port=url.port or 80,
                    user="agent",
                    container=node.container,
                )
            )
        return specs

    def wait_for_boot(self) -> boot.Booted:
        """The gates' rendezvous and ready rules over every rank's log (boot.py); GateFailure or Interrupted."""
        nodes = self.lead.nodes
        key = self.api_key()

        def fetch(rank: int, path: str) -> dict[str, Any]:
            answer: dict[str, Any] = self._agent(nodes[rank], "GET", path)
            return answer

        def report(message: str) -> None:
            log(f"boot: {message}")

        return boot.wait_for_boot(
            self.rank_specs(),
            fetch,
            boot.BootSettings(
                bounds=self.lead.bounds,
                poll_s=self.lead.boot_poll_s,
                secrets=(key,) if key else (),
            ),
            probe=ModelsEndpoint(self.lead.endpoint, self.lead.model, key),
            model=self.lead.model,
            clock=boot.HeldClock(self._stop_if_held),
            report=report,
        )

    def run(self) -> None:
        log(f"leading {len(self.lead.nodes)} rank(s) of stack {self.cfg.stack}")
        while True:
            try:
                self.step()
            except Exception as error:  # one bad look must not end the supervisor; docker would restart it anyway
                log(f"step failed: {error!r}")
                time.sleep(5)
            time.sleep(1)


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


# --- the HTTP API -------------------------------------------------------------------------------------------


# Before any token is checked, a connection costs a thread in a 256 MiB container that also runs the memory
# guard: at most this many at once from one address, this many in all, and each silent for at most this long.
MAX_CONNECTIONS_PER_CLIENT = 8
MAX_CONNECTIONS = 48
READ_TIMEOUT_S = 10.0
# Linux's IP_FREEBIND (the socket module names it from Python 3.12 on): bind an address the node does not hold yet.
IP_FREEBIND = int(getattr(socket, "IP_FREEBIND", 15))


class AgentServer(ThreadingHTTPServer):
    """The agent's API server: connections counted per client address and in all at accept time, refused (503,
    nothing read) beyond either bound, so one client cannot starve the others. A second listener of the same
    agent (`sharing`) counts into the first's bounds."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        per_client: int = MAX_CONNECTIONS_PER_CLIENT,
        total: int = MAX_CONNECTIONS,
        sharing: AgentServer | None = None,
        freebind: bool = False,
    ) -> None:
        self.per_client: int = sharing.per_client if sharing else per_client
        self.total: int = sharing.total if sharing else total
        self.open: dict[str, int] = sharing.open if sharing else {}
        self.counting: threading.Lock = sharing.counting if sharing else threading.Lock()
        self.freebind = freebind
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.freebind:
            # Best effort: without it a missing address fails the bind, and docker restarts the agent.
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        super().server_bind()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        client = str(client_address[0])
        with self.counting:
            if self.open.get(client, 0) >= self.per_client or sum(self.open.values()) >= self.total:
                full = True
            else:
                full = False
                self.open[client] = self.open.get(client, 0) + 1
        if full:
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        return not full

    def _done(self, client_address: Any) -> None:
        client = str(client_address[0])
        with self.counting:
            left = self.open.get(client, 1) - 1
            if left > 0:
                self.open[client] = left
            else:
                self.open.pop(client, None)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(client_address)  # no thread started: it cannot count itself out
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(client_address)


def listen(hosts: list[str], port: int, handler: type[BaseHTTPRequestHandler]) -> list[AgentServer]:
    """One server per address, all counting into the first's bounds. The first (the fabric address) is bound as
    it must be: a failure ends the agent and docker restarts it. The others (the head's address as the operator's
    machine resolved it) may come up after docker starts this container at boot (DHCP, Tailscale): bound with
    IP_FREEBIND they answer once the address is there, and meanwhile the leader heals over the fabric instead
    of restarting until the LAN is up. The head's preflight checked that the address is the head's own."""
    first = AgentServer((hosts[0], port), handler)
    return [first, *(AgentServer((h, port), handler, sharing=first, freebind=True) for h in hosts[1:])]


def make_handler(cfg: AgentConfig, docker: Docker, token: str, leader: Leader | None) -> type:
    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # every receive and send: a connection that says nothing is dropped

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass

        def _reply(self, status: int, data: Any) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            self._reply(401, {"error": "a bearer token is required"})
            return False

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            if length > 65536:
                raise ValueError("body too large")
            data = json.loads(self.rfile.read(length) or b"{}")
            return data if isinstance(data, dict) else {}

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if not self._authorized():
                return
            if self.path.startswith("/rank"):
                try:
                    answer = rank_get(docker, cfg.container, cfg.node, self.path)
                except ValueError as error:
                    self._reply(400, {"error": str(error)})
                    return
                except OSError as error:
                    self._reply(502, {"error": str(error)})
                    return
                if answer is None:
                    self._reply(404, {"error": f"no {self.path}"})
                else:
                    self._reply(200, answer)
            elif self.path == "/status" and leader is not None:
                self._reply(
                    200,
                    {
                        **leader.store.snapshot(),
                        "lock_holder": leader.lock_holder(),
                        "node": cfg.node,
                        "now": time.time(),
                    },
                )
            else:
                self._reply(404, {"error": f"no {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            try:
                body = self._body()
                if self.path == "/rank/stop":
                    stop_rank(docker, cfg.container)
                    self._reply(200, rank_state(docker, cfg.container, cfg.node))
                elif self.path == "/rank/start":
                    docker.act(cfg.container, "start")
                    self._reply(200, rank_state(docker, cfg.container, cfg.node))
                elif leader is not None and self.path in ("/pause", "/resume"):
                    paused = self.path == "/pause"
                    # resume also clears a give-up: the operator says the cause is fixed
                    leader.store.update(
                        paused=paused, **({} if paused else {"given_up": None, "budget_since": time.time()})
                    )
                    leader.notify("paused" if paused else "resumed")
                    self._reply(200, {"paused": paused})
                elif leader is not None and self.path == "/lock":
                    holder = str(body.get("holder") or "")[:200]
                    if not holder:
                        self._reply(400, {"error": "a lock names its holder"})
                        return
                    ttl = max(1.0, min(float(body.get("ttl_s", 120)), 3600.0))
                    with leader.lease:  # one take at a time: check and set as one step
                        lock, refused_by = policy.take_lock(
                            leader.store.snapshot().get("lock"),
                            holder,
                            ttl,
                            time.time(),
                            takeover=str(body.get("takeover") or ""),
                        )
                        if lock is not None:
                            leader.store.update(lock=lock)
                    if lock is None:
                        self._reply(409, {"error": f"the lock is held by {refused_by}", "holder": refused_by})
                    else:
                        self._reply(200, lock)
                else:
                    self._reply(404, {"error": f"no {self.path}"})
            except (OSError, ValueError) as error:
                self._reply(500, {"error": str(error)})

        def do_DELETE(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            if leader is not None and self.path == "/lock":
                holder = str(self._body().get("holder") or "")
                with leader.lease:
                    mine = bool(holder) and policy.release_lock(
                        leader.store.snapshot().get("lock"), holder, time.time()
                    )
                    if mine:
                        leader.store.update(lock=None)
                if mine:
                    self._reply(200, {"released": True})
                else:
                    self._reply(409, {"error": "only the lock's holder releases it (name it)", "released": False})
            else:
                self._reply(404, {"error": f"no {self.path}"})

    return Handler


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    cfg = AgentConfig.from_json(Path(argv[1]).read_text())
    token = Path(cfg.token_file).read_text().strip()
    docker = Docker(cfg.docker_socket)
    leader = None
    if cfg.leader is not None:
        state_dir = Path(cfg.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        leader = Leader(cfg, docker, token, Store(state_dir / "supervisor-state.json"))
    hosts = list(cfg.listen_hosts)
    server, *more = listen(hosts, cfg.listen_port, make_handler(cfg, docker, token, leader))
    for host, extra in zip(hosts[1:], more, strict=True):
        threading.Thread(target=extra.serve_forever, name=f"api-{host}", daemon=True).start()
    listening = ", ".join(f"{h}:{cfg.listen_port}" for h in hosts)
    log(f"{cfg.role} for {cfg.container} on {cfg.node}, API on {listening}")
    if leader is not None:
        threading.Thread(target=leader.run, name="leader", daemon=True).start()
    if guard := cfg.memory_guard:
        threading.Thread(
            target=MemoryGuard(
                docker, cfg.container, floor_gib=guard.floor_gib, sample_s=guard.sample_s, samples=guard.samples
            ).run,
            name="memory-guard",
            daemon=True,
        ).start()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
