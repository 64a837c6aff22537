"""The gates and the verifier through the real engine, against real ranks on the simulated cluster.

Each node's sshd reaches its own dockerd; the stand-in vLLM image comes from the loopback registry; the
weights come from the hub stand-in through the program's own staging command. The serving containers are
started here with the docker CLI from the program's own spec (`serve_spec`: argv, env, labels, names),
because the docker provider cannot be built on this workplace (README, "What is missing"); everything after
the containers is the program's code: `deployment.verify_after` (rendezvous gate -> ready gate -> verifier)
run by the project's Pulumi CLI, reading the ranks over SSH exactly as on hardware.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulumi
import pytest
from pulumi import automation as auto
from sim_support import STEP_TIMEOUT, stage_on_head

from components import serve_spec
from components.config import Settings, parse
from components.deployment import endpoint_of, verify_after
from sim import cluster

pytestmark = [pytest.mark.sim, pytest.mark.engine]

ROOT = Path(__file__).resolve().parents[2]
STACK = "sime2e"


@pytest.fixture(scope="module")
def weights(sim: dict[str, Any]) -> Iterator[Path]:
    """The checkpoint staged on the head by the program's staging command (bind share: every node sees it)."""
    root = Path(tempfile.mkdtemp(prefix="dsv41-e2e-weights-"))
    proc = stage_on_head(sim, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield root
    shutil.rmtree(root, ignore_errors=True)


def sim_settings(sim: dict[str, Any], root: Path, *, fault: dict[str, str] | None = None,
                 gates: dict[str, Any] | None = None) -> Settings:
    nodes = [
        {"name": f"node-{n['index']}", "host": n["ip"], "port": sim["ssh"]["port"], "user": sim["ssh"]["user"],
         "fabricIp": n["ip"], "fabricInterface": "lo", "ibHcas": [], "gpus": "", "rdmaDevices": []}
        for n in sim["nodes"]
    ]
    raw = {
        "nodes": nodes,
        "ssh": {"privateKey": Path(sim["ssh"]["key"]).read_text(), "knownHostsFile": sim["ssh"]["known_hosts"]},
        "weights": {"root": str(root), "share": "bind", "hfEndpoint": sim["hub"]},
        "image": sim["image"],
        "serve": {
            "port": 18888, "masterPort": 29621,
            "extraArgs": ["--host", sim["nodes"][0]["ip"]],
            "extraEnv": {"SIM_LOAD_SECONDS": "2", "SIM_RENDEZVOUS_TIMEOUT_S": "25", **(fault or {})},
        },
        "gates": {"rendezvousTimeoutSeconds": 40, "readyTimeoutSeconds": 180, "stallSeconds": 20,
                  "verifyTimeoutSeconds": 30, **(gates or {})},
    }
    return parse(raw).settings


def docker(sim: dict[str, Any], index: int, *args: str) -> subprocess.CompletedProcess[str]:
    layout = cluster.default_layout()
    return subprocess.run(["docker", "-H", layout.docker_host(index), *args], capture_output=True, text=True,
                          timeout=STEP_TIMEOUT)


def start_ranks(sim: dict[str, Any], s: Settings, root: Path, label: str) -> list[str]:
    """Stand-in for the docker provider: the program's argv, env and labels; workers first, then the head."""
    generation = serve_spec.cluster_generation(s)
    ids: dict[int, str] = {}
    order = [*range(1, len(s.nodes)), 0]
    for rank in order:
        node, index = s.nodes[rank], sim["nodes"][rank]["index"]
        name = serve_spec.container_name(STACK, node)
        docker(sim, index, "rm", "-f", name)
        pull = docker(sim, index, "pull", "-q", s.image)
        assert pull.returncode == 0, pull.stderr
        env = serve_spec.node_env(s, node, None)
        labels = serve_spec.labels(STACK, generation, generation, rank)
        run = docker(
            sim, index, "run", "-d", "--name", name, "--network", "host", "--ipc", "host",
            "--label", label, *[f"--label={k}={v}" for k, v in labels.items()],
            "--mount", f"type=bind,source={root}/model,target={serve_spec.MODEL_MOUNT},readonly",
            "--mount", f"type=bind,source={root}/engram-src,target={serve_spec.ENGRAM_MOUNT},readonly",
            *[f"--env={k}={v}" for k, v in sorted(env.items())],
            "--entrypoint", "vllm", s.image, *serve_spec.rank_command(s, rank),
        )
        assert run.returncode == 0, run.stderr
        ids[rank] = run.stdout.strip()
    return [ids[r] for r in range(len(s.nodes))]


def gated_stack(pulumi_root: Path, env: dict[str, str], work: Path, s: Settings, ids: list[str]) -> auto.Stack:
    names = {n.name: serve_spec.container_name(STACK, n) for n in s.nodes}

    def program() -> None:
        verifier = verify_after(s, container_names=names, container_ids=ids, after=[])
        pulumi.export("answer", verifier.answer)
        pulumi.export("logprobs", verifier.logprobs)

    return auto.create_or_select_stack(
        STACK,
        project_name="dsv41-exl3-sim-e2e",
        program=program,
        opts=auto.LocalWorkspaceOptions(
            work_dir=str(work),
            pulumi_command=auto.PulumiCommand(root=str(pulumi_root)),
            env_vars={**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"},
        ),
    )


@pytest.fixture
def label(sim: dict[str, Any]) -> Iterator[str]:
    value = f"dsv41.sim.e2e={uuid.uuid4().hex[:12]}"
    yield value
    from sim_support import remove_labelled

    remove_labelled(value)


def up_fails(stack: auto.Stack) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(auto.CommandError) as err:
        stack.up()
    return str(err.value), time.monotonic() - start


@pytest.mark.timeout(600)
def test_healthy_cluster_verifies_then_a_second_up_changes_nothing(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    s = sim_settings(sim, weights)
    ids = start_ranks(sim, s, weights, label)
    stack = gated_stack(pulumi_root, engine_env, tmp_path, s, ids)
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
    s = sim_settings(sim, weights, fault={"SIM_FAULT": "nan-logits"})
    stack = gated_stack(pulumi_root, engine_env, tmp_path, s, start_ranks(sim, s, weights, label))
    message, _ = up_fails(stack)
    assert "NaN" in message

    # Removing the fault (new containers) and running up again reaches a verified endpoint.
    healthy = sim_settings(sim, weights)
    stack = gated_stack(pulumi_root, engine_env, tmp_path, healthy, start_ranks(sim, healthy, weights, label))
    assert stack.up().outputs["answer"].value.strip().startswith("Paris")


@pytest.mark.timeout(600)
def test_worker_exit_fails_the_update_naming_the_worker(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    s = sim_settings(sim, weights, fault={"SIM_FAULT": "worker-exit-after-load"})
    stack = gated_stack(pulumi_root, engine_env, tmp_path, s, start_ranks(sim, s, weights, label))
    message, _ = up_fails(stack)
    worker = s.nodes[1].name
    assert worker in message or "rank 1" in message or "dead or hung" in message, message
    state = docker(sim, sim["nodes"][1]["index"], "inspect", "-f", "{{.State.Status}} {{.State.FinishedAt}}",
                   serve_spec.container_name(STACK, s.nodes[1]))
    assert state.stdout.startswith("exited"), state.stdout


@pytest.mark.timeout(600)
def test_rank_that_never_joins_fails_the_rendezvous_naming_rank_1(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    s = sim_settings(sim, weights, fault={"SIM_FAULT": "rank-never-joins"})
    stack = gated_stack(pulumi_root, engine_env, tmp_path, s, start_ranks(sim, s, weights, label))
    message, elapsed = up_fails(stack)
    assert "rank 1" in message, message
    assert elapsed < 40 + 60, f"the rendezvous gate must fail by its timeout (40 s), took {elapsed:.0f} s"


@pytest.mark.timeout(600)
def test_stall_after_load_fails_at_stall_seconds(
    sim: dict[str, Any], weights: Path, label: str, pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    s = sim_settings(sim, weights, fault={"SIM_FAULT": "stall-after-load"})
    stack = gated_stack(pulumi_root, engine_env, tmp_path, s, start_ranks(sim, s, weights, label))
    message, elapsed = up_fails(stack)
    assert "stall" in message.lower() or "no new log line" in message.lower(), message
    assert elapsed < 180, f"a stall must be called near stallSeconds (20 s), not at the ready timeout; {elapsed:.0f} s"
