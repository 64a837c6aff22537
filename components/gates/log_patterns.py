"""vLLM's log lines as the gates read them: joins, rendezvous, boot phases, readiness, and the fatal patterns
(one table: pattern, cause, advice) both gates fail on.

vLLM's wording changes between releases and the recipe image runs a patched vLLM, so every pattern is
deliberately tolerant (substring or loose regex, case where it helps)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# Log patterns (vLLM 0.33 wording plus older releases)

# `shm_broadcast.py` prints "No available shared memory broadcast block found in 60 seconds"
# while a rank waits on another: it is not progress (the recipe's launcher ignores it too).
_NOISE = re.compile(r"shm_broadcast\.py|No available shared memory broadcast block")

_RANK_ASSIGNED = re.compile(r"\brank (\d+) in world size (\d+) is assigned as")
_JOINED = (
    _RANK_ASSIGNED,
    re.compile(r"vLLM is using nccl==", re.IGNORECASE),
)
# Printed before init_process_group blocks: the rank reached the rendezvous but may not be in.
_INIT_METHOD = re.compile(r"distributed_init_method=(?:tcp://)?(\S+?)(?:\s|$)")
_REACHED = (
    re.compile(r"world_size=\d+ rank=\d+"),
    _INIT_METHOD,
    re.compile(r"DP group leader"),
    re.compile(r"headless multiproc executor", re.IGNORECASE),
)
_READY = re.compile(r"Application startup complete\.?|Starting vLLM API server")

PHASES: tuple[str, ...] = (
    "rendezvous",
    "loading weights",
    "KV cache",
    "graph capture",
    "warm-up",
    "API starting",
    "ready",
)

# From KV-cache profiling on, the boot is in its last minutes (graph capture, warm-up, API start).
NEAR_READY_PHASES = frozenset({"KV cache", "graph capture", "warm-up", "API starting"})

# Checked latest phase first, so a line that mentions two phases counts for the later one.
_PHASE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ready", re.compile(r"Application startup complete")),
    (
        "API starting",
        re.compile(
            r"Starting vLLM (?:API )?server|Started server process|Waiting for application startup"
            r"|Available routes are"
        ),
    ),
    (
        "warm-up",
        re.compile(
            r"init engine \(profile|\bwarming up\b|\bwarm-?up (?:model|run|took|finished|done)"
            r"|torch\.compile takes|Compiling a graph for|Dynamo bytecode transform",
            re.IGNORECASE,
        ),
    ),
    ("graph capture", re.compile(r"Capturing CUDA graph|Graph capturing finished", re.IGNORECASE)),
    (
        "KV cache",
        re.compile(r"Available KV cache memory|GPU KV cache size|Maximum concurrency for", re.IGNORECASE),
    ),
    (
        "loading weights",
        re.compile(
            r"Starting to load model|Loading weights took|Model loading took"
            r"|Loading safetensors checkpoint shards|Loading model weights",
            re.IGNORECASE,
        ),
    ),
    ("rendezvous", re.compile("|".join(p.pattern for p in (*_REACHED, *_JOINED)), re.IGNORECASE)),
)


def is_noise(text: str) -> bool:
    return bool(_NOISE.search(text))


def is_join_line(text: str) -> bool:
    """The rank is in the distributed group (groups formed, NCCL picked)."""
    return any(p.search(text) for p in _JOINED)


def is_reached_line(text: str) -> bool:
    """The rank reached the rendezvous (it may still be blocked in init_process_group)."""
    return any(p.search(text) for p in _REACHED)


def assigned_rank(text: str) -> tuple[int, int] | None:
    """(global rank, world size) from `rank N in world size W is assigned as ...`."""
    m = _RANK_ASSIGNED.search(text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def init_method_address(text: str) -> str | None:
    """HEAD:PORT from `distributed_init_method=tcp://HEAD:PORT`."""
    m = _INIT_METHOD.search(text)
    return m.group(1).rstrip(",") if m else None


def is_rendezvous_failure(text: str) -> bool:
    fatal = fatal_of(text)
    return fatal is not None and fatal.name == "rendezvous"


def is_ready_line(text: str) -> bool:
    return bool(_READY.search(text))


# Every phase pattern's every alternative holds one of these (lower case): a line with none of them names no
# phase, found with a few substring tests instead of the case-insensitive searches (a flood stays cheap).
_PHASE_WORDS = (
    "startup",
    "server",
    "routes are",
    "init engine",
    "warm",
    "torch.compile",
    "dynamo",
    "graph",
    "kv cache",
    "concurrency",
    "load",
    "world_size=",
    "distributed_init_method=",
    "dp group leader",
    "headless multiproc",
    "in world size",
    "nccl",
)


def phase_of(text: str) -> str | None:
    """The boot phase a log line belongs to, or None for lines that say nothing about it."""
    if is_noise(text):
        return None
    low = text.lower()
    if not any(word in low for word in _PHASE_WORDS):
        return None
    for name, pattern in _PHASE_PATTERNS:
        if pattern.search(text):
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Fatal patterns: what a rank prints as it fails, read by both gates (and by the exit report)


@dataclass(frozen=True)
class FatalPattern:
    """A line a rank prints when it fails (vLLM, torch under it, or the rank's entrypoint), what it means, and what
    the operator does.

    `advice` may name `{nodes}` (the ranks' nodes concerned) and `{where}` (the rendezvous master): the gate
    fills them in. `at_once`: the line alone fails the gate (it is only ever printed as a raised exception);
    otherwise it only names the cause once a rank has exited (NCCL prints errors it recovers from)."""

    name: str
    pattern: re.Pattern[str]
    cause: str
    advice: str
    at_once: bool = True


RENDEZVOUS_ADVICE = (
    "on {nodes} check: the fabric interface (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME must be the CX-7 netdev that "
    "reaches {where}); NCCL_IB_GID_INDEX (must be the RoCE v2 GID holding the node's fabric IPv4); a firewall "
    "blocking {where} on the head; a stale rank container from an earlier deployment still holding the port or "
    "joining in its place (docker ps -a on every node)"
)

# Wording as vLLM raises it (v1/core/kv_cache_utils.py, v1/worker/utils.py, v1/engine/core_client.py) and torch's
# store. Most specific first: a line matches its first entry, and of the fatal lines a failure has seen, the one
# whose entry comes first names the cause.
FATAL_PATTERNS: tuple[FatalPattern, ...] = (
    FatalPattern(
        # Not vLLM's: the rank's entrypoint (components/serving/rank_entry.sh) refuses to exec vLLM below the node's
        # MemAvailable floor. First: the other ranks then fail at the rendezvous, and this is the cause.
        "memory before start",
        re.compile(r"rank not started on node .{1,200}?: (?:MemAvailable|cannot read MemAvailable)"),
        "was not started: its node's MemAvailable was below the preflight's floor, or unreadable (the line says)",
        "free memory on {nodes} or drop its page cache, as the line says (the GB10 driver does not reclaim page "
        "cache), or lower preflight.minMemAvailableGiB; then run `pulumi up` again",
    ),
    FatalPattern(
        # Not vLLM's either: the head's entrypoint found no API key in its file (rank_entry.sh).
        "api key file",
        re.compile(r"rank not started on node .{1,200}?: (?:the API key file|\S+ is empty)"),
        "was not started: the API key file the head reads its key from was missing or empty",
        "run `pulumi up` again: it rewrites the key file on the head ({nodes}) before the rank starts",
    ),
    FatalPattern(
        "rendezvous",
        # torch's store timeout when a rank never joins: "DistStoreError: ... 1/2 clients joined".
        re.compile(r"DistStoreError|\b\d+/\d+ clients joined"),
        "logged a rendezvous failure",
        RENDEZVOUS_ADVICE,
    ),
    FatalPattern(
        "KV cache too small",
        re.compile(
            r"KV cache is needed, which is larger than the available KV cache memory"
            r"|No available memory for the cache blocks"
        ),
        "has too little memory left for the KV cache of one request at serve.maxModelLen",
        "lower serve.maxModelLen (vLLM prints the longest it can hold as 'the estimated maximum model length'), "
        "or raise serve.gpuMemoryUtilization within what the capacity check allows",
    ),
    FatalPattern(
        "memory taken at startup",
        re.compile(r"Free memory on device .{0,80}on startup is less than desired GPU memory utilization"),
        "found less free memory than serve.gpuMemoryUtilization asks for",
        "something else holds the node's unified memory (a leftover rank or another process: docker ps -a, "
        "MemAvailable in /proc/meminfo on {nodes}); free it, or lower serve.gpuMemoryUtilization",
    ),
    FatalPattern(
        "out of memory",
        re.compile(r"torch\.OutOfMemoryError|CUDA out of memory|CUDA error: out of memory"),
        "ran out of GPU memory",
        "lower serve.gpuMemoryUtilization or serve.maxNumBatchedTokens, and check MemAvailable on {nodes}",
    ),
    FatalPattern(
        "Engram tables",
        # The loader's exception naming the Engram table directory: a shard its index names that is not there
        # (`FileNotFoundError: ... '/engram-src/model-00001-of-00048.safetensors'`, the native index), a missing
        # `/engram-src/config.json`, an index listing other tensors than the embed tables, a table absent from its
        # shard. Only ever printed as a raised exception (`<Name>Error: ...`), never by the INFO load lines.
        re.compile(r"\b[A-Z]\w*(?:Error|Exception): .*(?i:engram)"),
        "could not load the Engram tables from /engram-src",
        "every rank mounts the slim Engram directory at /engram-src (<weights.root>/engram-vllm: hardlinks of "
        "shards 47 and 48, config.json, and an index listing only the *.engram.embed.weight / .scale tensors); "
        "see what /engram-src holds on {nodes}, then re-stage (`pulumi up --replace <urn>` of the `weights-stage` "
        "resource: it rebuilds and checks that directory, downloading nothing already staged)",
    ),
    FatalPattern(
        "engine start failed",
        re.compile(r"Engine core initialization failed"),
        "reports that its engine core failed to start",
        "the root cause is printed above it in the same rank's lines (or in another rank's): read them below",
        at_once=False,  # the head's pointer to a cause another line names: that line goes first
    ),
    FatalPattern(
        "NCCL",
        re.compile(r"\bNCCL error\b|\bnccl(?:SystemError|InternalError|RemoteError|UnhandledCudaError)\b"),
        "hit an NCCL error",
        "on {nodes} check the fabric: NCCL_IB_HCA and NCCL_IB_GID_INDEX (the RoCE v2 GID holding the fabric "
        "IPv4), the link state (ibstatus), and that every node runs the same image",
        at_once=False,
    ),
)

# Every fatal pattern holds one of these (lower case): most lines are ruled out by substring tests.
_FATAL_WORDS = (
    "rank not started",
    "diststore",
    "clients joined",
    "kv cache",
    "cache blocks",
    "free memory",
    "out of memory",
    "outofmemory",
    "engine core",
    "nccl",
    "engram",
)


def fatal_of(text: str) -> FatalPattern | None:
    """The fatal pattern a log line shows, or None."""
    low = text.lower()
    if not any(word in low for word in _FATAL_WORDS):
        return None
    return next((f for f in FATAL_PATTERNS if f.pattern.search(text)), None)
