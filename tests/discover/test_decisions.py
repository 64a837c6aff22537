"""The decisions over one node's report, and over the nodes together: each rule, and the fix it names."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from components.config import Node
from components.discover.checks import (
    decide_disk,
    decide_docker,
    decide_gpu,
    decide_leftovers,
    decide_memory,
    decide_nfs,
)
from components.discover.fabric import Fabric, decide_fabric, resolve_gid
from components.discover.findings import NOT_DECIDED, Spec, node_name, parse_target
from components.discover.output import yaml_block, yaml_scalar
from components.discover.parse import Probe, Rdma, parse_ib, parse_probe
from components.discover.report import Reached, Report, decide
from components.operator.stack_view import OperatorError
from tests.discover.nodes import EXPORT_COMMANDS, fixture, probe_text

HEAD = "spark-head"


def probe(**kwargs: Any) -> Probe:
    return parse_probe(probe_text(**kwargs))


def ip_without(address: str, name: str = "ip_head.json") -> str:
    """An `ip -j addr` capture with one address taken off its interface."""
    return ip_drop("format json\n" + fixture(name), address)


def ip_drop(section: str, address: str) -> str:
    """An `ip` section (format json) without one address."""
    data = json.loads(section.split("\n", 1)[1])
    for iface in data:
        iface["addr_info"] = [a for a in iface["addr_info"] if a["local"] != address]
    return "format json\n" + json.dumps(data)


def ip_with(interface: str, address: str, prefixlen: int = 24, name: str = "ip_head.json") -> str:
    data = json.loads(fixture(name))
    for iface in data:
        if iface["ifname"] == interface:
            iface["addr_info"].insert(0, {"family": "inet", "local": address, "prefixlen": prefixlen})
    return "format json\n" + json.dumps(data)


# --- the fabric ------------------------------------------------------------------------------------------------


def test_a_healthy_head_is_its_active_roce_netdev_its_address_its_hca_and_gid_index_3() -> None:
    f = decide_fabric(probe())
    assert (f.interface, f.ip, f.hcas, f.gid_index) == ("enp1s0f1np1", "192.168.100.1", ("rocep1s0f1",), 3)
    assert f.finding.undecided == () and f.finding.warnings == ()
    assert "HCAs: roceP2p1s0f0 DOWN (enP2p1s0f0np0), roceP2p1s0f1 ACTIVE (enP2p1s0f1np1)" in f.finding.found[0]


def test_a_worker_whose_ipv4_roce_v2_gid_is_at_index_1() -> None:
    f = decide_fabric(probe(ip="ip_worker.json", ib="ib_worker.txt"))
    assert (f.interface, f.ip, f.hcas, f.gid_index) == ("enp1s0f0np0", "192.168.100.2", ("rocep1s0f0",), 1)
    assert f.finding.undecided == ()


def test_hcas_all_down_decide_nothing_and_say_check_the_cable_or_run_without_rdma() -> None:
    f = decide_fabric(probe(ip="ip_worker.json", ib="ib_down.txt"))
    assert (f.interface, f.ip, f.hcas, f.gid_index) == (None, None, None, None)
    (u,) = f.finding.undecided
    assert u.key == "fabricInterface, fabricIp, ibHcas, gidIndex"
    assert u.reason.startswith("no RoCE HCA port is ACTIVE (roceP2p1s0f0 DOWN")
    assert "enp1s0f0np0 holds 192.168.100.2 (rocep1s0f0 DOWN)" in u.reason
    assert "check the cable and `ibv_devinfo`" in u.fix and "set `ibHcas: []` to run without RDMA" in u.fix


def test_no_roce_v2_gid_for_the_address_only_v1_and_link_local_leaves_gid_index_undecided() -> None:
    f = decide_fabric(probe(ip="ip_worker.json", ib="ib_no_v2.txt"))
    assert (f.interface, f.ip, f.hcas, f.gid_index) == ("enp1s0f0np0", "192.168.100.2", ("rocep1s0f0",), None)
    (u,) = f.finding.undecided
    assert u.key == "gidIndex"
    assert "no ACTIVE RoCE v2 GID holds 192.168.100.2 on rocep1s0f0" in u.reason
    assert "only as IB/RoCE v1 at index 2" in u.reason
    assert "enable RoCE v2 on rocep1s0f0" in u.fix and "`ibHcas: []`" in u.fix


def test_an_active_hca_whose_netdev_has_no_ipv4_address_asks_for_one() -> None:
    f = decide_fabric(probe(replace={"ip": ip_without("192.168.100.1")}))
    (u,) = f.finding.undecided
    assert "no IPv4 address on enP2p1s0f1np1, enp1s0f1np1" in u.reason
    assert "sudo ip addr add" in u.fix


def test_no_rdma_driver_decides_nothing_and_names_the_way_without_rdma() -> None:
    f = decide_fabric(probe(replace={"ib": "unavailable: no /sys/class/infiniband (no RDMA driver loaded)"}))
    (u,) = f.finding.undecided
    assert "no RDMA devices (no /sys/class/infiniband (no RDMA driver loaded))" in u.reason
    assert "`rdmaDevices: []`" in u.fix


def test_an_address_on_a_non_roce_interface_is_never_a_candidate() -> None:
    # enP7s7 (10.0.0.1) and docker0 hold IPv4 addresses; neither is an HCA's netdev.
    f = decide_fabric(probe())
    assert [c.interface for c in f.candidates] == ["enp1s0f1np1"]


def test_two_addresses_on_active_roce_netdevs_are_not_guessed() -> None:
    # The other half of the port with an address but no GID for it: the one whose GID resolves is chosen.
    f = decide_fabric(probe(replace={"ip": ip_with("enP2p1s0f1np1", "192.168.101.1")}))
    assert (f.interface, f.gid_index) == ("enp1s0f1np1", 3)
    assert "the only one with a RoCE v2 GID" in f.finding.found[1]
    assert any("enP2p1s0f1np1 192.168.101.1/24" in w for w in f.finding.warnings)


def _both_halves_with_gids() -> tuple[str, str]:
    ib = fixture("ib_head.txt") + (
        "gid roceP2p1s0f1 1 3 0000:0000:0000:0000:0000:ffff:c0a8:6501 enP2p1s0f1np1 RoCE v2\n"
    )
    return ip_with("enP2p1s0f1np1", "192.168.101.1"), ib


def test_two_working_addresses_are_ambiguous_until_a_peers_network_settles_it() -> None:
    ip, ib = _both_halves_with_gids()
    alone = decide_fabric(probe(replace={"ip": ip, "ib": ib}))
    assert alone.ambiguous and alone.interface is None
    (u,) = alone.finding.undecided
    assert "several addresses on ACTIVE RoCE netdevs" in u.reason and "192.168.101.1" in u.reason
    settled = decide_fabric(probe(replace={"ip": ip, "ib": ib}), peers=["192.168.101.2"])
    assert (settled.interface, settled.ip, settled.gid_index) == ("enP2p1s0f1np1", "192.168.101.1", 3)
    assert "the other nodes' network 192.168.101.0/24" in settled.finding.found[1]


def test_the_ports_other_half_with_an_ipv4_roce_v2_gid_at_the_index_is_offered_for_both_halves() -> None:
    ib = fixture("ib_head.txt") + (
        "gid roceP2p1s0f1 1 3 0000:0000:0000:0000:0000:ffff:c0a8:6403 enP2p1s0f1np1 RoCE v2\n"
    )
    f = decide_fabric(probe(replace={"ib": ib}))
    assert f.hcas == ("rocep1s0f1",)  # its netdev holds no address of its own here: not a candidate
    assert any("`ibHcas: [rocep1s0f1, roceP2p1s0f1]` uses both halves" in line for line in f.finding.found)


def _rdma(text: str) -> Rdma:
    return parse_ib(text.splitlines())


def test_gid_rule_takes_the_lowest_roce_v2_index_of_the_address() -> None:
    rdma = _rdma(fixture("ib_head.txt") + "gid rocep1s0f1 1 5 0000:0000:0000:0000:0000:ffff:c0a8:6401 - RoCE v2\n")
    assert resolve_gid(rdma, ["rocep1s0f1"], "192.168.100.1").index == 3


def test_gid_rule_refuses_one_address_at_two_indexes_on_two_hcas() -> None:
    rdma = _rdma(fixture("ib_head.txt") + "gid roceP2p1s0f1 1 4 0000:0000:0000:0000:0000:ffff:c0a8:6401 - RoCE v2\n")
    result = resolve_gid(rdma, ["rocep1s0f1", "roceP2p1s0f1"], "192.168.100.1")
    assert result.index is None
    ((reason, fix),) = result.problems
    assert "different indexes (roceP2p1s0f1 at 4, rocep1s0f1 at 3)" in reason and "one fabric netdev only" in fix


def test_gid_rule_refuses_a_second_hca_without_an_ipv4_roce_v2_entry_at_the_index() -> None:
    result = resolve_gid(_rdma(fixture("ib_head.txt")), ["rocep1s0f1", "roceP2p1s0f1"], "192.168.100.1")
    ((reason, _),) = result.problems
    assert "HCA roceP2p1s0f1 has no IPv4 RoCE v2 GID at index 3" in reason


def test_gid_rule_refuses_a_down_or_missing_hca() -> None:
    rdma = _rdma(fixture("ib_head.txt"))
    assert "port 1 is DOWN" in resolve_gid(rdma, ["rocep1s0f0"], "192.168.100.1").problems[0][0]
    assert "does not exist" in resolve_gid(rdma, ["mlx5_9"], "192.168.100.1").problems[0][0]


# --- memory, disk, docker, GPU, NFS, leftovers ------------------------------------------------------------------


def test_memavailable_above_the_preflight_minimum_is_fine() -> None:
    f = decide_memory(probe(), 111.5)
    assert f.warnings == () and f.found == ("memory: MemAvailable 118.1 GiB (preflight needs 111.5 GiB)",)


def test_memavailable_below_it_warns_that_a_busy_node_must_be_idle_before_the_up() -> None:
    f = decide_memory(probe(meminfo="meminfo_busy.txt"), 111.5)
    (w,) = f.warnings
    assert "MemAvailable 42.0 GiB is below preflight.minMemAvailableGiB 111.5" in w
    assert "a busy node must be idle before the up" in w
    assert f.undecided == ()  # memory is a state to fix before the up, not a config line


def test_the_head_gets_a_root_under_the_candidate_with_the_most_free_space_and_the_line_to_create_it() -> None:
    root = decide_disk(probe(), "nvidia", head=True, min_gib=387)
    assert root.root == "/srv/dsv41-exl3"
    assert root.create == "sudo install -d -o nvidia -m 0755 /srv/dsv41-exl3"
    assert root.finding.undecided == ()
    assert "enough for the weights (387 GiB)" in root.finding.found[0]


def test_low_disk_on_the_head_leaves_weights_root_undecided_naming_387_gib() -> None:
    root = decide_disk(probe(df="df_small.txt"), "nvidia", head=True, min_gib=387)
    assert root.root is None
    (u,) = root.finding.undecided
    assert u.key == "weights.root"
    assert "no candidate root has preflight.minFreeDiskGiB 387 GiB free (most: /srv: 214.6 GiB free" in u.reason


def test_low_disk_on_a_worker_is_only_reported() -> None:
    root = decide_disk(probe(df="df_small.txt"), "nvidia", head=False, min_gib=387)
    assert root.root is None and root.finding.undecided == ()
    assert "a worker needs it only with `share: copy`" in root.finding.found[0]


def test_the_home_is_proposed_as_a_directory_under_it_never_itself() -> None:
    big, small = fixture("df_large.txt").splitlines()[1], fixture("df_small.txt").splitlines()[1]
    disk = f"candidate ext2/ext3 /srv\ndf {small}\ncandidate ext2/ext3 /home/nvidia\ndf {big}"
    root = decide_disk(probe(replace={"disk": disk}), "nvidia", head=True, min_gib=387)
    assert root.root == "~/dsv41-exl3" and root.create is None
    assert all(line.split(":")[0] != "weights.root: ~" for line in root.finding.found)


def test_docker_usable_with_the_nvidia_runtime() -> None:
    f = decide_docker(probe(), "nvidia")
    assert f.undecided == () and f.warnings == ()
    assert f.found == ("docker: server 28.3.3, usable by nvidia; runtimes: io.containerd.runc.v2, nvidia, runc",)


def test_no_docker_access_is_undecided_with_the_docker_group_fix() -> None:
    (u,) = decide_docker(probe(docker="docker_info_denied.txt", docker_exit=1), "nvidia").undecided
    assert u.key == "user" and "docker is not usable by nvidia: permission denied" in u.reason
    assert u.fix.startswith("`sudo usermod -aG docker nvidia`, then log in again")


def test_a_stopped_daemon_and_no_docker_at_all_say_what_to_do() -> None:
    down = probe(replace={"docker": "exit 1\nCannot connect to the Docker daemon at unix:///var/run/docker.sock."})
    assert "sudo systemctl enable --now docker" in decide_docker(down, "nvidia").undecided[0].fix
    absent = probe(replace={"docker": "unavailable: no docker command on PATH"})
    (u,) = decide_docker(absent, "nvidia").undecided
    assert "no docker command on PATH" in u.reason and "install Docker" in u.fix


def test_docker_without_an_nvidia_runtime_warns() -> None:
    text = fixture("docker_info.json").replace('"nvidia":{"path":"nvidia-container-runtime"},', "")
    f = decide_docker(probe(replace={"docker": "exit 0\n" + text}), "nvidia")
    (w,) = f.warnings
    assert "no `nvidia` runtime" in w and "nvidia-ctk runtime configure" in w


def test_a_gpu_nvidia_smi_cannot_see_is_undecided() -> None:
    assert decide_gpu(probe()).found == ("gpu: GPU 0: NVIDIA GB10 (UUID: GPU-5f0c3a1e-8d2b-4c6f-9a7e-1b2c3d4e5f60)",)
    (u,) = decide_gpu(probe(replace={"gpu": "exit 9\nNVIDIA-SMI has failed"})).undecided
    assert u.key == "gpus" and "NVIDIA-SMI has failed" in u.reason


def test_nfs_ready_head() -> None:
    f = decide_nfs(probe(sudo_true=1, sudo_l=0), "nvidia")
    assert f.undecided == ()
    assert f.found == ("nfs: nfs-kernel-server installed", "sudo: `sudo -n` allowed for exportfs, mkdir, install, rm")


def test_no_nfs_package_is_undecided_with_apt_get() -> None:
    (u,) = decide_nfs(probe(nfs="unknown ok not-installed"), "nvidia").undecided
    assert u.key == "weights.share" and "nfs-kernel-server is not installed" in u.reason
    assert "`sudo apt-get install nfs-kernel-server`" in u.fix and "`share: copy`" in u.fix


def test_sudo_refused_is_undecided_with_the_readmes_sudoers_line() -> None:
    (u,) = decide_nfs(probe(sudo_true=1, sudo_l=1), "nvidia").undecided
    assert u.reason.startswith("`sudo -n` is refused for " + ", ".join(EXPORT_COMMANDS))
    assert (
        "`nvidia ALL=(root) NOPASSWD: /usr/sbin/exportfs, /usr/bin/mkdir, /usr/bin/install, /usr/bin/rm` in "
        "/etc/sudoers.d/dsv41-exl3" in u.fix
    )


def test_sudo_refused_for_one_command_names_only_it() -> None:
    lines = "sudo-true 1\n" + "\n".join(f"sudo-l {1 if c.endswith('/rm') else 0} {c}" for c in EXPORT_COMMANDS)
    (u,) = decide_nfs(probe(replace={"sudo": lines}), "nvidia").undecided
    assert u.reason.startswith("`sudo -n` is refused for /usr/bin/rm (")


def test_root_or_full_passwordless_sudo_needs_no_sudoers_line() -> None:
    assert decide_nfs(probe(uid=0, sudo_l=1), "root").undecided == ()
    assert decide_nfs(probe(sudo_true=0, sudo_l=1), "nvidia").undecided == ()


def test_leftover_containers_are_listed_with_rm_only_if_meant() -> None:
    f = decide_leftovers(probe(leftovers="dsv41-exl3-dev-spark-head|Exited (137) 2 days ago|dev"))
    (w,) = f.warnings
    assert "dsv41-exl3-dev-spark-head (Exited (137) 2 days ago; stack dev)" in w
    assert "Only if you mean to remove them: `docker rm -f dsv41-exl3-dev-spark-head`" in w
    assert decide_leftovers(probe()).found == ("leftovers: no container of any stack",)


# --- the nodes together, and the YAML ---------------------------------------------------------------------------


def _report(*probes: Probe, ports: tuple[int, ...] = ()) -> Report:
    specs = [Spec("nvidia", f"10.0.0.{i + 1}", ports[i] if i < len(ports) else 22) for i in range(len(probes))]
    reached = [Reached(probe=p) for p in probes]
    return Report(decide(specs, reached), identity=None, agent=None, known_hosts=None)


def test_names_follow_the_template() -> None:
    assert [node_name(i) for i in range(4)] == ["spark-head", "spark-worker", "spark-worker-2", "spark-worker-3"]


def test_a_healthy_pair_pastes_as_nodes_the_config_accepts_with_gid_index_auto_and_the_index_found() -> None:
    report = _report(probe(), probe(ip="ip_worker.json", ib="ib_worker.txt"), ports=(22, 2222))
    assert report.ok
    text = yaml_block(report)
    assert "      gidIndex: auto  # index 3 on this node now" in text
    assert "      gidIndex: auto  # index 1 on this node now" in text
    config = yaml.safe_load("config:\n" + text)["config"]
    head, worker = config["dsv41-exl3:nodes"]
    assert head == {
        "name": HEAD,
        "host": "10.0.0.1",
        "user": "nvidia",
        "fabricIp": "192.168.100.1",
        "fabricInterface": "enp1s0f1np1",
        "ibHcas": ["rocep1s0f1"],
        "gidIndex": "auto",
    }
    assert worker["port"] == 2222 and "port" not in head
    assert (worker["fabricIp"], worker["fabricInterface"], worker["ibHcas"]) == (
        "192.168.100.2",
        "enp1s0f0np0",
        ["rocep1s0f0"],
    )
    for entry in (head, worker):
        Node.model_validate(entry)
    assert config["dsv41-exl3:weights"] == {"root": "/srv/dsv41-exl3", "share": "nfs"}


def test_what_was_not_decided_pastes_as_a_placeholder_the_config_refuses() -> None:
    report = _report(probe(), probe(ip="ip_worker.json", ib="ib_no_v2.txt"))
    assert not report.ok
    worker = yaml.safe_load("config:\n" + yaml_block(report))["config"]["dsv41-exl3:nodes"][1]
    assert worker["gidIndex"] == NOT_DECIDED
    with pytest.raises(ValueError, match="gidIndex|gid_index"):
        Node.model_validate(worker)


def test_a_worker_off_the_heads_fabric_network_is_warned_about() -> None:
    ip = "format json\n" + fixture("ip_worker.json").replace('"192.168.100.2"', '"192.168.7.2"')
    report = _report(probe(), probe(ib="ib_worker.txt", replace={"ip": ip}))
    worker = report.nodes[1]
    assert worker.fabric.ip == "192.168.7.2"
    assert any("is not on the head's fabric network 192.168.100.0/24" in w for w in worker.finding.warnings)


def test_two_nodes_with_one_fabric_address_leave_the_second_undecided() -> None:
    report = _report(probe(), probe())
    (u,) = report.nodes[1].undecided
    assert u.key == "fabricIp" and "also the fabric address found on node 1 (spark-head)" in u.reason


def test_an_ambiguous_node_is_settled_by_the_other_nodes_addresses() -> None:
    ip, ib = _both_halves_with_gids()
    worker_ip = ip_with("enP2p1s0f0np0", "192.168.101.2", name="ip_worker.json")
    worker_ip = ip_drop(worker_ip, "192.168.100.2")
    worker_ib = fixture("ib_worker.txt") + (
        "gid roceP2p1s0f0 1 2 0000:0000:0000:0000:0000:ffff:c0a8:6502 enP2p1s0f0np0 RoCE v2\n"
    )
    report = _report(probe(replace={"ip": ip, "ib": ib}), probe(replace={"ip": worker_ip, "ib": worker_ib}))
    head, worker = report.nodes
    assert (worker.fabric.interface, worker.fabric.ip) == ("enP2p1s0f0np0", "192.168.101.2")
    assert (head.fabric.interface, head.fabric.ip) == ("enP2p1s0f1np1", "192.168.101.1")


def test_an_unreached_node_is_one_undecided_line_and_keeps_its_place_in_the_list() -> None:
    specs = [Spec("nvidia", "10.0.0.1", 22), Spec("nvidia", "10.0.0.2", 22)]
    report = Report(
        decide(specs, [Reached(probe=probe()), Reached(error="ssh: connect to host 10.0.0.2 port 22: No route")]),
        identity=None,
        agent=None,
        known_hosts=None,
    )
    worker = report.nodes[1]
    assert worker.fabric == Fabric() and [u.key for u in worker.undecided] == ["node"]
    entry = yaml.safe_load("config:\n" + yaml_block(report))["config"]["dsv41-exl3:nodes"][1]
    assert entry["name"] == "spark-worker" and entry["fabricIp"] == NOT_DECIDED


# --- arguments ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arg, spec",
    [
        ("nvidia@10.0.0.1", Spec("nvidia", "10.0.0.1", 22)),
        ("nvidia@spark-1.lan:2222", Spec("nvidia", "spark-1.lan", 2222)),
        ("nvidia@[fd00::2]:22", Spec("nvidia", "fd00::2", 22)),
        ("nvidia@fd00::2", Spec("nvidia", "fd00::2", 22)),
    ],
)
def test_targets_are_user_at_host_with_an_optional_port(arg: str, spec: Spec) -> None:
    assert parse_target(arg) == spec


@pytest.mark.parametrize(
    "arg, said",
    [
        ("10.0.0.1", "'10.0.0.1' has no user: use the form user@host[:port]"),
        ("@10.0.0.1", "has no user"),
        ("nvidia@10.0.0.1:99999", "has a bad port '99999': use the form user@host[:port] with a port 1-65535"),
        ("nvidia@10.0.0.1:ssh", "has a bad port 'ssh'"),
        ("nvidia@10.0.0.1:", "has a bad port ''"),
        ("nvidia@bad_host!", "'nvidia@bad_host!': the host must be a hostname or an IP address"),
        ("-oProxyCommand=x@h", "the user must be a login name"),
    ],
)
def test_a_malformed_target_names_itself_and_the_form(arg: str, said: str) -> None:
    with pytest.raises(OperatorError, match="user@host") as error:
        parse_target(arg)
    assert said in str(error.value)


def test_yaml_scalars_that_yaml_would_misread_are_quoted() -> None:
    assert yaml_scalar("10.0.0.1") == "10.0.0.1" and yaml_scalar("/srv/dsv41-exl3") == "/srv/dsv41-exl3"
    assert yaml_scalar("yes") == '"yes"' and yaml_scalar("1234") == '"1234"' and yaml_scalar("a: b") == '"a: b"'
    for value in ("yes", "1234", "a: b", "~", "10.0.0.1", "~/dsv41-exl3"):
        assert yaml.safe_load(f"k: {yaml_scalar(value)}") == {"k": value}
