"""The preflight and the memory watchdog as the program renders them, run over ssh on a simulated node.

`remote.Command` runs its command text in an ssh session on the node; these tests do the same with
the sim's ssh config, against the node's real dockerd and real serving containers (started by
`sim/ranks.py`), so the scripts' docker calls and templates meet a real daemon, not a fake.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sim_support import on_node

from components import serve_spec
from components.preflight_script import PreflightSpec, parse_output, render_command
from components.watchdog import LOG_PATH, WatchdogSettings, render_install_command, render_remove_command
from sim import ranks

pytestmark = pytest.mark.sim


def running(sim: dict[str, Any], rank: int, name: str) -> bool:
    state = ranks.docker(ranks.node_index(sim, rank), "inspect", "-f", "{{.State.Running}}", name)
    return state.stdout.strip() == "true"


def preflight(sim: dict[str, Any], node_ip: str, **overrides: Any) -> tuple[int, str, str]:
    spec = PreflightSpec(**{
        "node_name": "node-2", "fabric_ip": node_ip, "ib_hcas": (), "gid_index": "auto", "check_rdma": False,
        "min_mem_available_gib": 0.5, "weights_root": None, "min_free_disk_gib": None,
        "stack_label": ranks.STACK, "stop_timeout_s": 5, "mem_settle_s": 5, **overrides,
    })
    proc = on_node(sim, node_ip, render_command(spec))
    if proc.returncode == 0:
        parse_output(proc.stdout, spec)  # what the program does with it
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.timeout(300)
def test_preflight_spares_the_current_generation_and_stops_a_stale_one(
    sim: dict[str, Any], weights: Path, label: str
) -> None:
    s = ranks.sim_settings(sim, weights)
    ranks.start_ranks(sim, s, weights, label)
    worker = serve_spec.container_name(ranks.STACK, s.nodes[1])
    node_ip = sim["nodes"][1]["ip"]
    current = serve_spec.cluster_generation(s)

    # The update asks for the generation that already runs: nothing is stopped, even with a memory
    # minimum this machine cannot meet (a serving node legitimately has little MemAvailable).
    rc, out, err = preflight(sim, node_ip, generation=current, min_mem_available_gib=900)
    assert rc == 0, err
    assert running(sim, 1, worker)
    assert "already serves generation" in out

    # A new generation: this stack's old rank is stopped first, then memory is checked.
    rc, out, err = preflight(sim, node_ip, generation="a-new-generation")
    assert rc == 0, err
    assert not running(sim, 1, worker), "the stale rank must be stopped before the new one is created"
    assert json.loads(out.strip().splitlines()[-1])["stopped"] == [worker]


@pytest.mark.timeout(300)
def test_preflight_refuses_a_memory_minimum_the_node_cannot_meet(sim: dict[str, Any]) -> None:
    rc, _, err = preflight(sim, sim["nodes"][1]["ip"], generation="g", min_mem_available_gib=900)
    assert rc != 0
    assert "MemAvailable is" in err and "below the required 900 GiB" in err


@pytest.mark.timeout(300)
def test_watchdog_stops_the_serving_container_below_the_floor_and_records_why(
    sim: dict[str, Any], weights: Path, label: str
) -> None:
    s = ranks.sim_settings(sim, weights)
    ranks.start_ranks(sim, s, weights, label)
    worker = serve_spec.container_name(ranks.STACK, s.nodes[1])
    node_ip = sim["nodes"][1]["ip"]
    # A floor far above this machine's MemAvailable: every sample is low.
    settings = WatchdogSettings(node_name=f"scripts-{uuid.uuid4().hex[:6]}", container_name=worker,
                                floor_gib=1000, sample_interval_s=1, consecutive_samples=2)
    install = on_node(sim, node_ip, render_install_command(settings))
    assert install.returncode == 0, install.stderr
    try:
        deadline = time.monotonic() + 60
        while running(sim, 1, worker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not running(sim, 1, worker), "the watchdog did not stop the serving container"
        log = on_node(sim, node_ip, f"cat {LOG_PATH}").stdout
        line = [ln for ln in log.splitlines() if worker in ln and settings.node_name in ln]
        assert line, f"no reason recorded in {LOG_PATH}:\n{log[-2000:]}"
        assert any("MemAvailable" in ln for ln in line), line
    finally:
        remove = on_node(sim, node_ip, render_remove_command(settings))
        assert remove.returncode == 0, remove.stderr
