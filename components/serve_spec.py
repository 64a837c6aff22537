"""What each rank's container runs: vLLM flags, RoCE/NCCL environment, mounts, labels.

Pure logic: no resources. One spec renders every rank, so the head and the workers
cannot drift apart; everything the ranks must agree on is hashed into the cluster
generation, which every container carries as a label so a change replaces all ranks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from components.config import Node, Settings

STACK_LABEL = "dsv41-exl3.stack"
GENERATION_LABEL = "dsv41-exl3.generation"
# The config-only part of the generation: known before anything runs, so the preflight can tell
# "this node already serves what the update asks for" from "this node is about to be replaced".
CONFIG_LABEL = "dsv41-exl3.config"
RANK_LABEL = "dsv41-exl3.rank"

MODEL_MOUNT = "/model"
ENGRAM_MOUNT = "/engram-src"
# JIT caches survive restarts: they save the JIT part of a 20-25 minute cold boot.
CACHE_VOLUMES = {"vllm": "/root/.cache/vllm", "triton": "/root/.triton", "tilelang": "/root/.tilelang"}

# Vendor sampling for DeepSeek reasoning models (recipe section 4), set server-side.
VENDOR_SAMPLING = {"temperature": 1.0, "top_p": 0.95}
CUDAGRAPH_CAPTURE_SIZES = ["1", "2", "3", "4", "6", "8", "12", "18", "24"]

# NCCL over RoCE on GB10 unified memory (the A1 launcher's set); identical on every node.
NCCL_COMMON_ENV = {
    "NCCL_NET": "IB",
    "NCCL_IB_DISABLE": "0",
    "NCCL_IB_ROCE_VERSION_NUM": "2",
    "NCCL_NET_PLUGIN": "none",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_IB_MERGE_NICS": "0",
    "NCCL_CROSS_NIC": "0",
    "NCCL_IGNORE_CPU_AFFINITY": "1",
    "NCCL_DEBUG": "WARN",
    # Pinned buffers 4.7 GiB -> ~0.14 GiB: memory the unified pool needs for KV and prefill.
    "NCCL_BUFFSIZE": "1048576",
    "NCCL_LL128_BUFFSIZE": "262144",
    "NCCL_PROTO": "^LL128",
    "NCCL_MAX_NCHANNELS": "8",
    "VLLM_ENGINE_READY_TIMEOUT_S": "1500",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # Two EXL3 kernels on different streams deadlock.
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1",
}


def model_flags(s: Settings) -> list[str]:
    """The `vllm serve` flags every rank shares (the recipe's, each driven by config)."""
    v = s.serve
    flags = [
        "--quantization", v.quantization,
        "--kv-cache-memory-bytes", str(v.kv_cache_memory_bytes),
        "--block-size", "64",
        "--max-model-len", str(v.max_model_len),
        "--max-num-seqs", str(v.max_num_seqs),
        "--max-num-batched-tokens", str(v.max_num_batched_tokens),
        "--long-prefill-token-threshold", "1792",
        "--gpu-memory-utilization", str(v.gpu_memory_utilization),
        "--tokenizer-mode", "deepseek_v41",
        "--tool-call-parser", "deepseek_v41",
        "--reasoning-parser", "deepseek_v41",
        "--enable-prefix-caching",
        "--no-enable-flashinfer-autotune",
        "--hf-overrides", json.dumps({"engram_table_dir": ENGRAM_MOUNT}),
        "--language-model-only",
        "--override-generation-config", json.dumps(VENDOR_SAMPLING),
        "--served-model-name", v.served_model_name,
        "--port", str(v.port),
    ]
    if v.enforce_eager:
        # Eager mode has no CUDA graphs, and speculative decoding needs them.
        flags.append("--enforce-eager")
    else:
        flags += ["--cudagraph-capture-sizes", *CUDAGRAPH_CAPTURE_SIZES]
        if v.num_speculative_tokens > 0:
            flags += ["--speculative-config", json.dumps(
                {"method": "dspark", "num_speculative_tokens": v.num_speculative_tokens})]
    return flags + list(v.extra_args)


def rank_command(s: Settings, rank: int) -> list[str]:
    """`vllm serve` argv (after the entrypoint) for one rank: mp multi-node, no Ray."""
    cmd = ["serve", MODEL_MOUNT, *model_flags(s)]
    cmd += [
        "--distributed-executor-backend", "mp",
        "--tensor-parallel-size", str(s.tensor_parallel_size),
        "--nnodes", str(len(s.nodes)),
        "--node-rank", str(rank),
        "--master-addr", s.head.fabric_ip,
        "--master-port", str(s.serve.master_port),
    ]
    if rank > 0:
        cmd.append("--headless")
    return cmd


def node_env(s: Settings, node: Node, gid_index: int | None) -> dict[str, str]:
    """The container environment of one node. A variable with no value is left out, never set empty:
    `NCCL_IB_GID_INDEX=` parses as 0 (the link-local GID) and hangs NCCL."""
    env = dict(NCCL_COMMON_ENV)
    per_node = {
        "VLLM_HOST_IP": node.fabric_ip,
        "NCCL_SOCKET_IFNAME": node.fabric_interface,
        "GLOO_SOCKET_IFNAME": node.fabric_interface,
        "NCCL_IB_HCA": ",".join(node.ib_hcas),
        "NCCL_IB_GID_INDEX": "" if gid_index is None else str(gid_index),
    }
    env.update({k: v for k, v in per_node.items() if v})
    env.update(s.serve.extra_env)
    return {k: v for k, v in env.items() if v != ""}


def env_list(env: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in sorted(env.items())]


def cluster_generation(s: Settings) -> str:
    """Hash of everything the ranks must agree on. Any change replaces every rank together:
    a rank left on the old generation would block at rendezvous or compute garbage."""
    agreed = {
        "image": s.image,
        "flags": model_flags(s),
        "nodes": [n.model_dump(mode="json") for n in s.nodes],
        "masterPort": s.serve.master_port,
        "env": sorted(s.serve.extra_env.items()),
        "weights": [s.weights.root, s.weights.model_repo, s.weights.engram_repo, s.weights.revision],
        # The head alone would be replaced by a new key; a worker left behind would hang at rendezvous.
        "apiKey": hashlib.sha256(s.serve.api_key.get_secret_value().encode()).hexdigest() if s.serve.api_key else None,
    }
    return hashlib.sha256(json.dumps(agreed, sort_keys=True).encode()).hexdigest()[:16]


def runtime_generation(config_generation: str, per_node: list[object]) -> str:
    """The generation every container carries: the config hash plus what earlier layers resolved
    per node (image id, GID index, weight sources). A change on any one node replaces every rank."""
    return hashlib.sha256(json.dumps([config_generation, per_node], sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]


def container_name(stack: str, node: Node) -> str:
    return f"dsv41-exl3-{stack}-{node.name}"


def labels(stack: str, config_generation: str, generation: str, rank: int) -> dict[str, str]:
    return {STACK_LABEL: stack, CONFIG_LABEL: config_generation, GENERATION_LABEL: generation, RANK_LABEL: str(rank)}


@dataclass(frozen=True, kw_only=True)
class DockerRunShape:
    """The A1 launcher's `docker run` flags as structured values for pulumi_docker.Container."""

    shm_size_mb: int = 32 * 1024
    stop_timeout_s: int = 60
    capabilities: tuple[str, ...] = ("IPC_LOCK", "SYS_PTRACE")
    stack_bytes: int = 67_108_864


DOCKER_RUN = DockerRunShape()
