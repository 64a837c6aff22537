"""Addresses from `nodes[].host` (components/access/addresses.py): decided on the operator's machine, rendered
everywhere a listener binds or a URL points, never a name left for a container to resolve (issue 34, item 3).

Resolvers here are fakes: no test resolves a name through DNS (only `localhost`, through /etc/hosts)."""

from __future__ import annotations

import base64
import io
import json
import socket
import tarfile
from collections.abc import Mapping, Sequence
from typing import Any

import pulumi
import pytest
import yaml

from components.access.addresses import (
    AddressError,
    decide,
    host_port,
    http_url,
    resolve,
    system_resolver,
)
from components.config import parse
from components.deployment import deploy
from components.observability import spec as obs_spec
from tests.support import recording
from tests.support.graph import CONTAINER, FIXTURES, config


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


def test_loopback_is_taken_only_when_every_node_is_on_it() -> None:
    """One machine's cluster (the simulated one, given by name): loopback reaches every node. A loopback literal
    beside a node elsewhere could not be reached from it."""
    got = resolve(nodes("sim-1", "sim-2"), fake({"sim-1": ["127.0.0.2"], "sim-2": ["127.0.0.3"]}))
    assert [r.address for r in got.nodes] == ["127.0.0.2", "127.0.0.3"]
    assert [r.address for r in resolve(nodes("127.0.0.2", "sim-2"), fake({"sim-2": ["127.0.0.3"]})).nodes] == [
        "127.0.0.2",
        "127.0.0.3",
    ]
    with pytest.raises(AddressError) as err:
        resolve(nodes("127.0.0.1", "10.0.0.2"), fake({}))
    (problem,) = err.value.problems
    assert problem.startswith('`nodes[0].host` = "127.0.0.1" is a loopback address while other nodes are not')


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


# --- what the program renders from it ---------------------------------------------------------------

NAMES = {"spark-0.local": ["192.168.1.10"], "spark-1.local": ["192.168.1.11"]}


@pytest.fixture(scope="module")
def named() -> recording.Recorded:
    """The quick start's shape: nodes given by name; the operator's machine resolves them to LAN addresses."""
    raw = config(2)
    raw["nodes"][0]["host"], raw["nodes"][1]["host"] = "spark-0.local", "spark-1.local"
    loaded = parse(raw)
    return recording.run(lambda: deploy(loaded, "dev", resolver=fake(NAMES)), FIXTURES)


def agent_config(rec: recording.Recorded, node: str) -> dict[str, Any]:
    value = rec.named(f"supervisor-{node}-files").inputs["stdin"]
    if isinstance(value, dict):  # a secret, as the mock monitor keeps it
        value = value["value"]
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(value))) as tar:
        return json.loads(tar.extractfile("config.json").read())  # type: ignore[union-attr]


def test_no_container_is_left_a_name_to_resolve(named: recording.Recorded) -> None:
    containers = named.of_type(CONTAINER)
    assert {c.name for c in containers} >= {"observability-prometheus", "supervisor-spark-0", "serving-spark-0"}
    for c in containers:
        text = json.dumps(c.inputs, default=str)
        for name in NAMES:
            assert name not in text, f"{c.name}: a container would resolve {name} itself"
    for node in ("spark-0", "spark-1"):
        assert not any(name in json.dumps(agent_config(named, node)) for name in NAMES), node


def test_prometheus_listens_and_scrapes_vllm_at_the_heads_resolved_address(named: recording.Recorded) -> None:
    prom = named.named("observability-prometheus")
    assert "--web.listen-address=192.168.1.10:18390" in prom.inputs["entrypoints"]
    items = prom.inputs["uploads"]
    items = items["value"] if isinstance(items, dict) else items
    cfg = yaml.safe_load(next(u["content"] for u in items if u["file"].endswith("/prometheus.yml")))
    jobs = {j["job_name"]: [t for c in j["static_configs"] for t in c["targets"]] for j in cfg["scrape_configs"]}
    assert jobs["vllm"] == ["192.168.1.10:8888"], "vLLM at the endpoint's address"
    assert jobs["dsv41"] == ["192.168.100.1:18392", "192.168.100.2:18392"], "the exporters at the fabric IPs"
    assert jobs["node"] == ["192.168.100.1:18393", "192.168.100.2:18393"]


def test_the_head_agent_listens_on_its_fabric_and_resolved_addresses_the_workers_on_the_fabric(
    named: recording.Recorded,
) -> None:
    head, worker = agent_config(named, "spark-0"), agent_config(named, "spark-1")
    assert head["listen_hosts"] == ["192.168.100.1", "192.168.1.10"], "no longer 0.0.0.0"
    assert worker["listen_hosts"] == ["192.168.100.2"]
    assert head["leader"]["endpoint"] == "http://192.168.1.10:8888/v1"


def test_every_url_the_operators_machine_uses_is_the_resolved_address(named: recording.Recorded) -> None:
    out = named.outputs
    assert out["endpoint"] == "http://192.168.1.10:8888/v1"
    assert out["prometheusUrl"] == "http://192.168.1.10:18390"
    assert out["supervisor"]["url"] == "http://192.168.1.10:18391"
    assert named.named("verify").inputs["endpoint"] == "http://192.168.1.10:8888/v1"
    assert named.named("ready").inputs["api_base"] == "http://192.168.1.10:8888"
    live = named.named("live-ranks")
    assert live.inputs["endpoint"] == "http://192.168.1.10:8888/v1"
    assert live.inputs["supervisor_url"] == "http://192.168.1.10:18391"


def test_ssh_keeps_the_name(named: recording.Recorded) -> None:
    """ssh resolves it on the operator's machine, as the program did: the providers and gates dial the name."""
    providers = named.of_type("pulumi:providers:docker")
    assert {p.inputs["host"] for p in providers} == {"ssh://me@spark-0.local:22", "ssh://me@spark-1.local:22"}


def test_literal_addresses_render_as_before() -> None:
    """A stack that gave IP literals keeps every output as it was; the simulated cluster's head (host =
    fabricIp) listens on that one address."""
    rec = recording.run(lambda: deploy(parse(config(2)), "dev"), FIXTURES)
    assert rec.outputs["endpoint"] == "http://10.0.0.1:8888/v1"
    assert rec.outputs["prometheusUrl"] == "http://10.0.0.1:18390"
    assert rec.outputs["supervisor"]["url"] == "http://10.0.0.1:18391"
    assert agent_config(rec, "spark-0")["listen_hosts"] == ["192.168.100.1", "10.0.0.1"]
    raw = config(2)
    for n in raw["nodes"]:
        n["host"] = n["fabricIp"]
    sim = recording.run(lambda: deploy(parse(raw), "dev"), FIXTURES)
    assert agent_config(sim, "spark-0")["listen_hosts"] == ["192.168.100.1"]
    assert sim.outputs["endpoint"] == "http://192.168.100.1:8888/v1"


def test_a_refused_address_stops_the_program_before_any_resource() -> None:
    raw = config(2)
    raw["nodes"][0]["host"] = "spark-0"
    loaded = parse(raw)
    registered: list[recording.Registration] = []
    with pytest.raises(pulumi.RunError) as err:
        recording.run(
            lambda: deploy(loaded, "dev", resolver=fake({"spark-0": ["127.0.1.1"]})), FIXTURES, into=registered
        )
    assert registered == [], "refused before any resource (and any SSH dial)"
    assert '`nodes[0].host` = "spark-0" resolves only to loopback' in str(err.value)


def test_unit_tests_resolve_no_names_by_default() -> None:
    raw = config(2)
    raw["nodes"][1]["host"] = "spark-1"
    with pytest.raises(pulumi.RunError, match="unit tests resolve no names"):
        recording.run(lambda: deploy(parse(raw), "dev"), FIXTURES)


def test_the_observability_spec_renders_an_ipv6_head_in_brackets() -> None:
    s = parse(config(2)).settings
    assert obs_spec.listen_address(s, "fd7a::1") == "[fd7a::1]:18390"
    assert obs_spec.prometheus_url(s, "fd7a::1") == "http://[fd7a::1]:18390"
    assert obs_spec.targets(s, "fd7a::1")[0].address == "[fd7a::1]:8888"
