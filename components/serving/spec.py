"""What each rank's container runs: vLLM flags, RoCE/NCCL environment, mounts, labels.

Pure logic: no resources. One spec renders every rank, so the head and the workers
cannot drift apart; everything the ranks must agree on is hashed into the cluster
generation, which every container carries as a label so a change replaces all ranks.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from components import labels, scripts
from components.config import LONG_PREFILL_HEADROOM_TOKENS, Node, Serve, Settings, declarations

MODEL_MOUNT = "/model"
ENGRAM_MOUNT = "/engram-src"
# JIT caches survive restarts: they save the JIT part of a 20-25 minute cold boot.
KEY_FILE = labels.KEY_FILE
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
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # Two EXL3 kernels on different streams deadlock.
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1",
}


# The rest of the A1 launcher's container environment (start.sh `nccl_common` and `serve_env`, with
# .env.example's values where they differ from start.sh's fallbacks), identical on every rank.
# docs/checks.md (the upstream launcher's settings) says why each is here and why the others are not.
LAUNCHER_ENV = {
    # Prefill kernels and workspace: MoE prefill 17 vs 34 ms per layer at a 1536 chunk.
    "EXL3_FUSED_MOE": "1",
    "EXL3_FAT_GROUPED": "1",
    "EXL3_FAT_KERNEL": "0",
    "EXL3_FAT_SORTED": "0",
    "EXL3_FAT_BATCHED": "0",
    "EXL3_MOE_ROW_TILE": "0",
    "DSV41_INDEXER_PREFILL_FACTOR": "1",
    "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "256",
    "DSV41_PREFILL_EMPTY_CACHE_TOKENS": "8192",
    "DSV41_PREFILL_EMPTY_CACHE_MEMAVAIL_GIB": "2.5",
    "DSV41_PREFILL_END_EMPTY_CACHE": "0",
    "DSV41_DROP_PAGE_CACHE": "1",
    "DSV41_SKIP_MIXED_WARMUP": "0",
    # exllamav3 keeps one lock buffer per device: EXL3 GEMMs on two streams deadlock.
    "DSV41_EXL3_SERIAL_STREAMS": "1",
    "DSV41_EXL3_K_MAP": "/opt/dsv41/exl3_k_map.json",
    # Engram row store (file-backed, read from the engram mount).
    "DSV41_SOURCE": ENGRAM_MOUNT,
    "DSV41_ENGRAM_DISABLE": "0",
    "DSV41_IO_THREADS": "32",
    "DSV41_CACHE_WAYS": "4",
    "DSV41_STATS_SECONDS": "60",
    # The image's build-time patches read these at run time.
    "GLM53_SUPPRESS_STOPS_IN_REASONING": "1",
    "GLM53_MIXED_PREFILL_CHUNK": "0",
    "GLM53_INDEXER_WORKSPACE": "stock",
    "GLM53_SPINWAIT_MS": "stock",
    "GLM53_DENSE_FP8": "off",
    # JIT targets and caches (the caches live in the cache volumes below).
    "TORCH_CUDA_ARCH_LIST": "12.1a",
    "FLASHINFER_CUDA_ARCH_LIST": "12.1a",
    "FLASHINFER_DISABLE_VERSION_CHECK": "1",
    "VLLM_CACHE_ROOT": "/root/.cache/vllm",
    "TRITON_CACHE_DIR": "/root/.triton/cache",
    "TILELANG_CACHE_DIR": "/root/.tilelang/cache",
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# vLLM's own engine-ready timeout must outlast the gates, or it ends a boot they would still wait for.
ENGINE_READY_MARGIN_S = 300
# The kernel OOM killer scores by RSS, and the weights are in no RSS: without this it kills sshd or
# dockerd instead of vLLM. docker's --oom-score-adj is not a pulumi-docker input; raising one's own
# score needs no privilege, so the container's entrypoint (rank_entry.sh) sets it before exec'ing vLLM.
OOM_SCORE_ADJ = 1000
ENTRY_SCRIPT = "serving/rank_entry.sh"
KIB_PER_GIB = 1024 * 1024


def long_prefill_token_threshold(s: Settings) -> int:
    """The configured threshold, or the launcher's rule applied to the batch size (1280 with 1536)."""
    if s.serve.long_prefill_token_threshold is not None:
        return s.serve.long_prefill_token_threshold
    return s.serve.max_num_batched_tokens - LONG_PREFILL_HEADROOM_TOKENS


def engine_ready_timeout_s(s: Settings) -> int:
    """VLLM_ENGINE_READY_TIMEOUT_S: longer than the rendezvous and ready gates together (the ready
    gate's clock starts after the rendezvous gate passed, vLLM's after the container started)."""
    return s.gates.rendezvous_timeout_seconds + s.gates.ready_timeout_seconds + ENGINE_READY_MARGIN_S


def container_entrypoint(s: Settings, node: Node, *, key_file: str | None = None) -> list[str]:
    """The container's entrypoint (rank_entry.sh, rendered for `node`): sets oom_score_adj, refuses to start below
    `preflight.minMemAvailableGiB`, exports the API key read from `key_file` (the head, when the endpoint has
    one), then execs `vllm` with the command as argv.

    The floor is the key's alone, on every node: the preflight adds the observability layer's ~0.1 GiB on the head
    (its containers start after the ranks loaded), but a rank's container spec must not depend on that layer, or
    turning it on or off would replace the head alone and break the group (one generation for every rank)."""
    floor_gib = s.preflight.min_mem_available_gib
    script = scripts.render(
        ENTRY_SCRIPT,
        {
            "NODE": node.name,
            "MIN_MEM_KIB": math.ceil(floor_gib * KIB_PER_GIB),
            "MIN_MEM_GIB": f"{floor_gib:g}",
            "FLOOR": f"preflight.minMemAvailableGiB {floor_gib:g}",
            "OOM_SCORE_ADJ": OOM_SCORE_ADJ,
            "KEY_FILE": key_file or "",
        },
    )
    return ["/bin/sh", "-c", script, "vllm"]


# Flags every rank gets that no key drives, each group placed after the key named (the recipe's order).
FIXED_FLAGS_AFTER = {
    "kv_cache_memory_bytes": ["--block-size", "64"],
    "chat_template": [
        "--enable-prefix-caching",
        "--no-enable-flashinfer-autotune",
        "--hf-overrides",
        json.dumps({"engram_table_dir": ENGRAM_MOUNT}),
        "--language-model-only",
        "--override-generation-config",
        json.dumps(VENDOR_SAMPLING),
    ],
}


def _long_prefill_flag(s: Settings, flag: str) -> list[str]:
    return [flag, str(long_prefill_token_threshold(s))]


def _eager_flag(s: Settings, flag: str) -> list[str]:
    # Eager mode has no CUDA graphs, and speculative decoding needs them.
    return [flag] if s.serve.enforce_eager else ["--cudagraph-capture-sizes", *CUDAGRAPH_CAPTURE_SIZES]


def _speculative_flag(s: Settings, flag: str) -> list[str]:
    if s.serve.enforce_eager or s.serve.num_speculative_tokens == 0:
        return []
    return [flag, json.dumps({"method": "dspark", "num_speculative_tokens": s.serve.num_speculative_tokens})]


# The keys whose flag is not `--flag <value>` (or a switch that is there when true).
CUSTOM_FLAG_RENDERERS: dict[str, Callable[[Settings, str], list[str]]] = {
    "long_prefill_token_threshold": _long_prefill_flag,
    "enforce_eager": _eager_flag,
    "num_speculative_tokens": _speculative_flag,
}
# The `serve` keys that render a shared flag, in declaration order (which is argv order).
SERVE_FLAG_KEYS = [d for d in declarations(Serve, "serve.") if d.flag]


def _plain_flag(flag: str, value: object) -> list[str]:
    """`--flag value`; a switch when the value is a bool; nothing for an empty or unset value."""
    if isinstance(value, bool):
        return [flag] if value else []
    if value is None or value == "":
        return []
    return [flag, str(value)]


def model_flags(s: Settings) -> list[str]:
    """The `vllm serve` flags every rank shares, each rendered from the key declared with it."""
    flags: list[str] = []
    for d in SERVE_FLAG_KEYS:
        assert d.flag is not None
        render = CUSTOM_FLAG_RENDERERS.get(d.name)
        flags += render(s, d.flag) if render else _plain_flag(d.flag, getattr(s.serve, d.name))
        flags += FIXED_FLAGS_AFTER.get(d.name, [])
    return flags + list(s.serve.extra_args)


def _env_value(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def rank_command(s: Settings, rank: int) -> list[str]:
    """`vllm serve` argv (after the entrypoint) for one rank: mp multi-node, no Ray."""
    cmd = ["serve", MODEL_MOUNT, *model_flags(s)]
    cmd += [
        "--distributed-executor-backend",
        "mp",
        "--tensor-parallel-size",
        str(s.tensor_parallel_size),
        "--nnodes",
        str(len(s.nodes)),
        "--node-rank",
        str(rank),
        "--master-addr",
        s.head.fabric_ip,
        "--master-port",
        str(s.serve.master_port),
    ]
    if rank > 0:
        cmd.append("--headless")
    return cmd


def node_env(s: Settings, node: Node, gid_index: int | None) -> dict[str, str]:
    """The container environment of one node. A variable with no value is left out, never set empty:
    `NCCL_IB_GID_INDEX=` parses as 0 (the link-local GID) and hangs NCCL."""
    env = common_env(s)
    per_node = {
        "VLLM_HOST_IP": node.fabric_ip,
        "NCCL_SOCKET_IFNAME": node.fabric_interface,
        "GLOO_SOCKET_IFNAME": node.fabric_interface,
        "NCCL_IB_HCA": ",".join(node.ib_hcas),
        "NCCL_IB_GID_INDEX": "" if gid_index is None else str(gid_index),
    }
    env.update(s.serve.extra_env)
    # Last, so nothing overrides what was resolved for this node (components/config refuses the names too).
    env.update({k: v for k, v in per_node.items() if v})
    return {k: v for k, v in env.items() if v != ""}


def common_env(s: Settings) -> dict[str, str]:
    """The environment every rank shares, before `serve.extraEnv`."""
    env = {**NCCL_COMMON_ENV, **LAUNCHER_ENV}
    # Each `serve` key declared with a variable; a secret's variable is set by the layer that holds it.
    env.update({d.env[0]: _env_value(getattr(s.serve, d.name)) for d in SERVE_ENV_KEYS})
    env.update({"NNODES": str(len(s.nodes)), "VLLM_ENGINE_READY_TIMEOUT_S": str(engine_ready_timeout_s(s))})
    return env


SERVE_ENV_KEYS = [d for d in declarations(Serve, "serve.") if d.env and not d.secret]


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
        "commonEnv": sorted(common_env(s).items()),
        "weights": [s.weights.root, s.weights.model_repo, s.weights.engram_repo, s.weights.revision],
        # Whether the endpoint has a key (never the key, nor a hash of it: the generation is a label and a metric).
        # A new key replaces every rank through the key file's command (serving.py), not through this.
        "apiKey": not s.open_endpoint,
    }
    # The container's shape (container.*) is left out: a change replaces every rank under the same generation,
    # and the preflight stops the old ranks of another shape first (preflight.sh).
    return hashlib.sha256(json.dumps(agreed, sort_keys=True).encode()).hexdigest()[:16]


def runtime_generation(config_generation: str, per_node: list[object]) -> str:
    """The generation every container carries: the config hash plus what earlier layers resolved
    per node (image id, GID index, weight sources). A change on any one node replaces every rank."""
    return hashlib.sha256(json.dumps([config_generation, per_node], sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]


@dataclass(frozen=True, kw_only=True)
class DockerRunShape:
    """The A1 launcher's `docker run` flags as structured values for pulumi_docker.Container."""

    shm_size_mb: int = 32 * 1024
    stop_timeout_s: int = 60
    capabilities: tuple[str, ...] = ("IPC_LOCK", "SYS_PTRACE")
    stack_bytes: int = 67_108_864


DOCKER_RUN = DockerRunShape()
