"""The gates and the verifier through the real engine, against real ranks on the simulated cluster.

Each node's sshd reaches its own dockerd; the stand-in vLLM image comes from the loopback registry; the
weights come from the hub stand-in through the program's own staging command. The ranks are started by
`sim/ranks.py` from the program's own spec (the docker provider cannot be built here); everything after
the containers is the program's code, run by the project's Pulumi CLI, reading the ranks over SSH.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from pulumi import automation as auto

from components import serve_spec
from components.deployment import endpoint_of
from sim import ranks

pytestmark = [pytest.mark.sim, pytest.mark.engine]

ROOT = Path(__file__).resolve().parents[2]


def up_fails(stack: auto.Stack) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(auto.CommandError) as err:
        stack.up()
    return str(err.value), time.monotonic() - start


@pytest.mark.timeout(600)
def test_healthy_cluster_verifies_then_a_second_up_changes_nothing(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    s = ranks.sim_settings(sim, weights)
    ids = ranks.start_ranks(sim, s, weights, label)
    stack = ranks.gated_stack(pulumi_root, engine_env, tmp_path, s, ids)
    up = stack.up()
    assert up.outputs["answer"].value.strip().startswith("Paris")
    assert all(-9999.0 < x["logprob"] <= 0 for x in up.outputs["logprobs"].value)
    again = stack.up()
    assert again.summary.resource_changes == {"same": 4}, "nothing changed: no gate or verifier re-runs"
    # The endpoint the program would export answers the official-client-shaped request too.
    assert endpoint_of(s) == f"http://{sim['nodes'][0]['ip']}:18888/v1"


@pytest.mark.timeout(600)
def test_nan_logits_fail_the_update_as_nan_without_retrying(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    s = ranks.sim_settings(sim, weights, extra_env={"SIM_FAULT": "nan-logits"})
    stack = ranks.gated_stack(pulumi_root, engine_env, tmp_path, s, ranks.start_ranks(sim, s, weights, label))
    message, _ = up_fails(stack)
    assert "NaN" in message

    # Removing the fault (new containers) and running up again reaches a verified endpoint.
    healthy = ranks.sim_settings(sim, weights)
    ids = ranks.start_ranks(sim, healthy, weights, label)
    stack = ranks.gated_stack(pulumi_root, engine_env, tmp_path, healthy, ids)
    assert stack.up().outputs["answer"].value.strip().startswith("Paris")


@pytest.mark.timeout(600)
def test_worker_exit_fails_the_update_naming_the_worker(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    s = ranks.sim_settings(sim, weights, extra_env={"SIM_FAULT": "worker-exit-after-load"})
    stack = ranks.gated_stack(pulumi_root, engine_env, tmp_path, s, ranks.start_ranks(sim, s, weights, label))
    message, _ = up_fails(stack)
    worker = s.nodes[1].name
    assert worker in message or "rank 1" in message or "dead or hung" in message, message
    state = ranks.docker(sim["nodes"][1]["index"], "inspect", "-f", "{{.State.Status}} {{.State.FinishedAt}}",
                   serve_spec.container_name(ranks.STACK, s.nodes[1]))
    assert state.stdout.startswith("exited"), state.stdout


@pytest.mark.timeout(600)
def test_rank_that_never_joins_fails_the_rendezvous_naming_rank_1(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    s = ranks.sim_settings(sim, weights, extra_env={"SIM_FAULT": "rank-never-joins"})
    stack = ranks.gated_stack(pulumi_root, engine_env, tmp_path, s, ranks.start_ranks(sim, s, weights, label))
    message, elapsed = up_fails(stack)
    assert "rank 1" in message, message
    assert elapsed < 40 + 60, f"the rendezvous gate must fail by its timeout (40 s), took {elapsed:.0f} s"


@pytest.mark.timeout(600)
def test_stall_after_load_fails_at_stall_seconds(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    s = ranks.sim_settings(sim, weights, extra_env={"SIM_FAULT": "stall-after-load"})
    stack = ranks.gated_stack(pulumi_root, engine_env, tmp_path, s, ranks.start_ranks(sim, s, weights, label))
    message, elapsed = up_fails(stack)
    assert "stall" in message.lower() or "no new log line" in message.lower(), message
    assert elapsed < 180, f"a stall must be called near stallSeconds (20 s), not at the ready timeout; {elapsed:.0f} s"


@pytest.mark.timeout(600)
def test_ready_gate_reports_phase_and_elapsed_time_in_the_up_output(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    # A 40 s load outlasts the gate's 30 s progress interval: at least one progress line must reach the CLI.
    s = ranks.sim_settings(sim, weights, extra_env={"SIM_LOAD_SECONDS": "40"})
    stack = ranks.gated_stack(pulumi_root, engine_env, tmp_path, s, ranks.start_ranks(sim, s, weights, label))
    lines: list[str] = []
    up = stack.up(on_output=lines.append)
    assert up.outputs["answer"].value.strip().startswith("Paris")
    progress = [line for line in lines if "ready gate: phase" in line]
    assert progress, "no progress line reached the `pulumi up` output:\n" + "\n".join(lines[-40:])
    assert any("load" in line and "elapsed" in line for line in progress), progress
