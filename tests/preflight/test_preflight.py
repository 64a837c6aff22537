"""The per-node preflight: the rendered script run locally with sh, and the Preflight component.

The script runs against fixture sysfs trees, a fake meminfo and fake `docker`, `systemctl`
and `df` executables on a PATH that holds only the tools the script may use, so a test
shows both the decision and the exact docker calls it made.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import pytest
from pulumi_command import remote

from components.preflight.gid import render_gid_check
from components.preflight.preflight import Preflight, PreflightArgs
from components.preflight.spec import (
    INSPECT_FORMAT,
    SHAPE_FORMAT,
    CheckResult,
    OwnAddress,
    PreflightSpec,
    format_report,
    parse_output,
    parse_report,
    render_command,
    render_script,
    wrap_in_timeout,
)
from tests.support import recording

FIXTURES = Path(__file__).parents[1] / "support" / "fixtures" / "sysfs"
GIB_KIB = 1024 * 1024

# The utilities the script may use on a node besides docker and systemctl.
NODE_TOOLS = ["sh", "awk", "sed", "tr", "cat", "timeout", "du", "date", "sleep", "dirname", "id", "ls", "mkdir", "rm"]

FAKE_DOCKER = """#!{python}
import json, os, subprocess, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_DOCKER_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
path = os.environ["FAKE_DOCKER_STATE"]
with open(path) as f:
    state = json.load(f)
if state["hang"]:
    time.sleep(60)
if not state["daemon_up"]:
    print("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?",
          file=sys.stderr)
    sys.exit(1)

def value_of(flag):
    return [args[i + 1] for i, a in enumerate(args) if a == flag]

containers = state["containers"]
cmd = args[0]
if cmd == "version":
    assert value_of("--format") == ["{{{{.Server.Version}}}}"], args
    print("24.0.7")
elif cmd == "ps":
    chosen = [c for c in containers if c["running"]]  # docker ps lists running containers only
    for flt in value_of("--filter"):
        if flt.startswith("label="):
            key, _, want = flt[len("label="):].partition("=")
            chosen = [c for c in chosen if c["labels"].get(key) == want]
        else:
            sys.exit("fake docker: unsupported filter " + flt)
    if "-q" in args:
        out = [c["id"] for c in chosen]
    elif value_of("--format") == ['{{{{.ID}}}} {{{{.Names}}}} {{{{.Label "dsv41-exl3.config"}}}}']:
        out = [c["id"] + " " + c["name"] + " " + c["labels"].get("dsv41-exl3.config", "") for c in chosen]
    else:
        sys.exit("fake docker: unsupported ps " + repr(args))
    print("\\n".join(out))
elif cmd == "stop":
    assert args[1] == "-t", args
    if state["stop_fails"]:
        print("Error response from daemon: cannot stop container: permission denied", file=sys.stderr)
        sys.exit(1)
    for cid in args[3:]:
        (c,) = [c for c in containers if c["id"] == cid]
        c["running"] = False
    with open(path, "w") as f:
        json.dump(state, f)
    if state["mem_after_stop_kib"] is not None:
        # unified memory comes back a little after the container exits
        subprocess.Popen([sys.executable, "-c",
            "import sys, time; time.sleep(float(sys.argv[1])); open(sys.argv[2], 'w').write(sys.argv[3])",
            str(state["mem_after_stop_delay_s"]), os.environ["DSV41_MEMINFO"],
            "MemAvailable: %d kB\\n" % state["mem_after_stop_kib"]], start_new_session=True)
    print("\\n".join(args[3:]))
elif cmd == "inspect" and value_of("--format") == [os.environ["FAKE_SHAPE_FORMAT"]]:
    for cid in args[3:]:
        (c,) = [c for c in containers if c["id"] == cid]
        print(c["shape"])
elif cmd == "inspect":
    if value_of("--format") != [os.environ["FAKE_INSPECT_FORMAT"]]:
        sys.exit("fake docker: inspect format changed in transit: " + repr(args))
    for cid in args[3:]:
        (c,) = [c for c in containers if c["id"] == cid]
        caps = "".join(cap + " " for cap in c["gpu_caps"])
        devs = "".join(d + " " for d in c["devices"])
        print("/" + c["name"] + "|" + caps + "|" + devs + "|" + c["labels"].get("dsv41-exl3.stack", ""))
else:
    sys.exit("fake docker: unsupported command " + repr(args))
"""

FAKE_SYSTEMCTL = """#!/bin/sh
echo "$*" >> "$FAKE_SYSTEMCTL_LOG"
if [ -n "${FAKE_SYSTEMCTL_FAIL:-}" ]; then echo "Failed to connect to bus: No medium found" >&2; exit 1; fi
cat "$FAKE_UNITS"
"""

# `ip route get ADDR` as iproute2 prints it: the route the node's kernel would take to ADDR.
FAKE_IP = """#!/bin/sh
echo "$*" >> "$FAKE_IP_LOG"
if [ -n "${FAKE_IP_FAIL:-}" ]; then echo "$FAKE_IP_FAIL" >&2; exit 2; fi
printf '%s\\n' "$FAKE_IP_ROUTE"
"""

FAKE_DF = """#!/bin/sh
echo "$*" >> "$FAKE_DF_LOG"
echo "Filesystem     1024-blocks      Used Available Capacity Mounted on"
echo "/dev/nvme0n1p2  3907029168 100000000 $FAKE_DF_FREE_K      3% /"
"""


def container(
    cid: str,
    name: str,
    *,
    stack: str | None = None,
    running: bool = True,
    gpu: bool = False,
    devices: tuple[str, ...] = (),
    labels: dict[str, str] | None = None,
    shape: str = "host -1",
) -> dict[str, Any]:
    all_labels = dict(labels or {})
    if stack is not None:
        all_labels["dsv41-exl3.stack"] = stack
    return {
        "id": cid,
        "name": name,
        "labels": all_labels,
        "running": running,
        "gpu_caps": ["gpu"] if gpu else [],
        "devices": list(devices),
        "shape": shape,
    }


OWN_HEAD = container("a1a1a1", "dsv41-exl3-dev-head", stack="dev", gpu=True, devices=("/dev/infiniband",))


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    elapsed: float
    docker_calls: list[list[str]]
    systemctl_calls: list[str]
    df_calls: list[str]
    ip_calls: list[str]
    containers: list[dict[str, Any]]

    @property
    def refusals(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("preflight refused on node ")]

    def calls(self, verb: str) -> list[list[str]]:
        return [c for c in self.docker_calls if c[0] == verb]


@dataclass
class FakeNode:
    """One simulated node: what its docker, systemd, /proc/meminfo, sysfs and disk say."""

    tmp: Path
    containers: list[dict[str, Any]] = field(default_factory=list)
    daemon_up: bool = True
    docker_hangs: bool = False
    stop_fails: bool = False
    mem_available_kib: int = 120 * GIB_KIB
    mem_after_stop_kib: int | None = None
    mem_after_stop_delay_s: float = 0.0
    units: str = "ssh-agent.service enabled enabled\n"
    systemctl: bool = True
    systemctl_fails: bool = False
    df_free_kib: int = 500 * GIB_KIB
    sysfs_case: str = "healthy"
    dev_infiniband: bool = True
    home: Path | None = None
    ip: str | None = "fake"
    """`fake`: an `ip` that prints `ip_route` (or fails with `ip_fails`); `real`: this machine's; None: none."""
    ip_route: str = "local 192.168.1.10 dev lo table local src 192.168.1.10 uid 1000\n    cache <local>"
    ip_fails: str = ""

    def run(self, spec: PreflightSpec) -> Run:
        tmp = self.tmp
        fake_bin, tools = tmp / "fakebin", tmp / "tools"
        for d in (fake_bin, tools):
            d.mkdir(exist_ok=True)
        for tool in NODE_TOOLS:
            target = shutil.which(tool)
            assert target, f"test machine lacks {tool}"
            link = tools / tool
            if not link.exists():
                link.symlink_to(target)
        (fake_bin / "docker").write_text(FAKE_DOCKER.format(python=sys.executable))
        (fake_bin / "df").write_text(FAKE_DF)
        ip = fake_bin / "ip"
        if ip.exists() or ip.is_symlink():
            ip.unlink()
        if self.ip == "fake":
            ip.write_text(FAKE_IP)
        elif self.ip == "real":
            real = shutil.which("ip", path="/usr/sbin:/usr/bin:/sbin:/bin")
            if real is None:
                pytest.skip("this machine has no `ip` (iproute2)")
            ip.symlink_to(real)
        systemctl = fake_bin / "systemctl"
        if self.systemctl:
            systemctl.write_text(FAKE_SYSTEMCTL)
        elif systemctl.exists():
            systemctl.unlink()
        for f in fake_bin.iterdir():
            if not f.is_symlink():
                f.chmod(0o755)

        meminfo = tmp / "meminfo"
        # MemFree is tiny on purpose: the check must read MemAvailable, never free/used.
        meminfo.write_text(
            f"MemTotal:       127533396 kB\nMemFree:         2097152 kB\n"
            f"MemAvailable:   {self.mem_available_kib} kB\nCached:         90000000 kB\n"
        )
        state = tmp / "docker-state.json"
        state.write_text(
            json.dumps(
                {
                    "containers": self.containers,
                    "daemon_up": self.daemon_up,
                    "hang": self.docker_hangs,
                    "stop_fails": self.stop_fails,
                    "mem_after_stop_kib": self.mem_after_stop_kib,
                    "mem_after_stop_delay_s": self.mem_after_stop_delay_s,
                }
            )
        )
        units = tmp / "units.txt"
        units.write_text(self.units)
        dev = tmp / "dev"
        if self.dev_infiniband:
            (dev / "infiniband").mkdir(parents=True, exist_ok=True)
        logs = {k: tmp / f"{k}.log" for k in ("docker", "systemctl", "df", "ip")}
        for log in logs.values():
            log.write_text("")
        env = {
            "PATH": f"{fake_bin}:{tools}",
            "HOME": str(self.home or tmp),
            "DSV41_SYSFS_ROOT": str(FIXTURES / self.sysfs_case),
            "DSV41_MEMINFO": str(meminfo),
            "DSV41_DEV_ROOT": str(dev),
            "FAKE_DOCKER_STATE": str(state),
            "FAKE_DOCKER_LOG": str(logs["docker"]),
            "FAKE_INSPECT_FORMAT": INSPECT_FORMAT,
            "FAKE_SHAPE_FORMAT": SHAPE_FORMAT,
            "FAKE_SYSTEMCTL_LOG": str(logs["systemctl"]),
            "FAKE_UNITS": str(units),
            "FAKE_DF_LOG": str(logs["df"]),
            "FAKE_DF_FREE_K": str(self.df_free_kib),
            "FAKE_IP_LOG": str(logs["ip"]),
            "FAKE_IP_ROUTE": self.ip_route,
            "FAKE_IP_FAIL": self.ip_fails,
        }
        if self.systemctl_fails:
            env["FAKE_SYSTEMCTL_FAIL"] = "1"
        start = time.monotonic()
        # the exact command text the remote.Command sends, timeout wrapper included
        proc = subprocess.run(
            ["/bin/sh", "-c", render_command(spec)], capture_output=True, text=True, env=env, timeout=60
        )
        elapsed = time.monotonic() - start
        return Run(
            rc=proc.returncode,
            stdout=proc.stdout,
            stderr=proc.stderr,
            elapsed=elapsed,
            docker_calls=[json.loads(line) for line in logs["docker"].read_text().splitlines()],
            systemctl_calls=logs["systemctl"].read_text().splitlines(),
            df_calls=logs["df"].read_text().splitlines(),
            ip_calls=logs["ip"].read_text().splitlines(),
            containers=json.loads(state.read_text())["containers"],
        )


def make_spec(**overrides: Any) -> PreflightSpec:
    base: dict[str, Any] = dict(
        node_name="spark-1",
        fabric_ip="192.168.100.1",
        ib_hcas=("rocep1s0f1",),
        gid_index="auto",
        check_rdma=True,
        min_mem_available_gib=111.5,
        weights_root=None,
        min_free_disk_gib=None,
        stack_label="dev",
        generation="",
        container_shape="host -1",
        check_export_path=False,
        own_address=None,
        command_timeout_s=40,
        stop_timeout_s=2,
        mem_settle_s=3,
        docker_timeout_s=5,
    )
    base.update(overrides)
    return PreflightSpec(**base)


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    return FakeNode(tmp_path)


# --- the script on a node -------------------------------------------------------------------------


def test_healthy_node_passes_and_prints_one_json_line_that_parses(node: FakeNode) -> None:
    spec = make_spec()
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    assert len(run.stdout.splitlines()) == 1, f"stdout must hold only the JSON line: {run.stdout!r}"
    result = parse_output(run.stdout, spec)
    assert result.node == "spark-1"
    assert result.mem_available_gib == 120.0  # MemAvailable, not the 2 GiB MemFree
    assert result.gid_index == 3
    assert result.stopped == ()
    assert any("RoCE v2 GID index 3 on rocep1s0f1" in f for f in result.findings), result.findings


def test_stops_only_this_stacks_running_containers(node: FakeNode) -> None:
    node.containers = [
        OWN_HEAD,
        container("b2b2b2", "dsv41-exl3-dev-old", stack="dev", running=False),
        container("c3c3c3", "dsv41-exl3-prod-head", stack="prod"),
        container("d4d4d4", "dsv41-exl3-dev2-head", stack="dev2"),
        container("e5e5e5", "grafana"),
        container("f6f6f6", "dev", labels={"other.stack": "dev"}),
    ]
    run = node.run(make_spec())
    assert run.rc == 0, run.stderr
    assert run.calls("stop") == [["stop", "-t", "2", "a1a1a1"]]
    running = {c["name"] for c in run.containers if c["running"]}
    assert running == {"dsv41-exl3-prod-head", "dsv41-exl3-dev2-head", "grafana", "dev"}
    assert parse_output(run.stdout, make_spec()).stopped == ("dsv41-exl3-dev-head",)


def test_containers_already_on_the_requested_generation_keep_serving(node: FakeNode) -> None:
    """An update that does not replace the containers (e.g. a new preflight script) must not stop a
    running deployment, nor refuse it for the ~5 GiB MemAvailable a serving node legitimately has."""
    node.containers = [
        container("a1a1a1", "dsv41-exl3-dev-head", stack="dev", labels={"dsv41-exl3.config": "gen-new"}),
        container("b2b2b2", "dsv41-exl3-dev-old", stack="dev", labels={"dsv41-exl3.config": "gen-old"}),
    ]
    node.mem_available_kib = 5 * GIB_KIB
    node.mem_after_stop_kib = 5 * GIB_KIB
    spec = make_spec(generation="gen-new")
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    assert run.calls("stop") == [["stop", "-t", "2", "b2b2b2"]], "only the stale generation is stopped"
    result = parse_output(run.stdout, spec)
    assert any("already serves generation gen-new" in f for f in result.findings)


def test_a_container_of_another_shape_is_stopped_under_the_same_generation(node: FakeNode) -> None:
    """container.ipcMode or memlockBytes replace every rank without moving the generation: the old ranks must
    be stopped before any new one starts, or a new worker meets the old head on the master port."""
    node.containers = [
        container(
            "a1a1a1", "dsv41-exl3-dev-head", stack="dev", labels={"dsv41-exl3.config": "gen-new"}, shape="host -1"
        ),
        container(
            "c3c3c3", "dsv41-exl3-dev-worker", stack="dev", labels={"dsv41-exl3.config": "gen-new"}, shape="private -1"
        ),
    ]
    node.mem_available_kib = 200 * GIB_KIB
    spec = make_spec(generation="gen-new", container_shape="private -1")
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    assert run.calls("stop") == [["stop", "-t", "2", "a1a1a1"]], "the head of the old shape is stopped"
    assert parse_output(run.stdout, spec).stopped == ("dsv41-exl3-dev-head",)


def test_a_new_generation_stops_the_running_one_and_checks_memory(node: FakeNode) -> None:
    node.containers = [
        container("a1a1a1", "dsv41-exl3-dev-head", stack="dev", labels={"dsv41-exl3.config": "gen-old"}),
    ]
    node.mem_available_kib = 5 * GIB_KIB
    run = node.run(make_spec(generation="gen-new"))
    assert run.calls("stop") == [["stop", "-t", "2", "a1a1a1"]]
    assert run.rc == 1 and any("MemAvailable is 5.00 GiB" in r for r in run.refusals)


def test_the_check_phase_leaves_the_old_generation_serving_and_defers_the_memory_check(node: FakeNode) -> None:
    """An image change: while the new image downloads on some node, every node's old rank keeps serving."""
    node.containers = [
        container("a1a1a1", "dsv41-exl3-dev-head", stack="dev", labels={"dsv41-exl3.config": "gen-old"}),
    ]
    node.mem_available_kib = 5 * GIB_KIB  # the old rank holds the rest: no refusal for it in this phase
    run = node.run(make_spec(generation="gen-new", stop=False))
    assert run.rc == 0, run.stderr
    assert run.calls("stop") == []
    findings = parse_output(run.stdout, make_spec()).findings
    assert any("dsv41-exl3-dev-head left serving: they stop once every node holds the image" in f for f in findings)


def test_the_check_phase_still_refuses_everything_else(node: FakeNode) -> None:
    node.containers = [
        container("a1a1a1", "dsv41-exl3-dev-head", stack="dev", labels={"dsv41-exl3.config": "gen-old"}),
        container("c1c1c1", "comfyui", gpu=True),
    ]
    run = node.run(make_spec(generation="gen-new", stop=False))
    assert run.rc == 1 and run.calls("stop") == []
    assert ["container comfyui" in r for r in run.refusals] == [True]


def test_the_check_phase_checks_memory_when_nothing_of_the_stack_runs(node: FakeNode) -> None:
    node.mem_available_kib = 5 * GIB_KIB
    run = node.run(make_spec(stop=False))
    assert run.rc == 1 and any("MemAvailable is 5.00 GiB" in r for r in run.refusals)


def test_a_failed_stop_is_refused_as_our_own_container_not_a_foreign_one(node: FakeNode) -> None:
    node.containers = [OWN_HEAD]
    node.stop_fails = True
    run = node.run(make_spec())
    assert run.rc == 1
    (refusal,) = run.refusals
    assert "could not stop this stack's container(s) dsv41-exl3-dev-head" in refusal
    assert "docker rm -f dsv41-exl3-dev-head" in refusal


def test_no_stop_is_attempted_when_this_stack_runs_nothing(node: FakeNode) -> None:
    node.containers = [container("c3c3c3", "dsv41-exl3-prod-head", stack="prod")]
    run = node.run(make_spec())
    assert run.rc == 0, run.stderr
    assert run.calls("stop") == []


def test_memory_is_measured_after_the_stop_and_waits_for_it_to_come_back(node: FakeNode) -> None:
    node.containers = [OWN_HEAD]
    node.mem_available_kib = 8 * GIB_KIB  # the old serving container holds the rest
    node.mem_after_stop_kib = 121 * GIB_KIB
    node.mem_after_stop_delay_s = 1.0
    run = node.run(make_spec(mem_settle_s=5))
    assert run.rc == 0, run.stderr
    assert parse_output(run.stdout, make_spec()).mem_available_gib == 121.0


def test_memory_that_does_not_come_back_is_refused_within_the_settle_window(node: FakeNode) -> None:
    node.containers = [OWN_HEAD]
    node.mem_available_kib = 8 * GIB_KIB
    run = node.run(make_spec(mem_settle_s=2))
    assert run.rc == 1
    assert run.elapsed < 8, f"the wait must be bounded by mem_settle_s, took {run.elapsed:.1f}s"
    assert any("MemAvailable is 8.00 GiB, below the required 111.5 GiB" in r for r in run.refusals), run.stderr


def test_low_mem_available_is_refused_with_the_numbers_and_the_fix(node: FakeNode) -> None:
    node.mem_available_kib = 80 * GIB_KIB + 256 * 1024  # 80.25 GiB
    run = node.run(make_spec())
    assert run.rc == 1
    assert run.stdout == ""
    (refusal,) = run.refusals
    assert refusal.startswith("preflight refused on node spark-1: MemAvailable is 80.25 GiB")
    assert "below the required 111.5 GiB" in refusal
    assert "sync; echo 3 | sudo tee /proc/sys/vm/drop_caches" in refusal
    assert run.elapsed < 5, "nothing was stopped, so nothing to wait for"


def test_enabled_vllm_sglang_ray_user_units_are_refused(node: FakeNode) -> None:
    node.units = textwrap.dedent("""\
        ssh-agent.service enabled enabled
        vllm-head.service enabled enabled
        SGLang-router.service enabled enabled
        ray-worker.service enabled enabled
        pipewire.socket enabled enabled
    """)
    run = node.run(make_spec())
    assert run.rc == 1
    (refusal,) = run.refusals
    assert "vllm-head.service SGLang-router.service ray-worker.service" in refusal
    assert "systemctl --user disable --now vllm-head.service SGLang-router.service ray-worker.service" in refusal
    assert "ssh-agent" not in refusal and "pipewire" not in refusal
    assert run.systemctl_calls == ["--user list-unit-files --state=enabled --no-legend --no-pager"]


def test_unit_sweep_is_skipped_and_noted_without_systemctl(node: FakeNode) -> None:
    node.systemctl = False
    node.units = "vllm-head.service enabled enabled\n"  # would refuse if it were read
    run = node.run(make_spec())
    assert run.rc == 0, run.stderr
    assert "user systemd units not checked (no systemctl)" in parse_output(run.stdout, make_spec()).findings


def test_unreachable_user_manager_is_noted_not_fatal(node: FakeNode) -> None:
    node.systemctl_fails = True
    run = node.run(make_spec())
    assert run.rc == 0, run.stderr
    findings = parse_output(run.stdout, make_spec()).findings
    assert any("Failed to connect to bus" in f for f in findings), findings


def test_foreign_containers_holding_the_gpu_or_rdma_devices_are_refused_by_name(node: FakeNode) -> None:
    node.containers = [
        OWN_HEAD,
        container("c1c1c1", "comfyui", gpu=True),
        container("c2c2c2", "rdma-bench", devices=("/dev/infiniband/uverbs0",)),
        container("c3c3c3", "dsv41-exl3-prod-head", stack="prod", gpu=True, devices=("/dev/infiniband",)),
        container("c4c4c4", "nginx", devices=("/dev/fuse",)),
        container("c5c5c5", "old-trainer", gpu=True, running=False),
    ]
    run = node.run(make_spec())
    assert run.rc == 1
    refusals = "\n".join(run.refusals)
    assert "container comfyui (not of this stack) holds the GPU;" in refusals
    assert "container rdma-bench (not of this stack) holds /dev/infiniband;" in refusals
    assert "container dsv41-exl3-prod-head (not of this stack) holds the GPU and /dev/infiniband;" in refusals
    assert "nginx" not in refusals and "old-trainer" not in refusals and "dsv41-exl3-dev-head" not in refusals
    assert len(run.refusals) == 3
    assert run.calls("stop") == [], "foreign containers are never stopped, and this stack's serve on while it refuses"


def test_unreachable_docker_is_a_clear_failure_and_nothing_is_stopped(node: FakeNode) -> None:
    node.daemon_up = False
    node.mem_available_kib = 50 * GIB_KIB
    run = node.run(make_spec())
    assert run.rc == 1
    refusals = "\n".join(run.refusals)
    assert "docker is not reachable (Cannot connect to the Docker daemon" in refusals
    assert "MemAvailable is 50.00 GiB" in refusals, "the other checks still run and report"
    assert [c[0] for c in run.docker_calls] == ["version"]


def test_hung_docker_is_bounded_and_named(node: FakeNode) -> None:
    node.docker_hangs = True
    run = node.run(make_spec(docker_timeout_s=1))
    assert run.rc == 1
    assert run.elapsed < 10, f"took {run.elapsed:.1f}s"
    assert any("docker is not reachable" in r for r in run.refusals), run.stderr


def test_head_checks_free_disk_at_the_nearest_existing_parent_with_numbers(node: FakeNode, tmp_path: Path) -> None:
    node.df_free_kib = 100 * GIB_KIB
    weights = tmp_path / "disk" / "dsv41-exl3" / "model"
    (tmp_path / "disk").mkdir()
    run = node.run(make_spec(weights_root=str(weights), min_free_disk_gib=387))
    assert run.rc == 1
    (refusal,) = run.refusals
    assert (
        f"disk at {tmp_path / 'disk'} has 100.0 GiB free + 0.0 GiB already staged in {weights} = 100.0 GiB, "
        "below the required 387 GiB"
    ) in refusal
    assert "(short by 287.0 GiB)" in refusal and "weights.copyRoot (a worker, share: copy)" in refusal
    assert run.df_calls == [f"-Pk {tmp_path / 'disk'}"]


def test_a_copy_mode_worker_is_refused_naming_the_node_its_copy_root_and_the_shortfall(
    node: FakeNode, tmp_path: Path
) -> None:
    """Issue 15: with `share: copy` a worker's preflight checks its own disk for the copy."""
    node.df_free_kib = 300 * GIB_KIB
    copy_root = tmp_path / "copies" / "spark-1"
    copy_root.mkdir(parents=True)
    (copy_root / "model-00001.safetensors").write_bytes(b"x" * (512 * 1024 * 1024))  # 0.5 GiB already copied
    spec = make_spec(node_name="spark-1", weights_root=str(copy_root), min_free_disk_gib=387)
    run = node.run(spec)
    assert run.rc == 1
    (refusal,) = [r for r in run.refusals if "disk at" in r]
    assert (
        f"disk at {copy_root} has 300.0 GiB free + 0.5 GiB already staged in {copy_root} = 300.5 GiB, below "
        "the required 387 GiB (short by 86.5 GiB)"
    ) in refusal
    assert "preflight refused on node spark-1: " in run.stderr + run.stdout


def test_head_counts_already_staged_weights_toward_the_disk_minimum(node: FakeNode, tmp_path: Path) -> None:
    node.df_free_kib = 100 * GIB_KIB
    weights = tmp_path / "weights"
    weights.mkdir()
    spec = make_spec(weights_root=str(weights), min_free_disk_gib=100.05)
    assert node.run(spec).rc == 1, "100 GiB free alone is below 100.05"
    (weights / "model-00001.safetensors").write_bytes(b"x" * (80 * 1024 * 1024))  # 0.08 GiB staged
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    assert any("GiB staged in" in f for f in parse_output(run.stdout, spec).findings)


def test_head_weights_root_under_home_is_expanded_on_the_node(node: FakeNode, tmp_path: Path) -> None:
    node.home = tmp_path / "home"
    node.home.mkdir()
    run = node.run(make_spec(weights_root="~/dsv41-exl3", min_free_disk_gib=1))
    assert run.rc == 0, run.stderr
    assert run.df_calls == [f"-Pk {tmp_path / 'home'}"]


def test_worker_does_not_check_disk(node: FakeNode) -> None:
    run = node.run(make_spec())
    assert run.rc == 0, run.stderr
    assert run.df_calls == []


def test_moved_gid_index_fails_the_command_on_the_node(node: FakeNode) -> None:
    node.sysfs_case = "moved"
    run = node.run(make_spec(gid_index=3))
    assert run.rc == 1
    (refusal,) = run.refusals
    assert refusal.startswith("preflight refused on node spark-1: GID index 3 on rocep1s0f1")
    assert "set gid_index to 4" in refusal
    auto = node.run(make_spec())
    assert auto.rc == 0, auto.stderr
    assert parse_output(auto.stdout, make_spec()).gid_index == 4


def test_down_port_fails_the_command_naming_node_and_hca(node: FakeNode) -> None:
    node.sysfs_case = "two-down"
    run = node.run(make_spec(ib_hcas=("rocep1s0f1", "roceP2p1s0f1")))
    assert run.rc == 1
    assert [r.split(": ", 1)[1].split(",")[0] for r in run.refusals] == [
        "HCA rocep1s0f1 port 1 is DOWN",
        "HCA roceP2p1s0f1 port 1 is DOWN",
    ]


def test_missing_dev_infiniband_is_refused(node: FakeNode) -> None:
    node.dev_infiniband = False
    run = node.run(make_spec())
    assert run.rc == 1
    assert any("/infiniband does not exist" in r and "modprobe mlx5_ib" in r for r in run.refusals), run.stderr


def test_no_rdma_checks_when_check_rdma_is_false(node: FakeNode) -> None:
    node.sysfs_case = "no-such-tree"
    node.dev_infiniband = False
    spec = make_spec(check_rdma=False, ib_hcas=())
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    assert parse_output(run.stdout, spec).gid_index is None


def test_a_fabric_interface_without_statistics_is_refused_naming_the_key(node: FakeNode) -> None:
    # the stall rule reads its rx bytes while a worker loads in silence: a wrong name would blind it
    assert node.run(make_spec(fabric_interface="enp1s0f1np1")).rc == 0
    run = node.run(make_spec(fabric_interface="enp9s0"))
    assert run.rc == 1
    assert any(
        "nodes[].fabricInterface enp9s0 of spark-1 has no statistics" in r and "ip -br addr" in r for r in run.refusals
    ), run.stderr


def test_all_problems_are_reported_together(node: FakeNode) -> None:
    node.mem_available_kib = 60 * GIB_KIB
    node.units = "ray-head.service enabled enabled\n"
    node.containers = [container("c1c1c1", "comfyui", gpu=True)]
    node.sysfs_case = "all-zero"
    run = node.run(make_spec())
    assert run.rc == 1
    joined = "\n".join(run.refusals)
    for expected in ("MemAvailable is 60.00 GiB", "ray-head.service", "container comfyui", "no RoCE v2 GID entry"):
        assert expected in joined, f"{expected!r} missing from:\n{joined}"
    assert len(run.refusals) == 4


def test_the_doctors_report_mode_gives_every_check_in_order_and_exits_0_on_a_healthy_node(node: FakeNode) -> None:
    spec = make_spec(stop=False, report=True)
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    results = parse_report(run.stdout, spec)
    assert [r.check for r in results] == ["docker", "units", "holders", "rdma", "own-containers", "memory"]
    assert all(r.ok for r in results), results
    memory = next(r for r in results if r.check == "memory")
    assert memory.details == ("MemAvailable 120.00 GiB (needs 111.5)",)
    assert not run.calls("stop"), "the doctor stops nothing"


def test_the_doctors_report_mode_names_each_failed_check_with_its_fix_and_still_exits_0(node: FakeNode) -> None:
    # The same four problems as the program's refusal above: the doctor shows them per check, the rest ok.
    node.mem_available_kib = 60 * GIB_KIB
    node.units = "ray-head.service enabled enabled\n"
    node.containers = [container("c1c1c1", "comfyui", gpu=True)]
    node.sysfs_case = "all-zero"
    spec = make_spec(stop=False, report=True)
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    by_check = {r.check: r for r in parse_report(run.stdout, spec)}
    assert {c for c, r in by_check.items() if not r.ok} == {"units", "holders", "rdma", "memory"}, by_check
    assert by_check["docker"].ok and by_check["own-containers"].ok
    for check, words in (
        ("units", "systemctl --user disable --now ray-head.service"),
        ("holders", "docker stop comfyui"),
        ("memory", "MemAvailable is 60.00 GiB"),
    ):
        assert any(words in d and "fix:" in d for d in by_check[check].details), by_check[check]


def test_the_doctors_report_does_not_judge_memory_the_stacks_own_ranks_hold(node: FakeNode) -> None:
    node.mem_available_kib = 5 * GIB_KIB
    node.containers = [container("a1a1a1", "dsv41-exl3-dev-spark-1", stack="dev", labels={"dsv41-exl3.config": "g1"})]
    spec = make_spec(stop=False, report=True, generation="g1")
    run = node.run(spec)
    memory = next(r for r in parse_report(run.stdout, spec) if r.check == "memory")
    assert memory.ok and "not judged" in memory.details[0], memory


@pytest.mark.parametrize(
    ("stdout", "message"),
    [
        ("", "is empty"),
        ("not json", "does not end in a JSON line"),
        ('{"node": "other", "results": []}', "is not this node's report"),
        ('{"node": "spark-1", "results": ["docker|maybe|x"]}', "is not check|ok|text"),
    ],
)
def test_a_malformed_report_is_refused_naming_the_node(stdout: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_report(stdout, make_spec(stop=False, report=True))


def test_a_report_keeps_a_checks_notes_until_it_refuses() -> None:
    line = json.dumps(
        {"node": "spark-1", "results": ["disk|ok|", "disk|ok|12 GiB free", "disk|fail|too small; fix: x"]}
    )
    assert parse_report(line, make_spec(stop=False, report=True)) == [
        CheckResult(check="disk", ok=False, details=("too small; fix: x",))
    ]


def test_hostile_values_are_quoted_not_executed(node: FakeNode, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    label = f"dev'; touch {marker}; echo '$(touch {marker})"
    spec = make_spec(stack_label=label, node_name=f"n$(touch {marker})")
    run = node.run(spec)
    assert not marker.exists()
    assert run.rc == 0, run.stderr
    ps_own = [c for c in run.calls("ps") if "--filter" in c and "label=dsv41-exl3.stack=" + label in c]
    assert ps_own, run.docker_calls
    assert parse_output(run.stdout, spec).node == f"n$(touch {marker})"


def test_outer_timeout_bounds_a_hung_script() -> None:
    start = time.monotonic()
    proc = subprocess.run(["/bin/sh", "-c", wrap_in_timeout("sleep 30", 1)], capture_output=True, timeout=20)
    assert proc.returncode == 124
    assert time.monotonic() - start < 5


def test_script_is_posix_sh_and_uses_only_the_listed_tools() -> None:
    spec = make_spec(weights_root="/w", min_free_disk_gib=1)
    for script in (
        render_script(spec),
        render_gid_check(hcas=spec.ib_hcas, fabric_ip=spec.fabric_ip, wanted=spec.gid_index),
    ):
        assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0
        if shutil.which("bash"):
            assert subprocess.run(["bash", "--posix", "-n", "-c", script]).returncode == 0


# --- parsing what the node printed ----------------------------------------------------------------


def line(**fields: Any) -> str:
    base: dict[str, Any] = {
        "node": "spark-1",
        "mem_available_gib": 118.25,
        "gid_index": 3,
        "stopped": [],
        "findings": [],
    }
    base.update(fields)
    return json.dumps(base)


@pytest.mark.parametrize(
    ("stdout", "message"),
    [
        ("", "is empty"),
        ("not json\n", "does not end in a JSON line"),
        ("[1]", "expected a JSON object"),
        (line(node="spark-2"), "names node 'spark-2'"),
        (line(mem_available_gib="118"), "mem_available_gib is '118'"),
        (line(mem_available_gib=True), "mem_available_gib is True"),
        (line(gid_index=None), "no gid_index although check_rdma is true"),
        (line(gid_index="3"), "gid_index is '3'"),
        (line(findings="x"), "field 'findings'"),
    ],
)
def test_malformed_output_is_refused_naming_the_node(stdout: str, message: str) -> None:
    with pytest.raises(ValueError, match="preflight output of node spark-1") as e:
        parse_output(stdout, make_spec())
    assert message in str(e.value)


def test_output_must_agree_with_a_configured_index_and_with_check_rdma() -> None:
    with pytest.raises(ValueError, match="reports gid_index 4, configured 3"):
        parse_output(line(gid_index=4), make_spec(gid_index=3))
    with pytest.raises(ValueError, match="gid_index 3 although check_rdma is false"):
        parse_output(line(), make_spec(check_rdma=False))


def test_report_is_one_line_with_the_measurements() -> None:
    spec = make_spec()
    report = format_report(parse_output("progress\n" + line(stopped=["dsv41-exl3-dev-head"]), spec), spec)
    assert report == (
        "preflight spark-1: ok: 118.2 GiB MemAvailable (need 111.5); RoCE v2 GID index 3 "
        "(resolved) on rocep1s0f1; stopped dsv41-exl3-dev-head"
    )


# --- argument validation --------------------------------------------------------------------------


def test_invalid_spec_reports_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as e:
        make_spec(fabric_ip="fe80::1", ib_hcas=("bad name",), gid_index=-1, min_mem_available_gib=float("nan"))
    text = str(e.value)
    assert text.startswith("preflight for node 'spark-1': ")
    for part in (
        "fabric_ip 'fe80::1'",
        "'bad name' is not an RDMA device name",
        "gid_index -1",
        "min_mem_available_gib nan",
    ):
        assert part in text, f"{part!r} missing from {text!r}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(check_rdma=True, ib_hcas=()), "check_rdma is true but ib_hcas is empty"),
        (dict(weights_root="/w"), "weights_root '/w' and min_free_disk_gib None go together"),
        (dict(weights_root="dsv41", min_free_disk_gib=1), "must be an absolute path or start with ~/"),
        (dict(weights_root="~other/x", min_free_disk_gib=1), "must be an absolute path or start with ~/"),
        (dict(command_timeout_s=20), "command_timeout_s 20 is shorter than"),
        (dict(stack_label=""), "stack_label is empty"),
        (dict(node_name=" "), "node_name is empty"),
    ],
)
def test_invalid_spec_is_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="preflight for node") as e:
        make_spec(**overrides)
    assert message in str(e.value)


# --- the component under the recording mock engine ------------------------------------------------

SECRET_KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n-----END OPENSSH PRIVATE KEY-----"


def component_args(**spec_overrides: Any) -> PreflightArgs:
    """The component's args; `spec_overrides` change the spec (the script's values, real timeouts)."""
    spec: dict[str, Any] = dict(
        node_name="spark-1",
        fabric_ip="192.168.100.1",
        ib_hcas=("rocep1s0f1",),
        gid_index="auto",
        check_rdma=True,
        min_mem_available_gib=111.5,
        weights_root="/srv/dsv41-exl3",
        min_free_disk_gib=387.0,
        stack_label="dev",
        generation="",
        container_shape="host -1",
        check_export_path=False,
        own_address=None,
    )
    spec.update(spec_overrides)
    return PreflightArgs(
        spec=PreflightSpec(**spec),
        connection=remote.ConnectionArgs(
            host="127.0.0.1", port=2222, user="root", private_key=pulumi.Output.secret(SECRET_KEY)
        ),
        rerun_on=["generation-7", "node-spec-abc123"],
    )


def run_component(args: PreflightArgs, stdout: str) -> recording.Recorded:
    def program() -> dict[str, Any]:
        p = Preflight("preflight-spark-1", args)
        return {"gid_index": p.gid_index, "mem": p.mem_available_gib, "report": p.report}

    return recording.run(program, {"command:remote:Command": lambda a: {"stdout": stdout, "stderr": ""}})


def test_component_runs_one_timeout_wrapped_command_parented_and_triggered() -> None:
    rec = run_component(component_args(), line(stopped=["dsv41-exl3-dev-head"]))
    (cmd,) = rec.of_type("command:remote:Command")
    assert rec.registrations == [cmd], "one command, no component of its own (issue 36)"
    assert cmd.name == "preflight-spark-1-check"
    assert cmd.inputs["triggers"] == ["generation-7", "node-spec-abc123"]
    create = cmd.inputs["create"]
    assert create.startswith("exec timeout -k 10 120 sh -c "), create[:80]
    assert cmd.inputs["update"] == create, "an input change re-runs the same check"
    assert cmd.inputs["delete"] == "exec sh -c true"
    assert cmd.inputs["addPreviousOutputInEnv"] is False
    assert cmd.custom_timeouts["create"] == "180s"
    assert "/srv/dsv41-exl3" in create and "rocep1s0f1" in create
    assert rec.outputs == {
        "gid_index": 3,
        "mem": 118.25,
        "report": "preflight spark-1: ok: 118.2 GiB MemAvailable (need 111.5); RoCE v2 GID index 3 (resolved) "
        "on rocep1s0f1; stopped dsv41-exl3-dev-head",
    }


def test_component_keeps_the_ssh_key_out_of_the_command_text() -> None:
    rec = run_component(component_args(), line())
    (cmd,) = rec.of_type("command:remote:Command")
    key_body = "c2VjcmV0LWtleS1ieXRlcw=="
    for name, value in cmd.raw_inputs.items():
        if name != "connection":
            assert key_body not in json.dumps(value), f"secret leaked into input {name!r}"
    assert "connection" in cmd.secret_paths()


def test_component_without_rdma_reports_no_gid_index() -> None:
    args = component_args(check_rdma=False, ib_hcas=(), weights_root=None, min_free_disk_gib=None)
    rec = run_component(args, line(gid_index=None))
    assert rec.outputs["gid_index"] is None
    assert rec.outputs["mem"] == 118.25


def test_component_surfaces_a_bad_node_report_as_an_error() -> None:
    with pytest.raises(Exception, match="preflight output of node spark-1 has no gid_index"):
        run_component(component_args(), line(gid_index=None))


def test_component_refuses_invalid_args_before_creating_anything() -> None:
    with pytest.raises(ValueError, match="fabric_ip '10.0.0' is not an IPv4 address"):
        run_component(component_args(fabric_ip="10.0.0"), line())


# --- issue 10: the NFS export path must be traversable by the workers' squashed root -------------


def test_nfs_export_under_a_0750_home_is_refused_naming_the_directory_and_the_fix(
    node: FakeNode, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    (home / "dsv41-exl3" / "model").mkdir(parents=True)
    home.chmod(0o750)  # what Ubuntu 24.04 gives a new home directory
    try:
        run = node.run(make_spec(weights_root=str(home / "dsv41-exl3"), min_free_disk_gib=1, check_export_path=True))
    finally:
        home.chmod(0o755)
    assert run.rc == 1
    refusal = next(r for r in run.refusals if f"directory {home} " in r)
    assert "not traversable by others (mode drwxr-x---)" in refusal
    assert refusal.rstrip().endswith(f"fix: chmod o+x {home} (or set weights.root outside a 0750 home directory)")
    assert not any(f"directory {home / 'dsv41-exl3'} " in r for r in run.refusals), "0755 below is fine"


def test_a_slim_engram_directory_the_workers_cannot_traverse_is_refused(node: FakeNode, tmp_path: Path) -> None:
    root = tmp_path / "dsv41-exl3"
    (root / "engram-vllm").mkdir(parents=True, mode=0o750)  # what the workers mount at /engram-src
    run = node.run(make_spec(weights_root=str(root), min_free_disk_gib=1, check_export_path=True))
    assert run.rc == 1
    refusal = next(r for r in run.refusals if f"directory {root / 'engram-vllm'} " in r)
    assert f"fix: chmod o+x {root / 'engram-vllm'}" in refusal


def test_nfs_export_path_traversable_by_others_passes(node: FakeNode) -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own tmp root is 0700: use an o+x tree
    try:
        base.chmod(0o755)
        (base / "home").mkdir(mode=0o751)
        run = node.run(
            make_spec(weights_root=str(base / "home" / "not-yet-staged"), min_free_disk_gib=1, check_export_path=True)
        )
        assert run.rc == 0, run.stderr
    finally:
        shutil.rmtree(base)


def test_bind_share_and_workers_do_not_check_the_export_path(node: FakeNode, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o750)
    run = node.run(make_spec(weights_root=str(home / "w"), min_free_disk_gib=1))
    assert run.rc == 0, run.stderr
    # the one-line header assigns each value as ` NAME=value;`
    assert " CHECK_EXPORT=0;" in render_script(make_spec(weights_root="/w", min_free_disk_gib=1))
    with pytest.raises(ValueError, match="check_export_path needs weights_root"):
        make_spec(check_export_path=True)


def test_the_head_checks_the_export_path_only_with_the_nfs_share() -> None:
    from components.config import parse
    from components.deployment import deploy
    from tests.support.graph import COMMAND, FIXTURES, config

    for share, expected in (("nfs", " CHECK_EXPORT=1;"), ("bind", " CHECK_EXPORT=0;")):
        raw = config()
        raw["weights"]["share"] = share
        loaded = parse(raw)
        rec = recording.run(lambda loaded=loaded: deploy(loaded, "dev"), FIXTURES)
        head = next(c for c in rec.of_type(COMMAND) if c.name == "preflight-spark-0-check")
        worker = next(c for c in rec.of_type(COMMAND) if c.name == "preflight-spark-1-check")
        assert expected in head.inputs["create"]
        assert " CHECK_EXPORT=0;" in worker.inputs["create"]


def test_a_weights_root_the_user_cannot_create_is_refused_with_the_sudo_line(node: FakeNode, tmp_path: Path) -> None:
    blocked = tmp_path / "srv"
    blocked.write_text("a file where the root's parent should be: mkdir fails, even as root")
    spec = make_spec(weights_root=str(blocked / "dsv41-exl3"), min_free_disk_gib=1)
    run = node.run(spec)
    assert run.rc == 1
    (refusal,) = run.refusals
    me = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    assert f"cannot create {blocked}/dsv41-exl3 as {me}" in refusal
    assert f"sudo install -d -o {me} -g " in refusal and refusal.endswith(f"-m 0755 {blocked}/dsv41-exl3")


def test_a_missing_weights_root_is_created_and_checked_writable(node: FakeNode, tmp_path: Path) -> None:
    root = tmp_path / "srv" / "dsv41-exl3"
    run = node.run(make_spec(weights_root=str(root), min_free_disk_gib=1))
    assert run.rc == 0, run.stderr
    assert root.is_dir() and list(root.iterdir()) == [], "created empty: the write check leaves nothing"


# --- issue 34: the head's address must be one of the head's own ------------------------------------

HEAD_NAME = OwnAddress(key="nodes[0].host", host="spark-1", address="192.168.1.10")


def test_the_heads_own_address_passes_and_is_noted(node: FakeNode) -> None:
    spec = make_spec(own_address=HEAD_NAME)
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    assert run.ip_calls == ["route get 192.168.1.10"], "asked of the node's kernel, by the resolved address"
    assert "nodes[0].host: 192.168.1.10 is an address of spark-1" in parse_output(run.stdout, spec).findings


def test_an_address_of_another_machine_is_refused_naming_the_key_the_name_the_address_and_the_fix(
    node: FakeNode,
) -> None:
    """A name the operator's machine resolves to another machine (a stale /etc/hosts line, a NAT in front of
    the head): Prometheus could not bind it and would exit after the verifier passed."""
    node.ip_route = "192.168.1.20 via 192.168.1.1 dev enP7s7 src 192.168.1.10 uid 1000\n    cache"
    run = node.run(make_spec(own_address=HEAD_NAME))
    assert run.rc == 1
    (refusal,) = run.refusals
    assert refusal.startswith(
        "preflight refused on node spark-1: nodes[0].host = spark-1 (resolved on the operator's machine to "
        "192.168.1.10) is not an address of spark-1 (ip route get: 192.168.1.20 via 192.168.1.1 dev enP7s7"
    ), refusal
    assert "fix: set nodes[0].host to spark-1's own LAN or Tailscale address (hostname -I on spark-1" in refusal


def test_an_address_the_node_has_no_route_to_is_refused_with_the_error(node: FakeNode) -> None:
    node.ip_fails = "RTNETLINK answers: Network is unreachable"
    literal = OwnAddress(key="nodes[0].host", host="10.9.9.9", address="10.9.9.9")
    run = node.run(make_spec(own_address=literal))
    assert run.rc == 1
    (refusal,) = run.refusals
    assert "nodes[0].host = 10.9.9.9: ip route get 10.9.9.9 failed on spark-1 (RTNETLINK answers: Network is" in refusal
    assert "resolved on the operator's machine" not in refusal, "an IP literal was not resolved"


def test_the_address_is_noted_unchecked_on_a_node_without_ip(node: FakeNode) -> None:
    node.ip = None
    spec = make_spec(own_address=HEAD_NAME)
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    assert (
        "nodes[0].host: not checked as an address of spark-1 (no ip command)" in parse_output(run.stdout, spec).findings
    )


def test_a_worker_checks_no_address(node: FakeNode) -> None:
    node.ip_route = "10.0.0.1 via 10.0.0.254 dev eth0"  # would refuse, were it asked
    run = node.run(make_spec(own_address=None))
    assert run.rc == 0, run.stderr
    assert run.ip_calls == []


def test_the_sims_loopback_node_address_is_local_to_the_real_ip(node: FakeNode) -> None:
    """The simulated cluster's nodes are 127.0.0.2, 127.0.0.3, ... of one machine's lo: this machine's own `ip`
    says `local ... dev lo` for every one of them (a lookup in the kernel's table, no packet sent)."""
    node.ip = "real"
    spec = make_spec(own_address=OwnAddress(key="nodes[0].host", host="127.0.0.3", address="127.0.0.3"))
    run = node.run(spec)
    assert run.rc == 0, run.stderr
    assert "nodes[0].host: 127.0.0.3 is an address of spark-1" in parse_output(run.stdout, spec).findings


def test_the_address_must_be_resolved_before_it_reaches_the_node() -> None:
    with pytest.raises(ValueError, match="must be an IP address: resolve the name first"):
        make_spec(own_address=OwnAddress(key="nodes[0].host", host="spark-1", address="spark-1"))


def test_only_the_heads_preflight_checks_its_resolved_address() -> None:
    from components.config import parse
    from components.deployment import deploy
    from tests.support.graph import COMMAND, FIXTURES, config
    from tests.support.scripts import header_value

    raw = config()
    raw["nodes"][0]["host"] = "spark-0.local"
    loaded = parse(raw)
    rec = recording.run(
        lambda: deploy(loaded, "dev", resolver=lambda name: {"spark-0.local": ["10.0.0.1"]}[name]), FIXTURES
    )
    for phase in ("precheck", "preflight"):
        head = next(c for c in rec.of_type(COMMAND) if c.name == f"{phase}-spark-0-check").inputs["create"]
        worker = next(c for c in rec.of_type(COMMAND) if c.name == f"{phase}-spark-1-check").inputs["create"]
        assert [header_value(head, v) for v in ("ADDRESS", "ADDRESS_KEY", "ADDRESS_HOST")] == [
            "10.0.0.1",
            "nodes[0].host",
            "spark-0.local",
        ], phase
        assert header_value(worker, "ADDRESS") == "", "a worker's host is SSH's only: nothing binds it"
