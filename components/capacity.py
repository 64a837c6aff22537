"""The recipe's memory arithmetic, as rules a configuration must satisfy.

Pure logic: no resources. Figures are the recipe's measurements on two GB10 Sparks
(../shared/recipe.md, "Why not 1M"); the model is deliberately the recipe's own
linear one so that a refusal can be explained with the recipe's numbers.
"""

from __future__ import annotations

import math

GIB = 1024**3

TOTAL_WEIGHTS_GIB = 199.0  # EXL3 2.9bpw: ~99.5 GiB per rank at TP=2
NODE_USABLE_GIB = 119.0  # 128 GB unified memory less the OS, as MemTotal reports it
LOAD_MARGIN_GIB = 12.0  # the launcher's preflight: weights + 12 GiB <= MemAvailable
KV_GIB_PER_500K_TOKENS = 1.9  # one 500K-token request's KV (MLA latents are not split by TP)
RECIPE_POOL_GIB = 2.5  # kvCacheMemoryBytes default, 2684354560
HEAD_MARGIN_AT_RECIPE_GIB = 2.1  # head's free margin at a 601K prefill with the recipe's pool
MARGIN_COST_PER_POOL_GIB = 2.0  # every extra 0.5 GiB of pool costs ~1 GiB of head margin
MIN_HEAD_MARGIN_GIB = 2.0  # 2.1 GiB served 562,940 tokens; 1.1 GiB (a 3 GiB pool) died at ~470K
RECIPE_MAX_LEN_TWO_NODES = 600_000  # the recipe's ceiling on two nodes
MODEL_MAX_LEN = 1_048_576  # 1M via YaRN
# What the observability layer adds beside the head's rank, by the containers' memory bounds (no swap): Prometheus'
# own bound is `observability.memoryMiB`. Measured on the sim (bench/observability.py, cgroup usage at the end of
# a 10-minute scrape run): exporter 14.5 MiB, node exporter 9.6 MiB (still growing), Prometheus 29 MiB.
EXPORTER_MEMORY_MIB = 24
NODE_EXPORTER_MEMORY_MIB = 16


def weights_per_rank_gib(tensor_parallel_size: int) -> float:
    return TOTAL_WEIGHTS_GIB / tensor_parallel_size


def kv_needed_gib(max_model_len: int) -> float:
    """KV pool one request of `max_model_len` tokens needs on each rank."""
    return KV_GIB_PER_500K_TOKENS * max_model_len / 500_000


def head_margin_gib(pool_gib: float, tensor_parallel_size: int, head_extra_mib: int = 0) -> float:
    """Head's prefill margin: the recipe's 2.1 GiB, less what a bigger pool costs, plus weights a wider TP frees,
    less what other containers on the head may hold (their memory bounds, MiB)."""
    freed = weights_per_rank_gib(2) - weights_per_rank_gib(tensor_parallel_size)
    extra = head_extra_mib / 1024
    return HEAD_MARGIN_AT_RECIPE_GIB - MARGIN_COST_PER_POOL_GIB * (pool_gib - RECIPE_POOL_GIB) + freed - extra


def observability_head_mib(prometheus_mib: int, node_exporter: bool) -> int:
    """The observability layer's memory bounds on the head: Prometheus, the exporter and the node exporter."""
    return prometheus_mib + EXPORTER_MEMORY_MIB + (NODE_EXPORTER_MEMORY_MIB if node_exporter else 0)


def problems(
    *,
    tensor_parallel_size: int,
    max_model_len: int,
    kv_cache_memory_bytes: int,
    prometheus_mib: int | None = None,
    node_exporter: bool = False,
) -> list[str]:
    """Every rule the configuration breaks, each with the recipe's reason and the fix. `prometheus_mib`: the
    observability layer's Prometheus bound when the layer is deployed (None: it is not); its containers on the
    head are paid from the same prefill margin as the KV pool."""
    tp = tensor_parallel_size
    pool = kv_cache_memory_bytes / GIB
    out: list[str] = []
    if tp not in (2, 4, 8):
        if weights_per_rank_gib(tp) + LOAD_MARGIN_GIB > NODE_USABLE_GIB:
            out.append(
                f"`nodes` has {tp} entry(ies): {weights_per_rank_gib(tp):.1f} GiB of weights per rank plus "
                f"{LOAD_MARGIN_GIB:.0f} GiB margin cannot fit in a Spark's ~{NODE_USABLE_GIB:.0f} GiB; "
                "use 2 nodes (up to 600K context) or 4 (1M)"
            )
        else:
            out.append(
                f"`nodes` has {tp} entries: tensor parallelism must be 2, 4 or 8 (one rank per Spark); "
                "use 2 nodes (up to 600K context) or 4 (1M)"
            )
        return out
    if max_model_len > MODEL_MAX_LEN:
        out.append(
            f"`serve.maxModelLen` = {max_model_len}: the model supports at most {MODEL_MAX_LEN} tokens (1M via YaRN)"
        )
    if tp == 2 and max_model_len > RECIPE_MAX_LEN_TWO_NODES:
        out.append(
            f"`serve.maxModelLen` = {max_model_len} on 2 nodes: the recipe's ceiling is "
            f"{RECIPE_MAX_LEN_TWO_NODES}. One 500K request needs ~{KV_GIB_PER_500K_TOKENS} GiB of KV, so "
            f"{max_model_len} needs a {kv_needed_gib(max_model_len):.1f} GiB pool, and every 0.5 GiB of pool "
            "costs ~1 GiB of the head's 2.1 GiB prefill margin. 1M needs TP=4: add two Sparks to `nodes`, "
            f"or set maxModelLen <= {RECIPE_MAX_LEN_TWO_NODES}"
        )
    needed = kv_needed_gib(max_model_len)
    if pool < needed:
        out.append(
            f"`serve.kvCacheMemoryBytes` = {kv_cache_memory_bytes} ({pool:.2f} GiB) cannot hold one "
            f"{max_model_len}-token request (~{needed:.2f} GiB): raise it to at least "
            f"{int(needed * GIB) + 1} or lower `serve.maxModelLen`"
        )
    extra = 0 if prometheus_mib is None else observability_head_mib(prometheus_mib, node_exporter)
    margin = head_margin_gib(pool, tp)
    if prometheus_mib is not None and margin >= MIN_HEAD_MARGIN_GIB > head_margin_gib(pool, tp, extra):
        over = math.ceil((MIN_HEAD_MARGIN_GIB - head_margin_gib(pool, tp, extra)) * 1024)
        parts = f"Prometheus {prometheus_mib} + exporter {EXPORTER_MEMORY_MIB}"
        parts += f" + node exporter {NODE_EXPORTER_MEMORY_MIB}" if node_exporter else ""
        out.append(
            f"`observability.memoryMiB` = {prometheus_mib}: the observability layer's memory bounds on the head "
            f"({parts} = {extra} MiB) leave ~{head_margin_gib(pool, tp, extra):.2f} GiB of the head's prefill "
            f"margin on {tp} nodes (needs {MIN_HEAD_MARGIN_GIB} GiB): lower `observability.memoryMiB` to at most "
            f"{prometheus_mib - over}, or set `observability.enabled: false`, or lower `serve.kvCacheMemoryBytes`"
        )
    if margin < MIN_HEAD_MARGIN_GIB:
        max_pool = RECIPE_POOL_GIB + (head_margin_gib(RECIPE_POOL_GIB, tp, extra) - MIN_HEAD_MARGIN_GIB) / (
            MARGIN_COST_PER_POOL_GIB
        )
        out.append(
            f"`serve.kvCacheMemoryBytes` = {kv_cache_memory_bytes} ({pool:.2f} GiB) leaves the head "
            f"~{margin:.1f} GiB of prefill margin on {tp} nodes (needs {MIN_HEAD_MARGIN_GIB} GiB; the recipe's "
            f"3 GiB pool booted, then died at ~470K of a 600K prompt): keep it at most "
            f"{int(max_pool * GIB)} ({max_pool:.2f} GiB) or add nodes"
        )
    return out
