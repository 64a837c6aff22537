"""The RoCE GID decision (components/preflight/gid_check.sh, rendered by gid.py) run with sh against fixtures.

Each tree under tests/support/fixtures/sysfs/<case>/class/infiniband/ is a small copy of what a GB10
node shows: four HCAs (rocep1s0f0, rocep1s0f1, roceP2p1s0f0, roceP2p1s0f1), port states
and GID tables with their RoCE types.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from components.preflight.gid import check_gid_wanted, check_hca_name, ipv4_mapped_gid, render_gid_check

FIXTURES = Path(__file__).parents[1] / "support" / "fixtures" / "sysfs"
FABRIC_IP = "192.168.100.1"


@dataclass(frozen=True)
class Decision:
    index: int | None
    failures: list[str]


def decide(case: str, hcas: list[str], wanted: int | str = "auto", fabric_ip: str = FABRIC_IP) -> Decision:
    root = FIXTURES / case
    assert root.is_dir(), f"fixture tree {root} is missing"
    script = render_gid_check(hcas=hcas, fabric_ip=fabric_ip, wanted=wanted)  # type: ignore[arg-type]
    proc = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "DSV41_SYSFS_ROOT": str(root)},
    )
    assert proc.returncode == 0, f"gid_check itself broke: {proc.stderr}"
    index = None
    failures = []
    for line in proc.stdout.splitlines():
        if line.startswith("index "):
            index = int(line.removeprefix("index "))
        elif line.startswith("fail "):
            failures.append(line.removeprefix("fail "))
        elif line.strip():
            pytest.fail(f"unexpected gid_check output line {line!r}")
    assert (index is None) != (not failures), f"either an index or failures, got {proc.stdout!r}"
    return Decision(index, failures)


def test_ipv4_mapped_gid_matches_what_sysfs_shows() -> None:
    assert ipv4_mapped_gid("192.168.100.1") == "0000:0000:0000:0000:0000:ffff:c0a8:6401"
    assert ipv4_mapped_gid("10.0.0.2") == "0000:0000:0000:0000:0000:ffff:0a00:0002"


def test_non_ipv4_fabric_ip_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"fabric_ip 'fe80::1' is not an IPv4 address"):
        ipv4_mapped_gid("fe80::1")


@pytest.mark.parametrize("name", ["", "roce p1", "../etc", "a;b", "x" * 65])
def test_hca_names_that_cannot_be_devices_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="is not an RDMA device name"):
        check_hca_name(name)


@pytest.mark.parametrize("wanted", [-1, 256, True, "3", 3.0, None])
def test_gid_index_must_be_auto_or_a_small_int(wanted: object) -> None:
    with pytest.raises(ValueError, match="gid_index .* is invalid"):
        check_gid_wanted(wanted)


def test_render_needs_an_hca() -> None:
    with pytest.raises(ValueError, match="at least one HCA"):
        render_gid_check(hcas=[], fabric_ip=FABRIC_IP, wanted="auto")


def test_healthy_node_resolves_index_3() -> None:
    assert decide("healthy", ["rocep1s0f1"]) == Decision(3, [])


def test_healthy_node_accepts_configured_index_3_on_both_halves() -> None:
    # roceP2p1s0f1 holds its own address (192.168.100.3) at the same index
    assert decide("healthy", ["rocep1s0f1", "roceP2p1s0f1"], 3) == Decision(3, [])


def test_a_configured_down_hca_is_refused_even_on_a_healthy_node() -> None:
    d = decide("healthy", ["rocep1s0f0"])
    assert d.index is None
    assert "HCA rocep1s0f0 port 1 is DOWN" in d.failures[0]


def test_two_down_hcas_are_each_named_with_the_active_alternatives() -> None:
    d = decide("two-down", ["rocep1s0f1", "roceP2p1s0f1"])
    assert d.index is None
    assert len(d.failures) == 2, d.failures
    assert "HCA rocep1s0f1 port 1 is DOWN, not ACTIVE" in d.failures[0]
    assert "HCA roceP2p1s0f1 port 1 is DOWN, not ACTIVE" in d.failures[1]
    for failure in d.failures:
        # the fix names the HCAs that are up on this node
        assert "ACTIVE HCAs: roceP2p1s0f0 rocep1s0f0" in failure


def test_moved_entry_auto_resolves_4() -> None:
    assert decide("moved", ["rocep1s0f1"]) == Decision(4, [])


def test_moved_entry_configured_3_is_refused_naming_4() -> None:
    d = decide("moved", ["rocep1s0f1"], 3)
    assert d.index is None
    (failure,) = d.failures
    assert "GID index 3 on rocep1s0f1 is fd00:" in failure
    assert "is at index 4 on this node" in failure
    assert "set gid_index to 4" in failure


def test_configured_index_matching_the_moved_entry_passes() -> None:
    assert decide("moved", ["rocep1s0f1"], 4) == Decision(4, [])


def test_all_zero_entry_fails_closed() -> None:
    d = decide("all-zero", ["rocep1s0f1"])
    assert d.index is None
    (failure,) = d.failures
    assert "no RoCE v2 GID entry holds 192.168.100.1 (0000:0000:0000:0000:0000:ffff:c0a8:6401)" in failure
    assert "errno 61" in failure
    assert "fix: assign 192.168.100.1" in failure


def test_all_zero_entry_configured_3_says_it_is_unset() -> None:
    (failure,) = decide("all-zero", ["rocep1s0f1"], 3).failures
    assert "index 3 on rocep1s0f1 is all-zero (unset)" in failure


def test_roce_v1_only_entry_is_refused() -> None:
    d = decide("v1-only", ["rocep1s0f1"])
    assert d.index is None
    (failure,) = d.failures
    assert "holds it only as RoCE v1 at index 1" in failure
    assert "enable RoCE v2 on rocep1s0f1" in failure


def test_missing_hca_is_refused_naming_it() -> None:
    d = decide("missing-hca", ["roceP2p1s0f1"])
    assert d.index is None
    (failure,) = d.failures
    assert "HCA roceP2p1s0f1 does not exist" in failure
    assert "ACTIVE HCAs: rocep1s0f1" in failure


def test_second_half_without_an_ipv4_entry_at_the_index_is_refused() -> None:
    d = decide("twin-unset", ["rocep1s0f1", "roceP2p1s0f1"])
    assert d.index is None
    (failure,) = d.failures
    assert "HCA roceP2p1s0f1 has no IPv4 RoCE v2 entry at GID index 3" in failure
    assert "all-zero" in failure


def test_a_fabric_ip_the_node_does_not_hold_is_refused() -> None:
    d = decide("healthy", ["rocep1s0f1"], fabric_ip="192.168.100.9")
    assert d.index is None
    assert "no RoCE v2 GID entry holds 192.168.100.9" in d.failures[0]


def test_missing_sysfs_root_fails_closed() -> None:
    # a node without any infiniband class: refused, not resolved
    script = render_gid_check(hcas=["rocep1s0f1"], fabric_ip=FABRIC_IP, wanted="auto")
    proc = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "DSV41_SYSFS_ROOT": str(FIXTURES / "no-such-tree")},
    )
    assert proc.stdout.startswith("fail HCA rocep1s0f1 does not exist"), proc.stdout
    assert "ACTIVE HCAs: none" in proc.stdout
