"""The program's ranks on the simulated cluster, started without the docker provider.

The docker provider cannot be built on this workplace (README, "What is missing"), so this starts each
rank's container with the docker CLI from the program's own spec (`components.serve_spec`: argv, env,
labels, names; workers first, then the head), and runs the program's own gates and verifier
(`components.deployment.verify_after`) through the project's Pulumi CLI with the Automation API.
Used by the end-to-end tests and the benchmarks; not by the program.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pulumi
from pulumi import automation as auto

from components import serve_spec
from components.config import Settings, parse
from components.deployment import verify_after
from sim import cluster

REPO = Path(__file__).resolve().parents[1]
STACK = "sime2e"
STEP_TIMEOUT = 120


def sim_settings(sim: dict[str, Any], weights_root: Path, *, extra_env: dict[str, str] | None = None,
                 gates: dict[str, Any] | None = None, nodes: int | None = None) -> Settings:
    """Settings for the running sim (sim.json): loopback nodes, bind share, no GPU or RDMA."""
    chosen = sim["nodes"][:nodes] if nodes else sim["nodes"]
    raw = {
        "nodes": [
            {"name": f"node-{n['index']}", "host": n["ip"], "port": sim["ssh"]["port"], "user": sim["ssh"]["user"],
             "fabricIp": n["ip"], "fabricInterface": "lo", "ibHcas": [], "gpus": "", "rdmaDevices": []}
            for n in chosen
        ],
        "ssh": {"privateKey": Path(sim["ssh"]["key"]).read_text(), "knownHostsFile": sim["ssh"]["known_hosts"]},
        "weights": {"root": str(weights_root), "share": "bind", "hfEndpoint": sim["hub"]},
        "image": sim["image"],
        "serve": {
            "port": 18888, "masterPort": 29621,
            "extraArgs": ["--host", chosen[0]["ip"]],
            "extraEnv": {"SIM_LOAD_SECONDS": "2", "SIM_RENDEZVOUS_TIMEOUT_S": "25", **(extra_env or {})},
        },
        "gates": {"rendezvousTimeoutSeconds": 40, "readyTimeoutSeconds": 180, "stallSeconds": 20,
                  "verifyTimeoutSeconds": 30, **(gates or {})},
    }
    return parse(raw).settings


def docker(index: int, *args: str) -> subprocess.CompletedProcess[str]:
    """The docker CLI against node `index`'s own daemon."""
    return subprocess.run(["docker", "-H", cluster.default_layout().docker_host(index), *args],
                          capture_output=True, text=True, timeout=STEP_TIMEOUT)


def node_index(sim: dict[str, Any], rank: int) -> int:
    return int(sim["nodes"][rank]["index"])


def start_ranks(sim: dict[str, Any], s: Settings, weights_root: Path, label: str) -> list[str]:
    """Start every rank's container (workers first, then the head); return their ids, head first."""
    generation = serve_spec.cluster_generation(s)
    ids: dict[int, str] = {}
    for rank in [*range(1, len(s.nodes)), 0]:
        node, index = s.nodes[rank], node_index(sim, rank)
        name = serve_spec.container_name(STACK, node)
        docker(index, "rm", "-f", name)
        pull = docker(index, "pull", "-q", s.image)
        if pull.returncode != 0:
            raise RuntimeError(f"pull of {s.image} on node {index} failed: {pull.stderr.strip()}")
        env = serve_spec.node_env(s, node, None)
        labels = serve_spec.labels(STACK, generation, generation, rank)
        run = docker(
            index, "run", "-d", "--name", name, "--network", "host", "--ipc", "host",
            "--label", label, *[f"--label={k}={v}" for k, v in labels.items()],
            "--mount", f"type=bind,source={weights_root}/model,target={serve_spec.MODEL_MOUNT},readonly",
            "--mount", f"type=bind,source={weights_root}/engram-src,target={serve_spec.ENGRAM_MOUNT},readonly",
            *[f"--env={k}={v}" for k, v in sorted(env.items())],
            "--entrypoint", "vllm", s.image, *serve_spec.rank_command(s, rank),
        )
        if run.returncode != 0:
            raise RuntimeError(f"docker run of rank {rank} on node {index} failed: {run.stderr.strip()}")
        ids[rank] = run.stdout.strip()
    return [ids[r] for r in range(len(s.nodes))]


def gated_stack(pulumi_root: Path, env: dict[str, str], work_dir: Path, s: Settings, ids: list[str]) -> auto.Stack:
    """A stack holding only the program's gates and verifier over the running ranks."""
    names = {n.name: serve_spec.container_name(STACK, n) for n in s.nodes}

    def program() -> None:
        verifier = verify_after(s, container_names=names, container_ids=ids, after=[])
        pulumi.export("answer", verifier.answer)
        pulumi.export("logprobs", verifier.logprobs)
        pulumi.export("verifiedAt", verifier.verified_at)
        pulumi.export("decodeTokensPerSecond", verifier.decode_tokens_per_second)

    return auto.create_or_select_stack(
        STACK,
        project_name="dsv41-exl3-sim-e2e",
        program=program,
        opts=auto.LocalWorkspaceOptions(
            work_dir=str(work_dir),
            pulumi_command=auto.PulumiCommand(root=str(pulumi_root)),
            env_vars={**env, "PYTHONPATH": f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"},
        ),
    )
