"""Each node's address as the operator's machine resolves `nodes[].host`: decided once per program run, here.

Pure logic but `system_resolver` (the operator's getaddrinfo). Every listener and URL the program renders from a
node's `host` uses the address decided here, never the name: Prometheus' listen address and its vLLM target,
`prometheusUrl`, the supervisor's URL and the head agent's second listener, and the `endpoint`. A name left for a
container to resolve may not resolve there at all (a `.local` name inside Prometheus' busybox image: it exits,
after the verifier passed) or may resolve to loopback (Ubuntu maps a machine's own name to 127.0.1.1: Prometheus
would listen for the head alone). The head's preflight checks on the node that the address is one of its own
(components/preflight). SSH keeps the name: ssh resolves it on this machine too, which is what this decides from.

An IP literal is kept as it is. A name that resolves only to loopback is refused while any other node is not on
loopback: it is the operator's own machine's name (Ubuntu's 127.0.1.1, or a mistake), and the listeners would
answer only there. When every node is on loopback they are all one machine (the simulated cluster's nodes are
127.0.0.2, 127.0.0.3, ... of one `lo`, by address or by name) and loopback is what reaches them.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from components.config import Node

Resolver = Callable[[str], Sequence[str]]
"""A name -> its addresses, best first (getaddrinfo's order); raises OSError when the name does not resolve."""

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

FIX = (
    "fix: set it to the node's LAN or Tailscale address (`hostname -I` on the node lists them), or to a name "
    "that resolves to that address on this machine"
)


def system_resolver(name: str) -> list[str]:
    """The operator's resolver (DNS, /etc/hosts, mDNS: whatever ssh on this machine would use)."""
    return [str(info[4][0]) for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)]


class AddressError(ValueError):
    """Every node address refused, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            f"{len(problems)} node address(es) refused, before any resource or connection:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """One node's `host` and the address the program renders for it."""

    node: str
    key: str
    """The config key, e.g. `nodes[0].host`: what a refusal names."""
    host: str
    """As configured (what SSH dials)."""
    address: str
    """An IP address: `host` itself when it is one, else what it resolved to on the operator's machine."""


@dataclass(frozen=True)
class Addresses:
    """Every node's decided address, the head's first."""

    nodes: tuple[Resolved, ...]

    @property
    def head(self) -> Resolved:
        return self.nodes[0]

    def of(self, node: str) -> Resolved:
        return next(r for r in self.nodes if r.node == node)


def _literal(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _usable(found: Sequence[str]) -> tuple[list[str], list[str]]:
    """(addresses a listener and a client can use, IPv4 first; the loopback ones), each once, in resolver order."""
    usable: list[Address] = []
    loopback: list[str] = []
    for text in dict.fromkeys(found):
        # getaddrinfo may append an IPv6 scope (`fe80::1%eth0`): a link-local address is not one to render.
        ip = _literal(text.split("%", 1)[0])
        if ip is None or ip.is_unspecified or ip.is_multicast or (ip.version == 6 and ip.is_link_local):
            continue
        if ip.is_loopback:
            loopback.append(str(ip))
        else:
            usable.append(ip)
    usable.sort(key=lambda ip: ip.version)  # stable: IPv4 first, each family in the resolver's order
    return [str(ip) for ip in usable], loopback


def decide(key: str, host: str, resolver: Resolver, *, allow_loopback: bool = False) -> str:
    """The address to render for `host` (config key `key`); ValueError with the problem and the fix.
    `allow_loopback`: a name that resolves only to loopback is taken (every node is this one machine)."""
    shown = json.dumps(host)
    literal = _literal(host)
    if literal is not None:
        if literal.is_unspecified or literal.is_multicast:
            raise ValueError(f"`{key}` = {shown} is not one machine's address; {FIX}")
        return host
    try:
        found = list(resolver(host))
    except OSError as error:
        raise ValueError(
            f"`{key}` = {shown} does not resolve on this machine ({error}): the program renders the endpoint, "
            f"Prometheus and the supervisor's address from what it resolves to here; {FIX}"
        ) from None
    usable, loopback = _usable(found)
    if usable:
        return usable[0]
    if loopback and allow_loopback:
        return loopback[0]
    if loopback:
        raise ValueError(
            f"`{key}` = {shown} resolves only to loopback on this machine ({', '.join(loopback)}): Ubuntu maps a "
            "machine's own name to 127.0.1.1, so this names the machine you run Pulumi on, and a listener there "
            f"would answer that machine alone; {FIX}"
        )
    raise ValueError(
        f"`{key}` = {shown} resolves to no address a listener can use on this machine "
        f"({', '.join(found) or 'none'}); {FIX}"
    )


def _on_loopback(host: str, resolver: Resolver) -> bool:
    """Whether `host` is, or resolves only to, a loopback address (False when it does not resolve)."""
    literal = _literal(host)
    if literal is not None:
        return literal.is_loopback
    try:
        usable, loopback = _usable(list(resolver(host)))
    except OSError:
        return False
    return not usable and bool(loopback)


def resolve(nodes: Sequence[Node], resolver: Resolver | None = None) -> Addresses:
    """Every node's address, each name resolved once; AddressError lists every refusal together.

    Loopback is taken only when every node is on it: then they are all this one machine (the simulated cluster,
    whose nodes are 127.0.0.2, 127.0.0.3, ... and may be given by name), and loopback reaches each of them. Where
    any node is elsewhere, a node on loopback could not be reached from it: refused."""
    lookup = resolver or system_resolver
    cache: dict[str, Sequence[str]] = {}

    def once(name: str) -> Sequence[str]:
        if name not in cache:
            cache[name] = list(lookup(name))
        return cache[name]

    one_machine = all(_on_loopback(n.host, once) for n in nodes)
    decided: list[Resolved] = []
    problems: list[str] = []
    for i, n in enumerate(nodes):
        key = f"nodes[{i}].host"
        try:
            literal = _literal(n.host)
            if literal is not None and literal.is_loopback and not one_machine:
                raise ValueError(
                    f"`{key}` = {json.dumps(n.host)} is a loopback address while other nodes are not on this "
                    f"machine: they could not reach it; {FIX}"
                )
            address = decide(key, n.host, once, allow_loopback=one_machine)
            decided.append(Resolved(node=n.name, key=key, host=n.host, address=address))
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise AddressError(problems)
    return Addresses(tuple(decided))


def host_port(address: str, port: int) -> str:
    """`address:port`, an IPv6 address in brackets (a listen address, a scrape target, a URL's authority)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def http_url(address: str, port: int, path: str = "") -> str:
    return f"http://{host_port(address, port)}{path}"
