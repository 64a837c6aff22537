"""Four simulated nodes: the program verifies with tensor parallel 4, then the memory watchdog on the four nodes
sharing one home (root's, as NFS homes share one; three or more is what matters, and the program takes 2, 4 or
8): one node's watchdog trips and every peer's rank really stops, through real sshd and the one authorized_keys
file where that node's key stands on a line per peer, each with the same from=.

Nodes 3 and 4 are started beside the sim's two when they are not running (and stopped again after); sim.json is
not changed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from program_support import Deployment, assert_verified, docker_on, new_deployment, remove_deployment

from components import labels
from sim import cluster

pytestmark = [pytest.mark.sim, pytest.mark.engine]

NODES = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def four(sim: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """sim.json's view with nodes 1-4; the ones not running are started for the module."""
    layout = cluster.default_layout()
    states = cluster.status(layout)
    started = [i for i in NODES if not (states.get(f"node-{i}/dockerd") and states.get(f"node-{i}/sshd"))]
    if started:
        cluster.up_nodes(layout, started)
        for i in started:  # a node started now pulls the image the others have, not a build it kept from before
            docker_on(i, "image", "rm", "-f", sim["image"])
    described = cluster.describe(layout, list(NODES))
    try:
        yield {**sim, "nodes": described["nodes"]}
    finally:
        if started:
            cluster.down(layout, started)


@pytest.fixture(scope="module")
def deployed(four: dict[str, Any], program_env: dict[str, str], pulumi_root: Path) -> Iterator[Deployment]:
    weights = Path(tempfile.mkdtemp(prefix="dsv41-wd4-weights-", dir="/var/tmp"))
    d = new_deployment(
        four,
        f"wd4-{uuid.uuid4().hex[:6]}",
        program_env,
        pulumi_root,
        weights_root=weights,
        port=18892,
        master_port=29625,
    )
    try:
        assert_verified(d, d.up().outputs)
        yield d
    finally:
        remove_deployment(d)
        shutil.rmtree(weights, ignore_errors=True)


def on_node(sim: dict[str, Any], node: dict[str, Any], command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ssh", "-F", sim["ssh"]["config"], f"root@{node['ip']}", command],
        capture_output=True,
        text=True,
        timeout=60,
    )


def running(d: Deployment, node: dict[str, Any]) -> bool:
    out = docker_on(node["index"], "inspect", "-f", "{{.State.Running}}", d.container(node)).stdout.strip()
    return out == "true"


def test_four_nodes_verify_with_tensor_parallel_four(deployed: Deployment) -> None:
    outputs = deployed.stack.outputs()  # the fixture's up verified
    assert_verified(deployed, outputs)
    assert len(outputs["containers"].value) == 4
    for rank, n in enumerate(deployed.sim["nodes"]):
        args = docker_on(n["index"], "inspect", "-f", "{{json .Args}}", deployed.container(n)).stdout
        assert '"--tensor-parallel-size","4"' in args.replace(" ", "") and f'"--node-rank","{rank}"' in args, args


@pytest.mark.timeout(900)
def test_one_tripped_watchdog_stops_every_peers_rank_on_a_home_shared_by_four_nodes(deployed: Deployment) -> None:
    d = deployed
    nodes = d.sim["nodes"]
    assert all(running(d, n) for n in nodes)
    home = Path.home()
    ak = (home / ".ssh" / "authorized_keys").read_text().splitlines()
    prefix = labels.stack_prefix("dsv41-exl3", d.name)
    key = (home / ".local/state" / prefix / f"watchdog-key-{prefix}-node-1.pub").read_text().split()[1]
    mine = [line for line in ak if key in line]
    assert len(mine) == 3 and len({line.split(",command=")[0] for line in mine}) == 1, (
        "the situation under test: node-1's key on a line per peer, each with the same options before the command"
    )
    # node-1's own watchdog, restarted on node-1 reading a MemAvailable below any floor: a real trip.
    meminfo = Path(tempfile.mkdtemp(prefix="dsv41-wd4-")) / "meminfo"
    meminfo.write_text("MemTotal: 24000000 kB\nMemAvailable: 1 kB\n")
    share, state = f".local/share/{prefix}", f".local/state/{prefix}"
    pidfile = f"{state}/memory-watchdog-node-1.pid"
    restarted = on_node(
        d.sim,
        nodes[0],
        f"kill $(cat {pidfile}); sleep 0.5; DSV41_WATCHDOG_MEMINFO={meminfo} setsid nohup sh "
        f"{share}/memory-watchdog-node-1.sh >/dev/null 2>&1 </dev/null & echo started",
    )
    assert restarted.returncode == 0, restarted.stderr
    log = home / state / "watchdog.log"
    try:

        def logged() -> list[str]:
            return [line for line in log.read_text().splitlines() if d.name in line]

        def peer_logged(peer: dict, lines: list[str]) -> bool:
            return any(f"container={d.container(peer)} killed (asked by node-1)" in line for line in lines)

        # A rank is seen stopped a moment before its "killed" line is written: wait for both.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            any(running(d, n) for n in nodes) or not all(peer_logged(p, logged()) for p in nodes[1:])
        ):
            time.sleep(0.5)
        lines = logged()
        assert not any(running(d, n) for n in nodes), (
            "a trip on node-1 must stop every rank: "
            + json.dumps({n["index"]: running(d, n) for n in nodes})
            + "\n"
            + "\n".join(lines[-30:])
        )
        for peer in nodes[1:]:
            assert peer_logged(peer, lines), (
                f"node-{peer['index']}'s rank stopped at node-1's request, logged:\n" + "\n".join(lines[-30:])
            )
    finally:
        pid = on_node(d.sim, nodes[0], f"cat {pidfile}").stdout.strip()
        if pid.isdigit():
            on_node(d.sim, nodes[0], f"kill {pid}")
        shutil.rmtree(meminfo.parent, ignore_errors=True)
