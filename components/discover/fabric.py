"""Discovery's fabric decisions: the interface, address and HCAs a node serves on, and the RoCE v2 GID index by
gid_check.sh's rule (what `gidIndex: auto` applies again at every up). Runs on the operator's machine."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, replace

from components.discover.findings import GID_PORT, IPV4_MAPPED, NO_RDMA, ROCE_V2, Finding, Undecided
from components.discover.parse import Gid, Interface, Probe, Rdma
from components.preflight.gid import ipv4_mapped_gid

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
