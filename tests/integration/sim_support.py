"""The running simulated cluster, for tests: bring it up (or skip), run commands on its nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from components.scripts import sh_command
from components.weights import manifest as wm
from sim import checkpoint, cluster

REPO = Path(__file__).resolve().parents[2]
STEP_TIMEOUT = 120  # seconds, for any single command against the sim


def sim_ready_or_skip() -> dict[str, Any]:
    if os.environ.get("DSV41_REQUIRE_SIM") != "1":
        pytest.skip("simulated cluster tests need root and start daemons; set DSV41_REQUIRE_SIM=1 to run them")
    proc = subprocess.run(
        [sys.executable, "-m", "sim.cluster", "up"], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        pytest.fail(f"`python -m sim.cluster up` failed (DSV41_REQUIRE_SIM=1):\n{proc.stderr[-3000:]}")
    info: dict[str, Any] = json.loads((cluster.default_layout().state / "sim.json").read_text())
    return info


def remove_labelled(label: str) -> None:
    """Remove every container carrying `label` on every node of the sim."""
    layout = cluster.default_layout()
    for i in layout.existing_nodes():
        ids = subprocess.run(
            ["docker", "-H", layout.docker_host(i), "ps", "-aq", "--filter", f"label={label}"],
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT,
        ).stdout.split()
        if ids:
            subprocess.run(
                ["docker", "-H", layout.docker_host(i), "rm", "-f", *ids], capture_output=True, timeout=STEP_TIMEOUT
            )


def on_node(
    sim: dict[str, Any], ip: str, command: str, stdin: str | None = None, timeout: int = STEP_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run `command` on a node over its sshd, as the program does."""
    return subprocess.run(
        ["ssh", "-F", sim["ssh"]["config"], f"root@{ip}", command],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


STAGING_PREFIX = "dsv41-exl3-sim-staging"


def stage_on_head(sim: dict[str, Any], root: Path, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """The program's own staging command (weights_manifest, under `sh` as WeightStore sends it), run on the head
    over ssh, image from the registry; `token` as `weights.hfToken` (None: anonymous)."""
    plan = wm.staging_plan(model_repo=checkpoint.MODEL_REPO, engram_repo=checkpoint.BASE_REPO, revision="main")
    command = wm.render_stage_command(
        root=str(root),
        image=sim["image"],
        plan=plan,
        hf_endpoint=sim["hub"],
        with_token=token is not None,
        timeout_s=STEP_TIMEOUT,
        stack_prefix=STAGING_PREFIX,
    )
    return on_node(
        sim,
        sim["nodes"][0]["ip"],
        sh_command(command),
        stdin=wm.stage_stdin(token, wm.stage_program_text()),
        timeout=STEP_TIMEOUT + 60,
    )
