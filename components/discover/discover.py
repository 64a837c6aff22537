"""What each Spark can tell about its stack config lines, before the first `pulumi up` (issue #23, item 2):

    dsv41-exl3 discover [--json] [--identity FILE] [--known-hosts FILE] user@host[:port] ...

The first node is the head. Each node's host key is pinned first (components/host_keys.py: recorded on first
use, a changed one refused), then one ssh runs probe.sh (read only) and the decisions below read its report:
the fabric interface and address, the HCAs and the RoCE v2 GID index (by gid_check.sh's rule, which `gidIndex:
auto` applies again at every up), MemAvailable, the weights root on the head, docker access, the GPU, the NFS
server and sudo on the head, and containers left by a stack. It prints a block per node, a `nodes:` list to paste
into the stack file, and what it could not decide, each with its fix.

SSH: `--identity FILE` (the key the stack's `ssh.privateKey` will hold) and/or the agent at `$SSH_AUTH_SOCK`;
`--known-hosts FILE` is `ssh.knownHostsFile` (default `~/.ssh/known_hosts`). The key is never printed.

Exit 0: every node was reached and every line decided; 1: something could not be decided (or a node not
reached); 2: a usage error (a malformed argument, a key file that cannot be read).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from components import host_keys, labels, scripts
from components.config import NAMESPACE, Node, Preflight, Weights
from components.discover.parse import Gid, Interface, Probe, ProbeError, Rdma, parse_probe
from components.operator.exits import Exit
from components.operator.stack_view import OperatorError, OperatorParser
from components.preflight.gid import ipv4_mapped_gid
from components.ssh import KeyDirError, SshTarget, ssh_argv

SSH_TIMEOUT_S = 90  # the probe bounds each daemon call at 10 s; a dozen of them at worst
FORM = "user@host[:port]"
ROCE_V2 = "RoCE v2"
GID_PORT = "1"  # gid_check.sh reads port 1 only (one port per GB10 HCA)
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"
WEIGHTS_DIR = "dsv41-exl3"
SUDOERS_FILE = "/etc/sudoers.d/dsv41-exl3"
# What the NFS export runs as root (components/weights/export.sh, unexport.sh): the README's sudoers line.
EXPORT_COMMANDS = ("/usr/sbin/exportfs", "/usr/bin/mkdir", "/usr/bin/install", "/usr/bin/rm")
NO_RDMA = "set `ibHcas: []` to run without RDMA"
NOT_DECIDED = "<not decided: see below>"
REACH_FIX = "check the address, port and that your key is in the node's authorized_keys"
GIB_KIB = 1 << 20

Run = Callable[[list[str]], subprocess.CompletedProcess[str]]
Pin = Callable[[Sequence[host_keys.NodeAddress], str | None], dict[str, host_keys.Pin]]


@dataclass(frozen=True)
class Spec:
    """One `user@host[:port]` argument."""

    user: str
    host: str
    port: int

    @property
    def text(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}" + ("" if self.port == 22 else f":{self.port}")


@dataclass(frozen=True)
class Undecided:
    """A config line this tool could not decide: the key, why, and the fix."""

    key: str
    reason: str
    fix: str

    def line(self) -> str:
        return f"{self.key}: {self.reason}" + (f"; fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class Finding:
    """What one decision says about a node: lines for its block, warnings, and what it could not decide."""

    found: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    undecided: tuple[Undecided, ...] = ()

    def __add__(self, other: Finding) -> Finding:
        return Finding(self.found + other.found, self.warnings + other.warnings, self.undecided + other.undecided)


# --- arguments -------------------------------------------------------------------------------------------------


def parse_target(arg: str) -> Spec:
    """`user@host[:port]` (`user@[v6]:port` for an IPv6 address), checked by the config's own `nodes[]` rules."""
    user, at, rest = arg.partition("@")
    if not at or not user:
        raise OperatorError(f"{arg!r} has no user: use the form {FORM}, e.g. nvidia@10.0.0.1")
    host, port_text = rest, None
    if rest.startswith("["):
        host, bracket, after = rest[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise OperatorError(f"{arg!r} is not of the form {FORM} (an IPv6 address goes in brackets: user@[::1]:22)")
        port_text = after[1:] if after else None
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
    port = 22
    if port_text is not None:
        if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 1 <= int(port_text) <= 65535:
            raise OperatorError(f"{arg!r} has a bad port {port_text!r}: use the form {FORM} with a port 1-65535")
        port = int(port_text)
    try:
        Node(name="spark-head", host=host, port=port, user=user, fabric_ip="192.0.2.1")
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        said = str(first["msg"]).removeprefix("Value error, ")
        raise OperatorError(f"{arg!r}: the {where} {said}; use the form {FORM}") from None
    return Spec(user=user, host=host, port=port)


def node_name(index: int) -> str:
    """The names the stack file's template uses: spark-head, spark-worker, then spark-worker-2, -3..."""
    return "spark-head" if index == 0 else "spark-worker" if index == 1 else f"spark-worker-{index}"


def role(index: int) -> str:
    return "head" if index == 0 else "worker"


# --- the RoCE GID rule (gid_check.sh's, for `gidIndex: auto`) ---------------------------------------------------


@dataclass(frozen=True)
class GidResult:
    index: int | None
    problems: tuple[tuple[str, str], ...] = ()
    """(reason, fix) for each problem; an index only when there is none."""


def _table(rdma: Rdma, hca: str) -> dict[int, Gid]:
    return {g.index: g for g in rdma.gids if g.hca == hca and g.port == GID_PORT}


def _states(rdma: Rdma) -> dict[str, str]:
    return {p.hca: p.state for p in rdma.ports if p.port == GID_PORT}


def _hcas(rdma: Rdma) -> list[str]:
    return sorted({p.hca for p in rdma.ports} | {h for h, _ in rdma.netdevs} | {g.hca for g in rdma.gids})


def resolve_gid(rdma: Rdma, hcas: Sequence[str], fabric_ip: str) -> GidResult:
    """The index `gidIndex: auto` resolves to on this node, or why it fails: gid_check.sh's rule, in Python.

    Every HCA ACTIVE; the lowest RoCE v2 entry holding the IPv4-mapped fabric address, one index across the HCAs
    that hold it; every other HCA listed holds an IPv4 RoCE v2 entry at that index (the port's other half).
    tests/discover checks that gid_check.sh itself agrees on every fixture.
    """
    expected = ipv4_mapped_gid(fabric_ip)
    states = _states(rdma)
    known = set(_hcas(rdma))
    active = [h for h in sorted(states) if states[h] == "ACTIVE"]
    problems: list[tuple[str, str]] = []
    for h in hcas:
        if h not in known:
            problems.append((f"HCA {h} does not exist", "list HCAs as `ls /sys/class/infiniband` shows them"))
        elif h not in states:
            problems.append((f"HCA {h} has no readable port 1 state", "check the mlx5 RDMA driver (`ibv_devinfo`)"))
        elif states[h] != "ACTIVE":
            problems.append(
                (
                    f"HCA {h} port 1 is {states[h]}",
                    f"check the cable and `ibv_devinfo`; ACTIVE HCAs: {', '.join(active) or 'none'}; {NO_RDMA}",
                )
            )
    if problems:
        return GidResult(None, tuple(problems))
    v2: dict[str, int] = {}
    v1: dict[str, Gid] = {}
    for h in hcas:
        for i, g in sorted(_table(rdma, h).items()):
            if g.gid != expected:
                continue
            if g.type == ROCE_V2:
                v2.setdefault(h, i)
            else:
                v1.setdefault(h, g)
    indexes = sorted(set(v2.values()))
    if len(indexes) > 1:
        held = ", ".join(f"{h} at {i}" for h, i in sorted(v2.items()))
        return GidResult(
            None,
            (
                (
                    f"{fabric_ip} is a RoCE v2 GID at different indexes ({held}), but NCCL_IB_GID_INDEX is one "
                    "value per node",
                    f"keep {fabric_ip} on one fabric netdev only, or list only one of those HCAs in ibHcas",
                ),
            ),
        )
    if not indexes:
        v1_text = "".join(f"; {h} holds it only as {g.type or 'no type'} at index {g.index}" for h, g in v1.items())
        fix = (
            f"enable RoCE v2 on {', '.join(v1)} (the HCA's RoCE mode), then run this again"
            if v1
            else f"assign {fabric_ip} to the fabric netdev of {', '.join(hcas)} (`ip addr`), bring the link up"
        )
        return GidResult(
            None,
            ((f"no ACTIVE RoCE v2 GID holds {fabric_ip} on {', '.join(hcas)}{v1_text}", f"{fix}; {NO_RDMA}"),),
        )
    index = indexes[0]
    for h in hcas:
        if h in v2:
            continue
        entry = _table(rdma, h).get(index)
        if entry is None or entry.type != ROCE_V2 or not entry.gid.startswith(IPV4_MAPPED):
            has = "nothing" if entry is None else f"{entry.gid} ({entry.type or 'no type'})"
            problems.append(
                (
                    f"HCA {h} has no IPv4 RoCE v2 GID at index {index} (the index of {fabric_ip}); it has {has}",
                    f"give {h}'s netdev its fabric IPv4 address, or drop {h} from ibHcas",
                )
            )
    return GidResult(None, tuple(problems)) if problems else GidResult(index)


# --- the fabric: interface, address, HCAs, GID index ------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """An IPv4 address on a netdev of an ACTIVE RoCE HCA."""

    interface: str
    address: str
    prefixlen: int
    hcas: tuple[str, ...]

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.address}/{self.prefixlen}", strict=False)

    def text(self) -> str:
        return f"{self.interface} {self.address}/{self.prefixlen} ({', '.join(self.hcas)})"


@dataclass(frozen=True)
class Fabric:
    interface: str | None = None
    ip: str | None = None
    hcas: tuple[str, ...] | None = None
    gid_index: int | None = None
    candidates: tuple[Candidate, ...] = ()
    finding: Finding = Finding()

    @property
    def ambiguous(self) -> bool:
        return self.interface is None and len(self.candidates) > 1


_FABRIC_KEYS = "fabricInterface, fabricIp, ibHcas, gidIndex"


def netdevs_of(rdma: Rdma) -> dict[str, set[str]]:
    """HCA -> its netdevs, from the GID table's ndevs and from `device/net/`."""
    found: dict[str, set[str]] = {}
    for g in rdma.gids:
        if g.ndev:
            found.setdefault(g.hca, set()).add(g.ndev)
    for h, n in rdma.netdevs:
        found.setdefault(h, set()).add(n)
    return found


def candidates(interfaces: Sequence[Interface], rdma: Rdma) -> list[Candidate]:
    states = _states(rdma)
    netdevs = netdevs_of(rdma)
    active = sorted(h for h, s in states.items() if s == "ACTIVE")
    found: list[Candidate] = []
    for iface in interfaces:
        hcas = tuple(h for h in active if iface.name in netdevs.get(h, set()))
        if hcas:
            found.extend(Candidate(iface.name, a.local, a.prefixlen, hcas) for a in iface.ipv4)
    return found


def _hca_summary(rdma: Rdma) -> str:
    states = _states(rdma)
    netdevs = netdevs_of(rdma)
    parts = []
    for h in _hcas(rdma):
        nd = "/".join(sorted(netdevs.get(h, set())))
        parts.append(f"{h} {states.get(h, 'no port 1')}" + (f" ({nd})" if nd else ""))
    return "HCAs: " + (", ".join(parts) or "none")


def _chosen(rdma: Rdma, chosen: Candidate, others: Sequence[Candidate], why: str) -> Fabric:
    found = [f"fabric: {chosen.interface} {chosen.address}/{chosen.prefixlen} on {', '.join(chosen.hcas)}{why}"]
    warnings: list[str] = []
    undecided: list[Undecided] = []
    result = resolve_gid(rdma, chosen.hcas, chosen.address)
    if result.index is not None:
        found.append(f"RoCE v2 GID index {result.index} holds {chosen.address} (`gidIndex: auto` finds it at every up)")
        # The port's other half: usable in ibHcas too when it holds an IPv4 RoCE v2 entry at the same index.
        states = _states(rdma)
        for h in sorted(h for h, s in states.items() if s == "ACTIVE" and h not in chosen.hcas):
            g = _table(rdma, h).get(result.index)
            if g is not None and g.type == ROCE_V2 and g.gid.startswith(IPV4_MAPPED):
                found.append(
                    f"note: {h} is ACTIVE and holds an IPv4 RoCE v2 GID at index {result.index} too: "
                    f"`ibHcas: [{', '.join((*chosen.hcas, h))}]` uses both halves of the port (~200G)"
                )
    else:
        for reason, fix in result.problems:
            undecided.append(Undecided("gidIndex", reason, fix))
    for other in others:
        warnings.append(f"also an address on an ACTIVE RoCE netdev, not chosen: {other.text()}")
    return Fabric(
        interface=chosen.interface,
        ip=chosen.address,
        hcas=chosen.hcas,
        gid_index=result.index,
        candidates=(chosen, *others),
        finding=Finding(tuple(found), tuple(warnings), tuple(undecided)),
    )


def decide_fabric(probe: Probe, peers: Sequence[str] = ()) -> Fabric:
    """fabricInterface, fabricIp, ibHcas and gidIndex from the ip and sysfs sections.

    The one IPv4 address on a netdev of an ACTIVE RoCE HCA; of several, the one whose GID rule resolves, else the
    one on the network of every peer's fabric address (`peers`: the other nodes' decided addresses)."""
    if probe.rdma is None or probe.interfaces is None:
        missing = "ib" if probe.rdma is None else "ip"
        reason = probe.unavailable.get(missing, "not read")
        what = "no RDMA devices" if missing == "ib" else "no interface addresses"
        return Fabric(
            finding=Finding(
                undecided=(
                    Undecided(
                        _FABRIC_KEYS,
                        f"{what} ({reason})",
                        "load the CX-7's RDMA driver (`ibv_devinfo` lists the HCAs), or run without RDMA: "
                        "`ibHcas: []`, `rdmaDevices: []`, with fabricIp/fabricInterface set by hand",
                    ),
                )
            )
        )
    rdma = probe.rdma
    summary = _hca_summary(rdma)
    states = _states(rdma)
    found = candidates(probe.interfaces, rdma)
    if not found:
        active = [h for h, s in sorted(states.items()) if s == "ACTIVE"]
        if not active:
            netdevs = netdevs_of(rdma)
            held = [
                f"{i.name} holds {a.local} ({', '.join(h for h in sorted(netdevs) if i.name in netdevs[h])} DOWN)"
                for i in probe.interfaces
                for a in i.ipv4
                if any(i.name in n for n in netdevs.values())
            ]
            reason = f"no RoCE HCA port is ACTIVE ({', '.join(f'{h} {s}' for h, s in sorted(states.items()))})"
            reason += f"; {'; '.join(held)}" if held else ""
            fix = f"check the cable and `ibv_devinfo`; {NO_RDMA}"
        else:
            netdevs = netdevs_of(rdma)
            names = sorted({n for h in active for n in netdevs.get(h, set())})
            reason = f"{', '.join(active)} {'is' if len(active) == 1 else 'are'} ACTIVE, but " + (
                f"no IPv4 address on {', '.join(names)}" if names else "their netdevs are not known"
            )
            fix = (
                f"give the fabric netdev its address (e.g. `sudo ip addr add 192.168.100.1/24 dev "
                f"{names[0] if names else 'enp1s0f1np1'}`, kept in netplan), then run this again"
            )
        return Fabric(finding=Finding(found=(summary,), undecided=(Undecided(_FABRIC_KEYS, reason, fix),)))
    if len(found) == 1:
        fabric = _chosen(rdma, found[0], [], "")
        return replace(fabric, finding=Finding(found=(summary,)) + fabric.finding)
    viable = [c for c in found if resolve_gid(rdma, c.hcas, c.address).index is not None]
    pick, why = None, ""
    if len(viable) == 1:
        pick, why = viable[0], " (the only one with a RoCE v2 GID)"
    elif peers:
        pool = viable or found
        near = [c for c in pool if all(ipaddress.IPv4Address(p) in c.network for p in peers)]
        if len(near) == 1:
            pick, why = near[0], f" (the one on the other nodes' network {near[0].network})"
    if pick is not None:
        fabric = _chosen(rdma, pick, [c for c in found if c != pick], why)
        return replace(fabric, finding=Finding(found=(summary,)) + fabric.finding)
    listed = "; ".join(c.text() for c in found)
    return Fabric(
        candidates=tuple(found),
        finding=Finding(
            found=(summary,),
            undecided=(
                Undecided(
                    _FABRIC_KEYS,
                    f"several addresses on ACTIVE RoCE netdevs: {listed}",
                    "pick the one the other nodes reach this node at (fabricInterface, fabricIp, and in ibHcas its "
                    "HCA; both halves of a port when both hold RoCE v2 at one GID index)",
                ),
            ),
        ),
    )


def peer_warning(fabric: Fabric, head_ip: str | None, head_network: ipaddress.IPv4Network | None) -> Finding:
    """A worker whose fabric address is not on the head's network: the ranks would not reach each other."""
    if fabric.ip is None or head_ip is None or head_network is None:
        return Finding()
    if ipaddress.IPv4Address(fabric.ip) in head_network:
        return Finding()
    return Finding(
        warnings=(
            f"fabric address {fabric.ip} is not on the head's fabric network {head_network} ({head_ip}): check "
            "that the cable joins these two ports and the addresses share a subnet",
        )
    )


# --- memory, disk, docker, GPU, NFS, leftovers ------------------------------------------------------------------


def decide_memory(probe: Probe, min_gib: float) -> Finding:
    kib = probe.mem_available_kib
    if kib is None:
        return Finding(warnings=(f"MemAvailable not read ({probe.unavailable.get('meminfo', 'no meminfo')})",))
    gib = kib / GIB_KIB
    if gib >= min_gib:
        return Finding(found=(f"memory: MemAvailable {gib:.1f} GiB (preflight needs {min_gib:g} GiB)",))
    return Finding(
        found=(f"memory: MemAvailable {gib:.1f} GiB",),
        warnings=(
            f"MemAvailable {gib:.1f} GiB is below preflight.minMemAvailableGiB {min_gib:g}: the up refuses this node "
            "until it has that much; a busy node must be idle before the up (what holds memory: `docker ps`, "
            "`ps aux --sort=-rss | head`)",
        ),
    )


@dataclass(frozen=True)
class Root:
    """The proposed `weights.root` and the one command that makes it, if one is needed."""

    root: str | None
    create: str | None = None
    finding: Finding = Finding()


def decide_disk(probe: Probe, user: str, *, head: bool, min_gib: float) -> Root:
    """The candidate with the most free space (the first listed of equals: /srv, /opt, /var/lib, then $HOME).

    /srv before the home on a tie: staging writes the root as the SSH user, but with `share: nfs` every directory
    above the root must be o+x, which an Ubuntu home (0750) is not. The home itself is never proposed."""
    if probe.disk is None:
        reason = probe.unavailable.get("disk", "not read")
        if head:
            return Root(
                None,
                finding=Finding(
                    undecided=(Undecided("weights.root", f"disk not read ({reason})", "check `df -P -k` on the head"),)
                ),
            )
        return Root(None, finding=Finding(warnings=(f"disk not read ({reason})",)))
    measured = [c for c in probe.disk.candidates if c.available_kib is not None]
    if not measured:
        what = "no candidate weights root could be measured (/srv, /opt, /var/lib, $HOME)"
        if head:
            return Root(
                None, finding=Finding(undecided=(Undecided("weights.root", what, "check `df -P -k` on the head"),))
            )
        return Root(None, finding=Finding(warnings=(what,)))
    best = max(measured, key=lambda c: c.available_kib or 0)  # max keeps the first of equals
    free = (best.available_kib or 0) / GIB_KIB
    home = probe.user.home if probe.user else ""
    at_home = bool(home) and best.path == home
    shown = "~" if at_home else best.path
    where = f"{shown}: {free:.1f} GiB free ({best.fstype} on {best.filesystem}, mounted at {best.mount})"
    if not head:
        return Root(
            None, finding=Finding(found=(f"disk: most free at {where}; a worker needs it only with `share: copy`",))
        )
    if free < min_gib:
        return Root(
            None,
            finding=Finding(
                found=(f"disk: most free at {where}",),
                undecided=(
                    Undecided(
                        "weights.root",
                        f"no candidate root has preflight.minFreeDiskGiB {min_gib:g} GiB free (most: {where})",
                        "free space or mount a larger disk, then set weights.root to a directory on it",
                    ),
                ),
            ),
        )
    if at_home:
        root = f"~/{WEIGHTS_DIR}"
        return Root(
            root,
            finding=Finding(
                found=(
                    f"disk: most free at {where}: enough for the weights ({min_gib:g} GiB)",
                    f"weights.root: {root} (staging creates it; with `share: nfs` the home must be o+x: `chmod o+x ~`)",
                )
            ),
        )
    root = f"{best.path.rstrip('/')}/{WEIGHTS_DIR}"
    create = f"sudo install -d -o {user} -m 0755 {root}"
    return Root(
        root,
        create,
        Finding(
            found=(
                f"disk: most free at {where}: enough for the weights ({min_gib:g} GiB)",
                f"weights.root: {root}; create it first: {create}",
            )
        ),
    )


def decide_docker(probe: Probe, user: str) -> Finding:
    d = probe.docker
    if d is None:
        reason = probe.unavailable.get("docker", "not read")
        return Finding(
            undecided=(
                Undecided(
                    "user",
                    f"docker is not usable on this node ({reason})",
                    "install Docker and the NVIDIA Container Toolkit (DGX OS ships both)",
                ),
            )
        )
    if not d.usable:
        said = d.errors[0] if d.errors else f"docker info exited {d.exit_code}"
        lowered = said.lower()
        if "permission denied" in lowered:
            fix = (
                f"`sudo usermod -aG docker {user}`, then log in again (a new SSH connection; this tool's shared one "
                "closes 2 minutes after it ends)"
            )
        elif "cannot connect" in lowered or "is the docker daemon running" in lowered:
            fix = "start the daemon: `sudo systemctl enable --now docker`"
        else:
            fix = f"run `docker info` as {user} on the node and fix what it says"
        return Finding(undecided=(Undecided("user", f"docker is not usable by {user}: {said}", fix),))
    runtimes = ", ".join(d.runtimes) or "none listed"
    found = (f"docker: server {d.server_version}, usable by {user}; runtimes: {runtimes}",)
    if "nvidia" in d.runtimes:
        return Finding(found=found)
    return Finding(
        found=found,
        warnings=(
            "docker lists no `nvidia` runtime: `gpus: all` needs the NVIDIA Container Toolkit (`sudo nvidia-ctk "
            "runtime configure --runtime=docker && sudo systemctl restart docker`)",
        ),
    )


def decide_gpu(probe: Probe) -> Finding:
    g = probe.gpu
    if g is None:
        return Finding(warnings=(f"GPU not checked ({probe.unavailable.get('gpu', 'not read')})",))
    if g.gpus:
        return Finding(found=tuple(f"gpu: {line}" for line in g.gpus))
    said = g.said or f"nvidia-smi -L exited {g.exit_code}"
    return Finding(
        undecided=(
            Undecided(
                "gpus",
                f"nvidia-smi lists no GPU ({said})",
                "check the NVIDIA driver (`nvidia-smi`); reboot after an update",
            ),
        )
    )


def decide_nfs(probe: Probe, user: str) -> Finding:
    """The head, for `share: nfs`: nfs-kernel-server installed, and root or `sudo -n` for what the export runs."""
    found: list[str] = []
    warnings: list[str] = []
    undecided: list[Undecided] = []
    copy = "or `share: copy` (each worker keeps its own copy; no NFS)"
    if probe.nfs is None:
        warnings.append(
            f"nfs-kernel-server not checked ({probe.unavailable.get('nfs', 'not read')}): `share: nfs` needs an NFS "
            "server on the head"
        )
    elif probe.nfs.installed:
        found.append("nfs: nfs-kernel-server installed")
    else:
        undecided.append(
            Undecided(
                "weights.share",
                f"nfs-kernel-server is not installed on the head (dpkg: {probe.nfs.status or 'no status'})",
                f"`sudo apt-get install nfs-kernel-server`, {copy}",
            )
        )
    sudoers = (
        f"`{user} ALL=(root) NOPASSWD: {', '.join(EXPORT_COMMANDS)}` in {SUDOERS_FILE} (`sudo visudo -f "
        f"{SUDOERS_FILE}`; those tools can write any file as root: a user who should not be root uses `share: copy`)"
    )
    if probe.user is not None and probe.user.uid == 0:
        found.append("sudo: not needed (root)")
    elif probe.sudo is None:
        undecided.append(
            Undecided(
                "weights.share",
                f"the export runs exportfs as root, and {user} is not root "
                f"({probe.unavailable.get('sudo', 'no sudo')})",
                f"install sudo and add {sudoers}, {copy}",
            )
        )
    elif probe.sudo.sudo_true == 0:
        found.append("sudo: `sudo -n` allowed (no password)")
    else:
        listed = dict(probe.sudo.listed)
        refused = [c for c in EXPORT_COMMANDS if listed.get(c, 1) != 0]
        if refused:
            undecided.append(
                Undecided(
                    "weights.share",
                    f"`sudo -n` is refused for {', '.join(refused)} (the export runs them as root)",
                    f"add {sudoers}",
                )
            )
        else:
            found.append(f"sudo: `sudo -n` allowed for {', '.join(c.rsplit('/', 1)[-1] for c in EXPORT_COMMANDS)}")
    return Finding(tuple(found), tuple(warnings), tuple(undecided))


def decide_leftovers(probe: Probe) -> Finding:
    left = probe.leftovers
    if left is None or left.exit_code != 0:
        return Finding()  # no docker: decide_docker already says so
    if not left.containers:
        return Finding(found=("leftovers: no container of any stack",))
    names = " ".join(c.name for c in left.containers)
    listed = ", ".join(f"{c.name} ({c.status}; stack {c.stack or '?'})" for c in left.containers)
    return Finding(
        warnings=(
            f"containers left by a stack: {listed}; `pulumi up` stops this stack's own, another stack's keep the GPU. "
            f"Only if you mean to remove them: `docker rm -f {names}` (or `pulumi destroy` of their stack)",
        )
    )


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


# --- output ------------------------------------------------------------------------------------------------------

_PLAIN = re.compile(r"^[A-Za-z0-9_/~][A-Za-z0-9_./~-]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def yaml_scalar(value: str) -> str:
    """A string as YAML reads it back unchanged: plain when it cannot be mistaken for anything else."""
    if _PLAIN.match(value) and value.lower() not in _YAML_WORDS and not _is_number(value):
        return value
    return json.dumps(value)


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def node_config(n: NodeReport) -> dict[str, Any]:
    """The node's `nodes[]` entry: decided values, NOT_DECIDED where a value is missing (the config refuses it)."""
    entry: dict[str, Any] = {"name": n.name, "host": n.spec.host}
    if n.spec.port != 22:
        entry["port"] = n.spec.port
    entry["user"] = n.spec.user
    f = n.fabric
    entry["fabricIp"] = f.ip
    entry["fabricInterface"] = f.interface
    entry["ibHcas"] = list(f.hcas) if f.hcas is not None else None
    entry["gidIndex"] = None if f.ip is None else "auto"
    undecided = {key for u in n.undecided for key in u.key.split(", ")}
    return {key: None if key in undecided else value for key, value in entry.items()}


def _yaml_entry(n: NodeReport) -> list[str]:
    entry = node_config(n)
    lines = []
    for i, (key, value) in enumerate(entry.items()):
        lead = "    - " if i == 0 else "      "
        if value is None:
            text = json.dumps(NOT_DECIDED)
        elif isinstance(value, list):
            text = "[" + ", ".join(yaml_scalar(v) for v in value) + "]"
        elif isinstance(value, int):
            text = str(value)
        else:
            text = yaml_scalar(value)
        if key == "gidIndex" and value == "auto" and n.fabric.gid_index is not None:
            text += f"  # index {n.fabric.gid_index} on this node now; resolved again at every up"
        lines.append(f"{lead}{key}: {text}")
    return lines


def yaml_block(report: Report) -> str:
    """The `nodes:` and `weights:` blocks as the template (Pulumi.dev.yaml) spells them, to paste under `config:`."""
    lines = [f"  {NAMESPACE}:nodes:"]
    for n in report.nodes:
        lines.extend(_yaml_entry(n))
    head = report.nodes[0] if report.nodes else None
    root = head.root.root if head is not None and head.root is not None else None
    lines += [
        f"  {NAMESPACE}:weights:",
        f"    root: {yaml_scalar(root) if root else json.dumps(NOT_DECIDED)}",
        f"    share: {Weights().share}",
    ]
    return "\n".join(lines)


def ssh_lines(report: Report) -> list[str]:
    """The stack's `ssh.*` keys for what this run used (the key's text is set from its file, never printed)."""
    out = []
    if report.identity:
        out.append(f"pulumi config set --secret --path ssh.privateKey < {report.identity}")
    if report.agent:
        out.append(f'pulumi config set --path ssh.agentSocket "{report.agent}"')
    if report.known_hosts:
        out.append(f"pulumi config set --path ssh.knownHostsFile {report.known_hosts}")
    return out


def _block(n: NodeReport) -> list[str]:
    lines = [f"# node {n.index + 1} ({n.role}): {n.spec.text}"]
    if n.reached.host_key:
        lines.append(f"#   host key: {n.reached.host_key}")
    if n.reached.error is not None:
        lines.append(f"#   not reached: {n.reached.error}")
        return lines
    everything = n.fabric.finding + n.finding
    lines += [f"#   {line}" for line in everything.found]
    lines += [f"#   warning: {line}" for line in everything.warnings]
    lines += [f"#   could not decide {u.line()}" for u in everything.undecided]
    return lines


def format_report(report: Report) -> str:
    lines: list[str] = []
    for n in report.nodes:
        lines += _block(n)
    lines.append("# paste under `config:` in Pulumi.<stack>.yaml (replacing the template's blocks):")
    lines.append(yaml_block(report))
    for line in ssh_lines(report):
        lines.append(f"# {line}")
    undecided = [(n, u) for n in report.nodes for u in n.undecided]
    lines.append("# could not decide:" + ("" if undecided else " nothing"))
    lines += [f"#   - {n.name} ({n.spec.text}) {u.line()}" for n, u in undecided]
    # A comment line carries what a node printed: one line each, with nothing the terminal would act on. The
    # YAML block's values are JSON-quoted already where they are not plain words.
    return "\n".join(terminal_safe(line) if line.startswith("#") else line for line in lines)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """`text` with every control character (escape sequences, newlines, carriage returns) shown as `\\xNN`."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def as_json(report: Report) -> dict[str, Any]:
    nodes = []
    for n in report.nodes:
        everything = n.fabric.finding + n.finding
        nodes.append(
            {
                "name": n.name,
                "role": n.role,
                "target": n.spec.text,
                "reached": n.reached.error is None,
                "error": n.reached.error,
                "hostKey": n.reached.host_key,
                "config": node_config(n),
                "gidIndexFound": n.fabric.gid_index,
                "weightsRoot": n.root.root if n.root else None,
                "createWeightsRoot": n.root.create if n.root else None,
                "found": list(everything.found),
                "warnings": list(everything.warnings),
                "couldNotDecide": [{"key": u.key, "reason": u.reason, "fix": u.fix or None} for u in n.undecided],
            }
        )
    return {
        "ok": report.ok,
        "nodes": nodes,
        "yaml": yaml_block(report),
        "ssh": ssh_lines(report),
        "couldNotDecide": [
            {"node": n.name, "key": u.key, "reason": u.reason, "fix": u.fix or None}
            for n in report.nodes
            for u in n.undecided
        ],
    }


# --- the command -------------------------------------------------------------------------------------------------


def _parser(prog: str) -> OperatorParser:
    parser = OperatorParser(
        prog=prog,
        allow_abbrev=False,
        description="Read only: each Spark's stack config lines (the first is the head), and what could not be "
        "decided, with the fix.",
    )
    parser.add_argument("targets", nargs="+", metavar=FORM, help="the nodes; the first is the head")
    parser.add_argument("--identity", metavar="FILE", help="private key file (else the agent at $SSH_AUTH_SOCK)")
    parser.add_argument("--known-hosts", metavar="FILE", help="the known_hosts file (default ~/.ssh/known_hosts)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the summary")
    return parser


def _read_identity(path: str) -> str:
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        raise OperatorError(f"--identity {path}: cannot read it ({why})") from None
    if "PRIVATE KEY-----" not in text:
        raise OperatorError(f"--identity {path} is not a private key file (a .pub?): give the private key's path")
    return text


def discover(
    target_args: Sequence[str],
    identity: str | None,
    known_hosts: str | None,
    run: Run = run_ssh,
    pin: Pin = host_keys.pin_all,
) -> Report:
    """Every node's report (the first is the head); a bad argument raises OperatorError before any connection."""
    specs = [parse_target(t) for t in target_args]
    seen: dict[tuple[str, int], str] = {}
    for arg, s in zip(target_args, specs, strict=True):
        if (s.host, s.port) in seen:
            raise OperatorError(f"{arg!r} names the same node as {seen[(s.host, s.port)]!r}: give each node once")
        seen[(s.host, s.port)] = arg
    key = _read_identity(identity) if identity else None
    agent = os.environ.get("SSH_AUTH_SOCK") or None
    known = str(Path(known_hosts).expanduser().absolute()) if known_hosts else None
    targets = [
        SshTarget(host=s.host, port=s.port, user=s.user, private_key=key, agent_socket=agent, known_hosts_file=known)
        for s in specs
    ]
    path = str(Path(identity).expanduser()) if identity else None
    return Report(collect(specs, targets, run=run, pin=pin), identity=path, agent=agent, known_hosts=known)


def unreached_lines(report: Report) -> list[str]:
    return [
        f"error: node {n.index + 1} ({n.role}) {n.spec.text}: {n.reached.error}"
        for n in report.nodes
        if n.reached.error is not None
    ]


def main(
    argv: Sequence[str] | None = None,
    run: Run = run_ssh,
    pin: Pin = host_keys.pin_all,
    prog: str = "dsv41-exl3 discover",
) -> int:
    try:
        options = _parser(prog).parse_args(argv)
        report = discover(options.targets, options.identity, options.known_hosts, run=run, pin=pin)
    except OperatorError as error:
        print(f"error: {error}", file=sys.stderr)
        return Exit.USAGE
    for line in unreached_lines(report):
        print(terminal_safe(line), file=sys.stderr)
    print(json.dumps(as_json(report), indent=1) if options.json else format_report(report))
    return Exit.OK if report.ok else Exit.FAILED
