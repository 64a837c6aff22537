"""probe.sh itself, run by sh against a fake sysfs and stand-in commands: what it prints parses to what the
captured fixtures say, the decisions over it are the expected ones, and its GID decision is gid_check.sh's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from components.discover.checks import decide_disk, decide_docker, decide_nfs
from components.discover.fabric import decide_fabric, resolve_gid
from components.discover.parse import Probe, Rdma, parse_ib, parse_ip, parse_probe
from components.preflight.gid import SYSFS_ROOT_ENV, render_gid_check
from tests.discover.nodes import FIXTURES, FakeNode, fake_node, fixture, sysfs_tree

pytestmark = pytest.mark.timeout(60)
SYSFS_CASES = Path(__file__).parents[1] / "support" / "fixtures" / "sysfs"


def probed(node: FakeNode) -> Probe:
    ran = node.run()
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr == "", "the probe reports through its sections, never on stderr"
    return parse_probe(ran.stdout)


def _same_table(a: Rdma, b: Rdma) -> None:
    assert sorted(a.ports, key=repr) == sorted(b.ports, key=repr)
    assert sorted(a.gids, key=repr) == sorted(b.gids, key=repr)
    assert sorted(a.netdevs) == sorted(b.netdevs)


def test_the_probe_prints_every_section_as_the_captured_formats_read(tmp_path: Path) -> None:
    node = fake_node(tmp_path)
    probe = probed(node)
    assert probe.unavailable == {}
    assert probe.rdma is not None
    _same_table(probe.rdma, parse_ib(fixture("ib_head.txt").splitlines()))
    assert probe.interfaces == parse_ip(["format json", *fixture("ip_head.json").splitlines()])
    assert probe.mem_available_kib == 123_865_232
    assert probe.mem_free_kib == 119_208_312
    assert probe.nfs_server is not None and probe.nfs_server.active
    assert probe.docker is not None and probe.docker.storage_driver == "overlay2"
    assert probe.docker is not None and probe.docker.usable and "nvidia" in probe.docker.runtimes
    assert probe.gpu is not None and probe.gpu.gpus[0].startswith("GPU 0: NVIDIA GB10")
    assert probe.nfs is not None and probe.nfs.installed
    assert probe.sudo is not None and probe.sudo.sudo_true == 1 and all(rc == 0 for _, rc in probe.sudo.listed)
    assert probe.user is not None and (probe.user.name, probe.user.uid, probe.user.shell) == (
        "nvidia",
        1000,
        "/bin/bash",
    )
    assert probe.disk is not None
    assert [c.path for c in probe.disk.candidates] == [*(str(r) for r in node.roots), str(node.home)]
    assert probe.disk.missing == (str(tmp_path / "missing"),)
    assert all(c.available_kib == 3_236_959_282 and c.filesystem == "/dev/nvme0n1p2" for c in probe.disk.candidates)


def test_parse_of_the_probes_own_output_gives_the_expected_decisions(tmp_path: Path) -> None:
    node = fake_node(tmp_path)
    probe = probed(node)
    f = decide_fabric(probe)
    assert (f.interface, f.ip, f.hcas, f.gid_index) == ("enp1s0f1np1", "192.168.100.1", ("rocep1s0f1",), 3)
    root = decide_disk(probe, "nvidia", head=True, min_gib=387)
    srv = node.roots[0]
    assert root.root == f"{srv}/dsv41-exl3" and root.create == f"sudo install -d -o nvidia -m 0755 {srv}/dsv41-exl3"
    assert decide_nfs(probe, "nvidia").undecided == () and decide_docker(probe, "nvidia").undecided == ()


def test_a_worker_through_the_probe_resolves_index_1(tmp_path: Path) -> None:
    f = decide_fabric(probed(fake_node(tmp_path, ib="ib_worker.txt", ip="ip_worker.json")))
    assert (f.interface, f.ip, f.hcas, f.gid_index) == ("enp1s0f0np0", "192.168.100.2", ("rocep1s0f0",), 1)


def test_leftovers_are_read_by_the_stacks_label_with_each_containers_stack(tmp_path: Path) -> None:
    node = fake_node(tmp_path, leftovers="dsv41-exl3-dev-spark-head|Exited (137) 2 days ago|dev")
    probe = probed(node)
    assert probe.leftovers is not None
    assert [(c.name, c.status, c.stack) for c in probe.leftovers.containers] == [
        ("dsv41-exl3-dev-spark-head", "Exited (137) 2 days ago", "dev")
    ]
    calls = node.docker_calls.read_text().splitlines()
    assert 'ps -a --filter label=dsv41-exl3.stack --format {{.Names}}|{{.Status}}|{{.Label "dsv41-exl3.stack"}}' in (
        calls
    )
    assert "info --format {{json .}}" in calls


def test_an_ip_without_json_falls_back_to_oneline_with_the_same_addresses(tmp_path: Path) -> None:
    probe = probed(fake_node(tmp_path, ip=None))
    assert probe.interfaces is not None and all(i.operstate is None for i in probe.interfaces)
    assert decide_fabric(probe).ip == "192.168.100.1"


def test_no_docker_is_two_unavailable_sections_and_an_undecided_user(tmp_path: Path) -> None:
    probe = probed(fake_node(tmp_path, docker=None))
    assert probe.unavailable == {"docker": "no docker command on PATH", "leftovers": "no docker command on PATH"}
    (u,) = decide_docker(probe, "nvidia").undecided
    assert u.key == "user" and "install Docker" in u.fix


def test_docker_without_access_through_the_probe(tmp_path: Path) -> None:
    probe = probed(fake_node(tmp_path, docker="docker_info_denied.txt", docker_exit=1))
    (u,) = decide_docker(probe, "nvidia").undecided
    assert "permission denied" in u.reason and "usermod -aG docker nvidia" in u.fix


def test_nfs_never_installed_and_sudo_refused_through_the_probe(tmp_path: Path) -> None:
    probe = probed(fake_node(tmp_path, nfs=None, sudo_l=1))
    assert probe.nfs is not None and not probe.nfs.installed
    reasons = [u.reason for u in decide_nfs(probe, "nvidia").undecided]
    assert any("nfs-kernel-server is not installed" in r for r in reasons)
    assert any(r.startswith("`sudo -n` is refused for /usr/sbin/exportfs") for r in reasons)


def test_low_disk_through_the_probe(tmp_path: Path) -> None:
    (u,) = decide_disk(
        probed(fake_node(tmp_path, df="df_small.txt")), "nvidia", head=True, min_gib=387
    ).finding.undecided
    assert u.key == "weights.root" and "387" in u.reason


def test_no_rdma_driver_and_no_meminfo_are_sections_that_say_so(tmp_path: Path) -> None:
    node = fake_node(tmp_path)
    node.env[SYSFS_ROOT_ENV] = str(tmp_path / "no-sys")
    node.env["DSV41_MEMINFO"] = str(tmp_path / "no-meminfo")
    probe = probed(node)
    assert probe.unavailable["ib"] == f"no {tmp_path}/no-sys/class/infiniband (no RDMA driver loaded)"
    assert probe.unavailable["meminfo"] == f"no MemAvailable in {tmp_path}/no-meminfo"
    assert probe.docker is not None  # the rest still ran


# --- the GID decision is gid_check.sh's ------------------------------------------------------------------------


def gid_check(root: Path, hcas: list[str], fabric_ip: str) -> int | None:
    """What the preflight's own script decides for `gidIndex: auto`: the index, or None when it refuses."""
    script = render_gid_check(hcas=hcas, fabric_ip=fabric_ip, wanted="auto")
    done = subprocess.run(
        ["sh", "-c", script],
        env={**os.environ, SYSFS_ROOT_ENV: str(root)},
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    index = [int(line.split()[1]) for line in lines if line.startswith("index ")]
    assert bool(index) != any(line.startswith("fail ") for line in lines), done.stdout
    return index[0] if index else None


def _hca_sets(rdma: Rdma) -> list[list[str]]:
    names = sorted({p.hca for p in rdma.ports})
    active = [p.hca for p in sorted(rdma.ports, key=repr) if p.state == "ACTIVE"]
    return [[h] for h in names] + ([active] if len(active) > 1 else []) + [["mlx5_9"]]


def _cases() -> list[tuple[str, Path | None, str]]:
    found: list[tuple[str, Path | None, str]] = [
        (case.name, case, "192.168.100.1") for case in sorted(SYSFS_CASES.iterdir()) if case.is_dir()
    ]
    found += [
        ("ib_head.txt", None, "192.168.100.1"),
        ("ib_worker.txt", None, "192.168.100.2"),
        ("ib_no_v2.txt", None, "192.168.100.2"),
        ("ib_down.txt", None, "192.168.100.2"),
    ]
    return found


@pytest.mark.parametrize("name, tree, fabric_ip", _cases(), ids=[c[0] for c in _cases()])
def test_the_gid_index_decided_here_is_the_one_gid_check_sh_resolves(
    tmp_path: Path, name: str, tree: Path | None, fabric_ip: str
) -> None:
    root = tree if tree is not None else sysfs_tree(tmp_path / "sys", (FIXTURES / name).read_text())
    probe = probed(fake_node(tmp_path / "node", sysfs=root))
    assert probe.rdma is not None
    checked = 0
    for hcas in _hca_sets(probe.rdma):
        ours = resolve_gid(probe.rdma, hcas, fabric_ip).index
        assert ours == gid_check(root, hcas, fabric_ip), f"{name} {hcas}: discover says {ours}"
        checked += 1
    assert checked >= 2
