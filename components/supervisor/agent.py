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
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import components.verify.client as verify_client  # the package forwards unknown names to verifier.py (pulumi)
from components.gates.decisions import ModelsEndpoint
from components.gates.observations import GateFailure, RankSpec
from components.labels import KEY_FILE
from components.supervisor import boot, policy
from components.supervisor.agent_api import listen, make_handler
from components.supervisor.agent_config import AgentConfig, AgentNode, LeaderConfig
from components.supervisor.node_docker import (
    STOP_GRACE_S,
    Docker,
    MemoryGuard,
    log,
    rank_get,
    rank_state,
    stop_rank,
)

AGENT_TIMEOUT_S = 5.0
HISTORY = 50


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
        """The key the head rank serves with: the file it reads it from (never its env, which `docker inspect`
        shows); a head container from before the key moved to a file still has it in its env."""
        container = self.lead.nodes[0].container
        text = self.docker.read_file(container, KEY_FILE)
        if text:
            return text.decode().strip() or None
        head = self.docker.inspect(container) or {}
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
