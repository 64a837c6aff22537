"""The stack setup and measuring harness `make bench` (bench/run.py) runs every scenario on: the bench's
constants (its sim nodes, ports, loads and pacing), the bench sim's nodes started and narrowed to its own
known_hosts, the image pulled onto them, each `up` timed with its engine events (`Events`, `Up`) and its ssh
sessions counted (sshd's accepts, the logging `ssh` wrapper), config changes, and `repeat`: runs spread across one
gate poll interval, a run that hits the sim's shared authorized_keys race discarded and run again.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pulumi import automation as auto

from sim import cluster
from sim.cluster_layout import SSH_PORT, default_layout
from sim.deploy import docker_on

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench" / "tmp"  # git-ignored: the backend, PULUMI_HOME
STEP_TIMEOUT = 120
STARTUP_LINE = "Application startup complete."

# Sim nodes of the bench: away from nodes 1..4, which the end-to-end tests use (2 and 4 nodes), so each node's
# sshd log counts this bench's sessions only. 8 nodes need the sim up with 12 (`sim.cluster up --nodes 12`).
BENCH_NODES = tuple(range(5, 13))
PORT_2, MASTER_2 = 18900, 29700
PORT_8, MASTER_8 = 18901, 29701

# The gates' polling pace (RendezvousGateArgs/ReadyGateArgs poll_interval_s): used only for a node that cannot
# stream; the runs' phase shifts still spread across it.
GATE_POLL_S = 5.0
# Stand-in load: SIM_LOAD_SECONDS (+ the phase shift) and SIM_GRAPH_SECONDS, both set in every config.
READY_LOAD_S = 8.0
# No-op ups of the observed stack (--previews-only): the issue asks for the median of five.
NOOP_RUNS = 5
GRAPH_S = 2.0
DEAD_LOAD_S = 40
KILL_AFTER_READY_GATE_S = 3.0
# The verifier's words for a group whose engine died (components/verify/verdict.py).
DEAD_GROUP = "a rank of the group died"
STALL_LOAD_S = 2.0
STALL_S = 20
DECODE_RATES = (20, 40)
TOOLCHAIN_COLD_S = 292.0  # docs/development.md "The Pulumi toolchain": CLI, everything cold, 4 min 52 s
ACCEPTED = "Accepted publickey"


@dataclass
class Events:
    """Arrival time (host clock) of the engine events per resource name, from the tailed event log."""

    seen: dict[tuple[str, str], float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, event: auto.EngineEvent) -> None:
        now = time.time()
        pairs: list[tuple[str | None, str]] = []
        if event.resource_pre_event is not None:
            pairs.append((event.resource_pre_event.metadata.urn, "pre"))
        if event.res_outputs_event is not None:
            pairs.append((event.res_outputs_event.metadata.urn, "outputs"))
        if event.res_op_failed_event is not None:
            pairs.append((event.res_op_failed_event.metadata.urn, "failed"))
        if event.diagnostic_event is not None and event.diagnostic_event.severity == "error":
            pairs.append((event.diagnostic_event.urn, "error"))
        with self.lock:
            for urn, kind in pairs:
                if urn:
                    self.seen.setdefault((urn.rsplit("::", 1)[-1], kind), now)

    def at(self, name: str, kind: str) -> float | None:
        with self.lock:
            return self.seen.get((name, kind))


def op_counts(summary: Any) -> dict[str, int]:
    return {str(getattr(k, "value", k)): int(v) for k, v in dict(summary or {}).items()}


def sshd_accepted(indices: list[int]) -> int:
    """Connections every node's sshd accepted so far (`Accepted publickey` lines of .state/sim/node-*/sshd.log)."""
    layout = default_layout()
    total = 0
    for i in indices:
        log = layout.node_dir(i) / "sshd.log"
        if log.exists():
            total += log.read_text(errors="replace").count(ACCEPTED)
    return total


SSH_WRAPPER = """#!/bin/sh
# bench: records which process started this ssh client (never its arguments), then runs the real one.
printf '%s %s\\n' "$(date +%s.%N)" "$(cat /proc/$PPID/comm 2>/dev/null || echo unknown)" >> "{log}"
exec {ssh} "$@"
"""


def install_ssh_wrapper(work: Path, env: dict[str, str]) -> Path:
    """An `ssh` first on the engine's PATH that logs its parent's name (docker provider, gates, ...) per call."""
    real = shutil.which("ssh")
    if real is None:
        raise RuntimeError("no ssh client on PATH")
    bin_dir, log = work / "bin", work / "ssh-calls.log"
    bin_dir.mkdir(exist_ok=True)
    log.touch()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(SSH_WRAPPER.format(log=log, ssh=real))
    wrapper.chmod(0o755)
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    return log


def ssh_clients(log: Path | None, began: float, ended: float) -> dict[str, int]:
    """ssh client processes started between `began` and `ended`, by the name of the process that started them
    (multiplexed clients over a ControlMaster open no connection; the command provider's Go ssh opens no
    process, so it shows only in the sshd count)."""
    counts: dict[str, int] = {}
    if log is None or not log.exists():
        return counts
    for line in log.read_text().splitlines():
        stamp, _, parent = line.partition(" ")
        try:
            at = float(stamp)
        except ValueError:
            continue
        if began <= at <= ended:
            counts[parent] = counts.get(parent, 0) + 1
    return counts


def bench_sim(sim: dict[str, Any], indices: list[int], known_hosts: Path) -> dict[str, Any]:
    """sim.json's view narrowed to `indices`, with a known_hosts of their host keys owned by this bench
    (so a `make sim-up` with fewer nodes, which rewrites the sim's known_hosts, cannot break a run)."""
    layout = default_layout()
    lines = []
    for i in indices:
        kind, blob = (layout.node_dir(i) / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        lines.append(f"[{layout.node_ip(i)}]:{SSH_PORT} {kind} {blob}\n")
    known_hosts.write_text("".join(lines))
    described = cluster.describe(layout, indices)
    return {**sim, "nodes": described["nodes"], "ssh": {**sim["ssh"], "known_hosts": str(known_hosts)}}


def ensure_nodes(indices: list[int]) -> None:
    """Start what of the bench's nodes is not running (never stops anything); sim.json keeps its node list, so
    the end-to-end tests sharing the sim go on deploying to the nodes they did."""
    layout = default_layout()
    states = cluster.status(layout)
    if all(states.get(f"node-{i}/dockerd") and states.get(f"node-{i}/sshd") for i in indices):
        return
    described = (layout.state / "sim.json").read_text()
    try:
        cluster.up(layout, max(indices), build=False)
    finally:
        (layout.state / "sim.json").write_text(described)


def with_changes(
    config: dict[str, Any], *, env: dict[str, str] | None = None, gates: dict[str, Any] | None = None
) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads(json.dumps(config))
    for k, v in (env or {}).items():
        if v:
            cfg["serve"]["extraEnv"][k] = v
        else:
            cfg["serve"]["extraEnv"].pop(k, None)
    for k, v in (gates or {}).items():
        if v is None:
            cfg["gates"].pop(k, None)
        else:
            cfg["gates"][k] = v
    return cfg


@dataclass
class Up:
    result: auto.UpResult | None
    events: Events
    began: float
    ended: float
    ssh: int
    error: str = ""
    clients: dict[str, int] = field(default_factory=dict)

    @property
    def wall(self) -> float:
        return self.ended - self.began

    def changes(self) -> dict[str, int]:
        changes = (self.result.summary.resource_changes or {}) if self.result else {}
        return {str(getattr(k, "value", k)): int(v) for k, v in changes.items()}


def pull_images(sim: dict[str, Any]) -> None:
    """The image on every bench node beforehand (a node that has deployed before has it; the program's image
    layer then only checks it), so the cold ups measure the program, not the loopback registry."""
    for n in sim["nodes"]:
        proc = docker_on(int(n["index"]), "pull", "-q", sim["image"])
        if proc.returncode != 0:
            raise RuntimeError(f"pull of {sim['image']} on node {n['index']} failed: {proc.stderr.strip()}")


def phase_shift(index: int, runs: int) -> float:
    """Run `index` of `runs`: an even step across one gate poll interval."""
    return index * GATE_POLL_S / runs


# The sim's nodes share the host's filesystem, so two watchdog installs at once (this stack's two nodes, or
# another stack's on the same sim) race on the one /root/.ssh/authorized_keys (fixed temp name): a sim
# artefact, not the program's cost. A cycle that hits it is discarded and run again (recorded in the raw data).
SIM_RACES = ("authorized_keys.tmp",)
DISCARDED: list[dict[str, Any]] = []


def repeat(
    what: str,
    runs: int,
    scenario: Callable[[int, float], dict[str, Any]],
    *,
    first: int = 0,
    total: int | None = None,
    retries: int = 2,
) -> list[dict[str, Any]]:
    """Runs `first`..`first + runs - 1` of `total`, each shifted by its phase."""
    samples = []
    attempt = 0
    for i in range(runs):
        began = time.monotonic()
        while True:
            try:
                sample = scenario(attempt, phase_shift(first + i, total or runs))
                attempt += 1
                break
            except RuntimeError as err:
                attempt += 1
                race = next((r for r in SIM_RACES if r in str(err)), None)
                if race is None or retries <= 0:
                    raise
                retries -= 1
                DISCARDED.append({"what": what, "run": i, "reason": race, "error": str(err)[-1500:]})
                print(
                    f"bench: {what} run {i + 1}: discarded ({race}: the sim's shared authorized_keys); "
                    "running it again",
                    flush=True,
                )
        print(
            f"bench: {what} run {i + 1}/{runs} ({time.monotonic() - began:.0f} s): {json.dumps(sample, default=str)}",
            flush=True,
        )
        samples.append(sample)
    return samples
