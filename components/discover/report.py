"""Discovery's reach and verdict: one ssh per node runs the probe (its host key pinned first), and every node's
report is decided from what all of them said (a fabric address two nodes share, the head's network)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from components import host_keys, labels, scripts
from components.config import Preflight
from components.discover.checks import (
    Root,
    decide_disk,
    decide_docker,
    decide_gpu,
    decide_leftovers,
    decide_memory,
    decide_nfs,
)
from components.discover.fabric import Fabric, decide_fabric, peer_warning
from components.discover.findings import (
    EXPORT_COMMANDS,
    REACH_FIX,
    SSH_TIMEOUT_S,
    Finding,
    Pin,
    Run,
    Spec,
    Undecided,
    node_name,
    role,
)
from components.discover.parse import Probe, ProbeError, parse_probe
from components.ssh import KeyDirError, SshTarget, ssh_argv

# --- reaching a node ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reached:
    probe: Probe | None = None
    error: str | None = None
    """Why the node was not reached: one line."""
    host_key: str | None = None


def run_ssh(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=SSH_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
    )


def probe_script() -> str:
    return scripts.render(
        "discover/probe.sh", {"LABEL_KEY": labels.STACK_LABEL, "SUDO_COMMANDS": " ".join(EXPORT_COMMANDS)}
    )


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def reach(name: str, target: SshTarget, *, run: Run, pin: Pin, script: str) -> Reached:
    """Pin the node's host key, then run the probe over one ssh; every failure is one line, never a traceback."""
    address = host_keys.NodeAddress(node=name, host=target.host, port=target.port)
    try:
        pinned = pin([address], target.known_hosts_file)[name]
    except host_keys.HostKeyError as error:
        return Reached(error=_one_line(str(error)))
    file = target.known_hosts_file or host_keys.default_known_hosts_file()
    host_key = pinned.note or f"{pinned.key.kind} {pinned.key.fingerprint()}, as recorded in {file}"
    try:
        done = run(ssh_argv(target, script))
    except subprocess.TimeoutExpired:
        return Reached(error=f"no answer within {SSH_TIMEOUT_S} s; {REACH_FIX}", host_key=host_key)
    except (OSError, KeyDirError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        return Reached(error=f"cannot run ssh ({why})", host_key=host_key)
    said = next((line.strip() for line in (done.stderr or "").splitlines() if line.strip()), "")
    if done.returncode == 255:
        return Reached(error=f"{said or 'ssh exited 255'}; {REACH_FIX}", host_key=host_key)
    if done.returncode != 0:
        return Reached(error=f"the probe exited {done.returncode}: {said or 'no message'}", host_key=host_key)
    try:
        return Reached(probe=parse_probe(done.stdout or ""), host_key=host_key)
    except ProbeError as error:
        return Reached(error=f"{error}: {said}" if said else str(error), host_key=host_key)


# --- the whole report --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeReport:
    index: int
    name: str
    spec: Spec
    reached: Reached
    fabric: Fabric = Fabric()
    root: Root | None = None
    """The head's proposed weights root."""
    finding: Finding = field(default_factory=Finding)

    @property
    def role(self) -> str:
        return role(self.index)

    @property
    def undecided(self) -> tuple[Undecided, ...]:
        if self.reached.error is not None:
            # The error line already ends with its fix (ssh's, or host_keys' for a changed key).
            return (Undecided("node", f"not reached: {self.reached.error}", ""),)
        return self.fabric.finding.undecided + self.finding.undecided


@dataclass(frozen=True)
class Report:
    nodes: list[NodeReport]
    identity: str | None
    agent: str | None
    known_hosts: str | None

    @property
    def ok(self) -> bool:
        return all(not n.undecided for n in self.nodes)


def duplicate_address(index: int, fabrics: Sequence[Fabric]) -> Finding:
    """A fabric address an earlier node already has: the config refuses it, and one of the two is wrong."""
    ip = fabrics[index].ip
    earlier = next((j for j in range(index) if ip is not None and fabrics[j].ip == ip), None)
    if earlier is None:
        return Finding()
    return Finding(
        undecided=(
            Undecided(
                "fabricIp",
                f"{ip} is also the fabric address found on node {earlier + 1} ({node_name(earlier)}); the config "
                "refuses two nodes with one fabricIp",
                "check that these are two different nodes, and give each its own address on the fabric",
            ),
        )
    )


def decide(specs: Sequence[Spec], reached: Sequence[Reached]) -> list[NodeReport]:
    """Every decision over every reached node; the fabric in two passes, so a node with several addresses can be
    settled by the network its peers' addresses are on."""
    preflight, first_pass = Preflight(), []
    for r in reached:
        first_pass.append(decide_fabric(r.probe) if r.probe is not None else Fabric())
    fabrics = []
    for i, (r, fabric) in enumerate(zip(reached, first_pass, strict=True)):
        if r.probe is not None and fabric.ambiguous:
            peers = [f.ip for j, f in enumerate(first_pass) if j != i and f.ip is not None]
            fabric = decide_fabric(r.probe, peers)
        fabrics.append(fabric)
    head = fabrics[0] if fabrics else Fabric()
    head_network = next((c.network for c in head.candidates if c.address == head.ip), None)
    reports = []
    for i, (spec, r, fabric) in enumerate(zip(specs, reached, fabrics, strict=True)):
        if r.probe is None:
            reports.append(NodeReport(i, node_name(i), spec, r))
            continue
        probe = r.probe
        user = probe.user.name if probe.user and probe.user.name not in ("", "?") else spec.user
        root = decide_disk(probe, user, head=i == 0, min_gib=preflight.min_free_disk_gib)
        finding = (
            (peer_warning(fabric, head.ip, head_network) if i else Finding())
            + duplicate_address(i, fabrics)
            + decide_memory(probe, preflight.min_mem_available_gib)
            + root.finding
            + decide_docker(probe, user)
            + decide_gpu(probe)
            + (decide_nfs(probe, user) if i == 0 else Finding())
            + decide_leftovers(probe)
        )
        reports.append(NodeReport(i, node_name(i), spec, r, fabric, root if i == 0 else None, finding))
    return reports


def collect(specs: Sequence[Spec], targets: Sequence[SshTarget], *, run: Run, pin: Pin) -> list[NodeReport]:
    """Every node at once (each may take its whole ssh timeout), reported in the arguments' order."""
    script = probe_script()
    with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        reached = list(
            pool.map(lambda it: reach(node_name(it[0]), it[1], run=run, pin=pin, script=script), enumerate(targets))
        )
    return decide(specs, reached)
