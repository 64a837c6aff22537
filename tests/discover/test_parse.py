"""probe.sh's report read back: each section from captured formats, and a section that cannot be read."""

from __future__ import annotations

import json

import pytest

from components.discover.parse import (
    Address,
    Gid,
    Leftover,
    Port,
    ProbeError,
    parse_df_line,
    parse_disk,
    parse_docker,
    parse_gpu,
    parse_ib,
    parse_ip,
    parse_leftovers,
    parse_meminfo,
    parse_nfs,
    parse_probe,
    parse_sudo,
    port_state,
    sections,
)
from tests.discover.nodes import fixture, probe_text

V4_HEAD = "0000:0000:0000:0000:0000:ffff:c0a8:6401"


def test_sections_split_at_markers_and_drop_what_comes_before_the_first() -> None:
    assert sections("motd line\n==a==\n1\n2\n==b==\n==end==\n") == {"a": ["1", "2"], "b": [], "end": []}


def test_a_report_without_end_is_refused_as_a_whole() -> None:
    with pytest.raises(ProbeError, match="cut short"):
        parse_probe(probe_text().replace("==end==\n", ""))


def test_ip_json_gives_every_interface_with_its_addresses() -> None:
    interfaces = {i.name: i for i in parse_ip(["format json", *fixture("ip_head.json").splitlines()])}
    assert set(interfaces) == {
        "lo",
        "enP7s7",
        "enp1s0f0np0",
        "enp1s0f1np1",
        "wlP9s9",
        "enP2p1s0f0np0",
        "enP2p1s0f1np1",
        "docker0",
    }
    fabric = interfaces["enp1s0f1np1"]
    assert fabric.operstate == "UP"
    assert fabric.ipv4 == (Address("inet", "192.168.100.1", 24),)
    assert interfaces["enP2p1s0f1np1"].ipv4 == ()  # the port's other half: only its IPv6 link-local address
    assert interfaces["enp1s0f0np0"].addresses == ()


def test_ip_oneline_the_fallback_gives_the_same_ipv4_addresses_as_json() -> None:
    oneline = {i.name: i.ipv4 for i in parse_ip(["format oneline", *fixture("ip_oneline.txt").splitlines()])}
    as_json = {i.name: i.ipv4 for i in parse_ip(["format json", *fixture("ip_head.json").splitlines()])}
    assert oneline == {name: as_json[name] for name in oneline}
    assert oneline["enp1s0f1np1"] == (Address("inet", "192.168.100.1", 24),)
    assert all(i.operstate is None for i in parse_ip(["format oneline", *fixture("ip_oneline.txt").splitlines()]))


def test_an_unknown_ip_format_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown format"):
        parse_ip(["format yaml", "x"])


def test_port_state_drops_sysfs_number() -> None:
    assert port_state("4: ACTIVE") == "ACTIVE" and port_state("1: DOWN") == "DOWN" and port_state("DOWN") == "DOWN"


def test_the_sysfs_table_of_a_healthy_head_four_hcas_two_down_one_ipv4_roce_v2_gid_at_3() -> None:
    rdma = parse_ib(fixture("ib_head.txt").splitlines())
    assert sorted(rdma.ports, key=lambda p: p.hca) == [
        Port("roceP2p1s0f0", "1", "DOWN"),
        Port("roceP2p1s0f1", "1", "ACTIVE"),
        Port("rocep1s0f0", "1", "DOWN"),
        Port("rocep1s0f1", "1", "ACTIVE"),
    ]
    assert ("rocep1s0f1", "enp1s0f1np1") in rdma.netdevs
    ipv4 = [g for g in rdma.gids if g.gid.startswith("0000:0000:0000:0000:0000:ffff:")]
    assert ipv4 == [
        Gid("rocep1s0f1", "1", 2, V4_HEAD, "enp1s0f1np1", "IB/RoCE v1"),
        Gid("rocep1s0f1", "1", 3, V4_HEAD, "enp1s0f1np1", "RoCE v2"),
    ]


def test_a_gid_whose_type_and_netdev_sysfs_would_not_give_reads_as_empty() -> None:
    (g,) = parse_ib([f"gid rocep1s0f1 1 7 {V4_HEAD.upper()} - -"]).gids
    assert (g.ndev, g.type, g.gid) == (None, "", V4_HEAD)


def test_meminfo_is_memavailable_in_kib() -> None:
    assert parse_meminfo(fixture("meminfo_idle.txt").splitlines()) == 123_865_232
    with pytest.raises(ValueError):
        parse_meminfo(["MemTotal: 1 kB"])


def test_docker_info_of_a_user_in_the_docker_group_is_usable_with_the_nvidia_runtime() -> None:
    d = parse_docker(["exit 0", *fixture("docker_info.json").splitlines()])
    assert d.usable and d.server_version == "28.3.3"
    assert d.runtimes == ("io.containerd.runc.v2", "nvidia", "runc")


def test_docker_28_without_access_prints_client_json_then_the_error_and_exits_1() -> None:
    d = parse_docker(["exit 1", *fixture("docker_info_denied.txt").splitlines()])
    assert not d.usable and d.server_version is None and d.runtimes == ()
    assert d.errors[0].startswith("permission denied while trying to connect to the Docker daemon socket")


def test_older_docker_reports_the_server_error_in_the_json_and_exits_0() -> None:
    data = {"ServerVersion": "", "ServerErrors": ["Cannot connect to the Docker daemon at unix:///var/run/docker.sock"]}
    d = parse_docker(["exit 0", json.dumps(data)])
    assert not d.usable and d.errors == ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock",)


def test_docker_that_printed_nothing_says_its_exit_status() -> None:
    assert parse_docker(["exit 125"]).errors == ("docker info exited 125 and printed nothing",)


def test_gpu_lines_and_a_failing_nvidia_smi() -> None:
    assert parse_gpu(["exit 0", *fixture("nvidia_smi.txt").splitlines()]).gpus == (
        "GPU 0: NVIDIA GB10 (UUID: GPU-5f0c3a1e-8d2b-4c6f-9a7e-1b2c3d4e5f60)",
    )
    said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    g = parse_gpu(["exit 9", said])
    assert g.gpus == () and g.said == said and g.exit_code == 9


def test_df_data_line_gives_device_available_kib_and_mount_point() -> None:
    assert parse_df_line(fixture("df_large.txt").splitlines()[1]) == ("/dev/nvme0n1p2", 3_236_959_282, "/")
    assert parse_df_line("/dev/sdb1 100 10 90 10% /mnt/big disk") == ("/dev/sdb1", 90, "/mnt/big disk")
    assert parse_df_line(fixture("df_large.txt").splitlines()[0]) is None  # the header


def test_disk_candidates_each_with_its_filesystem_and_the_missing_ones() -> None:
    disk = parse_disk(
        [
            "candidate ext2/ext3 /srv",
            "df " + fixture("df_large.txt").splitlines()[1],
            "missing /opt",
            "candidate nfs /home/nvidia",
            "df unavailable",
        ]
    )
    srv, home = disk.candidates
    assert (srv.path, srv.fstype, srv.filesystem, srv.available_kib, srv.mount) == (
        "/srv",
        "ext2/ext3",
        "/dev/nvme0n1p2",
        3_236_959_282,
        "/",
    )
    assert (home.path, home.available_kib) == ("/home/nvidia", None)
    assert disk.missing == ("/opt",)


@pytest.mark.parametrize(
    "lines, installed",
    [
        (["exit 0", "install ok installed"], True),
        (["exit 0", "unknown ok not-installed"], False),
        (["exit 0", "deinstall ok config-files"], False),
        (["exit 1", "dpkg-query: no packages found matching nfs-kernel-server"], False),
    ],
)
def test_nfs_is_installed_only_when_dpkg_says_install_ok_installed(lines: list[str], installed: bool) -> None:
    assert parse_nfs(lines).installed is installed


def test_sudo_statuses() -> None:
    s = parse_sudo(["sudo-true 1", "sudo-l 0 /usr/sbin/exportfs", "sudo-l 1 /usr/bin/rm"])
    assert s.sudo_true == 1 and s.listed == (("/usr/sbin/exportfs", 0), ("/usr/bin/rm", 1))


def test_leftovers_each_with_status_and_stack_and_a_failing_docker_ps() -> None:
    left = parse_leftovers(["exit 0", "dsv41-exl3-dev-spark-head|Exited (137) 2 days ago|dev", ""])
    assert left.containers == (Leftover("dsv41-exl3-dev-spark-head", "Exited (137) 2 days ago", "dev"),)
    failed = parse_leftovers(["exit 1", "permission denied while trying to connect to the Docker daemon socket"])
    assert failed.containers == () and failed.said is not None and failed.said.startswith("permission denied")


def test_the_whole_report_reads_into_every_record() -> None:
    probe = parse_probe(probe_text())
    assert probe.unavailable == {}
    assert probe.user is not None and (probe.user.name, probe.user.uid, probe.user.home) == (
        "nvidia",
        1000,
        "/home/nvidia",
    )
    assert probe.interfaces and probe.rdma and probe.docker and probe.gpu and probe.disk and probe.nfs and probe.sudo
    assert probe.mem_available_kib == 123_865_232
    assert probe.leftovers is not None and probe.leftovers.containers == ()


def test_an_unavailable_section_keeps_the_nodes_reason_and_a_garbled_one_says_so() -> None:
    probe = parse_probe(
        probe_text(replace={"ib": "unavailable: no /sys/class/infiniband (no RDMA driver loaded)", "docker": "what?"})
    )
    assert probe.rdma is None and probe.unavailable["ib"] == "no /sys/class/infiniband (no RDMA driver loaded)"
    assert probe.docker is None and probe.unavailable["docker"].startswith("could not read what the node printed")
    assert probe.interfaces is not None  # the rest is still read


def test_a_missing_section_is_unavailable_not_a_crash() -> None:
    text = probe_text().replace("==gpu==\n", "==gpux==\n")
    assert parse_probe(text).unavailable["gpu"] == "the probe printed no such section"
