"""Addresses from `nodes[].host` (components/access/addresses.py): decided on the operator's machine, rendered
everywhere a listener binds or a URL points, never a name left for a container to resolve (issue 34, item 3).

Resolvers here are fakes: no test resolves a name through DNS (only `localhost`, through /etc/hosts)."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from components.access.addresses import (
    AddressError,
    decide,
    host_port,
    http_url,
    resolve,
    system_resolver,
)
from components.config import parse
from tests.support.graph import config


def fake(table: Mapping[str, Sequence[str]]) -> Any:
    """A resolver that knows `table` and nothing else, as getaddrinfo fails on an unknown name."""

    def lookup(name: str) -> Sequence[str]:
        if name not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[name]

    return lookup


def nodes(*hosts: str) -> list[Any]:
    raw = config(len(hosts))
    for n, host in zip(raw["nodes"], hosts, strict=True):
        n["host"] = host
    return parse(raw).settings.nodes


# --- the decision --------------------------------------------------------------------------------


def test_an_ip_literal_is_kept_as_given_without_a_lookup() -> None:
    """The simulated cluster's nodes are 127.0.0.x of one machine: a literal is the operator's decision."""
    asked: list[str] = []

    def spy(name: str) -> list[str]:
        asked.append(name)
        return []

    got = resolve(nodes("127.0.0.2", "127.0.0.3"), spy)
    assert [r.address for r in got.nodes] == ["127.0.0.2", "127.0.0.3"]
    assert decide("nodes[0].host", "fd7a:115c:a1e0::1", spy) == "fd7a:115c:a1e0::1"
    assert asked == []


def test_a_name_resolves_to_its_lan_address() -> None:
    got = resolve(
        nodes("spark-1", "spark-2.local"), fake({"spark-1": ["192.168.1.10"], "spark-2.local": ["192.168.1.11"]})
    )
    assert [(r.key, r.host, r.address) for r in got.nodes] == [
        ("nodes[0].host", "spark-1", "192.168.1.10"),
        ("nodes[1].host", "spark-2.local", "192.168.1.11"),
    ]
    assert got.head.address == "192.168.1.10" and got.of("spark-1").address == "192.168.1.11"


def test_the_ipv4_address_comes_first_and_loopback_or_link_local_are_skipped() -> None:
    found = ["fe80::1%enP7s7", "127.0.1.1", "fd7a:115c:a1e0::9", "100.101.102.103", "100.101.102.103"]
    assert decide("nodes[0].host", "spark-1", fake({"spark-1": found})) == "100.101.102.103"
    assert decide("nodes[0].host", "spark-1", fake({"spark-1": ["::1", "fd7a:115c:a1e0::9"]})) == "fd7a:115c:a1e0::9"


def test_a_name_that_resolves_only_to_127_0_1_1_is_refused_naming_the_key_the_value_and_the_fix() -> None:
    """Ubuntu's /etc/hosts maps a machine's own name to 127.0.1.1: the operator typed its own head's name."""
    with pytest.raises(AddressError) as err:
        resolve(nodes("spark-1", "10.0.0.2"), fake({"spark-1": ["127.0.1.1"]}))
    (problem,) = err.value.problems
    assert problem.startswith('`nodes[0].host` = "spark-1" resolves only to loopback on this machine (127.0.1.1)')
    assert "fix: set it to the node's LAN or Tailscale address" in problem
    assert "node address(es) refused, before any resource or connection" in str(err.value)


def test_localhost_resolves_only_to_loopback_and_is_refused() -> None:
    """This machine's own resolver (its /etc/hosts, no network): loopback only, so refused."""
    assert all(a.startswith("127.") or a == "::1" for a in system_resolver("localhost"))
    with pytest.raises(ValueError, match="resolves only to loopback"):
        decide("nodes[0].host", "localhost", system_resolver)


def test_an_unresolvable_name_is_refused_with_the_resolvers_error_and_every_problem_together() -> None:
    with pytest.raises(AddressError) as err:
        resolve(nodes("spark-1.local", "spark-2"), fake({"spark-2": ["::1"]}))
    first, second = err.value.problems
    assert first.startswith('`nodes[0].host` = "spark-1.local" does not resolve on this machine (')
    assert "Name or service not known" in first and "fix: set it to the node's LAN or Tailscale address" in first
    assert second.startswith('`nodes[1].host` = "spark-2" resolves only to loopback on this machine (::1)')


def test_a_name_with_no_usable_address_and_an_unspecified_literal_are_refused() -> None:
    with pytest.raises(ValueError, match=r"resolves to no address a listener can use on this machine \(fe80::1"):
        decide("nodes[1].host", "spark-2", fake({"spark-2": ["fe80::1%eth0"]}))
    with pytest.raises(ValueError, match=r'`nodes\[0\].host` = "0.0.0.0" is not one machine\'s address'):
        decide("nodes[0].host", "0.0.0.0", fake({}))


def test_an_ipv6_address_is_bracketed_wherever_a_port_follows() -> None:
    assert host_port("192.168.1.10", 8888) == "192.168.1.10:8888"
    assert host_port("fd7a:115c:a1e0::1", 8888) == "[fd7a:115c:a1e0::1]:8888"
    assert http_url("fd7a:115c:a1e0::1", 8888, "/v1") == "http://[fd7a:115c:a1e0::1]:8888/v1"
