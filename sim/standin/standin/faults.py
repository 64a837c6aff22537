"""The vLLM stand-in's environment knobs and the faults they inject: `SimEnv` (SIM_FAULT, SIM_LOAD_SECONDS and the other
SIM_* and VLLM_* variables, validated), the runtime faults a serving rank reads from SIM_FAULT_FILE on every model
step, and the `oom` fault's allocation under a low container memory limit. Stdlib only, as the whole stand-in
(sim/standin/README.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .log import LOG

FAULTS = ("nan-logits", "worker-exit-after-load", "rank-never-joins", "stall-after-load", "wrong-answer")
# Faults a serving head takes on at run time, from SIM_FAULT_FILE: a verified deployment that breaks later.
# `hang`: every model step blocks (completions never return, /health and /metrics still answer). `oom`: the rank
# that reads it (the head, or a worker, each from its own container's file) allocates at its next model step until
# the kernel's OOM killer ends it (SIGKILL, docker's State.OOMKilled); see exhaust_memory.
RUNTIME_FAULTS = ("nan-logits", "wrong-answer", "hang", "oom")
# `oom` acts only under a container memory limit this low: without one the stand-in would take the whole machine.
OOM_MAX_LIMIT_BYTES = 4 << 30
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
DEFAULT_FAULT_FILE = "/tmp/sim-fault"


@dataclass(frozen=True)
class SimEnv:
    fault: str | None = None
    load_seconds: float = 5.0
    # A worker reads its weights over NFS from the head (~15 min for 196 GiB on the recipe's pair, against the
    # head's ~250 s from its own disk), in silence; None: as long as the head's load.
    worker_load_seconds: float | None = None
    # SIM_ENGRAM_INDEX=any: Engram shards 47/48 taken out of any index (the stand-in before the slim directory).
    engram_any_index: bool = False
    # vLLM captures CUDA graphs after loading (minutes on GB10); the stand-in spends what it logs.
    graph_seconds: float = 3.0
    decode_tokens_per_second: float = 23.0
    rendezvous_timeout_s: float = 600.0
    execute_model_timeout_s: float = 300.0
    host_ip: str | None = None
    api_key: str | None = field(default=None, repr=False)
    fault_file: str = DEFAULT_FAULT_FILE

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SimEnv:
        def number(name: str, default: float, *, minimum: float, inclusive: bool) -> float:
            raw = environ.get(name, "").strip()
            if not raw:
                return default
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            ok = value >= minimum if inclusive else value > minimum
            if not (math.isfinite(value) and ok):
                bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
                raise ValueError(f"{name}={raw!r} is not a number {bound}; unset it or give e.g. {default:g}")
            return value

        fault = environ.get("SIM_FAULT", "").strip() or None
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"SIM_FAULT={fault!r} is not a known fault; use one of {', '.join(FAULTS)} or unset it")
        return cls(
            fault=fault,
            load_seconds=number("SIM_LOAD_SECONDS", 5.0, minimum=0, inclusive=True),
            worker_load_seconds=(
                number("SIM_WORKER_LOAD_SECONDS", 0.0, minimum=0, inclusive=True)
                if environ.get("SIM_WORKER_LOAD_SECONDS", "").strip()
                else None
            ),
            graph_seconds=number("SIM_GRAPH_SECONDS", 3.0, minimum=0, inclusive=True),
            decode_tokens_per_second=number("SIM_DECODE_TOKENS_PER_SECOND", 23.0, minimum=0, inclusive=False),
            rendezvous_timeout_s=number("SIM_RENDEZVOUS_TIMEOUT_S", 600.0, minimum=0, inclusive=False),
            execute_model_timeout_s=number("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 300.0, minimum=0, inclusive=False),
            engram_any_index=_engram_index(environ.get("SIM_ENGRAM_INDEX", "")),
            host_ip=environ.get("VLLM_HOST_IP") or None,
            api_key=environ.get("VLLM_API_KEY") or None,
            fault_file=environ.get("SIM_FAULT_FILE", "").strip() or DEFAULT_FAULT_FILE,
        )


def _engram_index(raw: str) -> bool:
    value = raw.strip() or "slim"
    if value not in ("slim", "any"):
        raise ValueError(f"SIM_ENGRAM_INDEX={raw!r} is not `slim` (the default) or `any`; unset it or give one")
    return value == "any"


def runtime_fault(path: str) -> str | None:
    """The fault named in the control file (re-read on every model step, like the hub's switch), if any."""
    try:
        name = Path(path).read_text().strip()
    except OSError:
        return None
    return name if name in RUNTIME_FAULTS else None


def memory_limit_bytes(paths: Sequence[str] = _CGROUP_LIMITS) -> int | None:
    """This container's cgroup memory limit (v2 `memory.max`, v1 `memory.limit_in_bytes`); None: unlimited."""
    for path in paths:
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):  # v1 says "unlimited" with a huge number, v2 with `max`
            return int(raw)
        return None
    return None


def exhaust_memory(fault_file: str, who: str, limit: int | None = None) -> None:
    """The `oom` runtime fault: grow (touching every page) until the kernel's OOM killer SIGKILLs the process, as
    it ends a vLLM rank whose allocations outgrow its memory; like real vLLM, nothing is printed before it. One
    shot: the control file is emptied first, so the same container started again serves. Under no container
    limit, or one above OOM_MAX_LIMIT_BYTES, it refuses (a warning) rather than take the machine."""
    limit = memory_limit_bytes() if limit is None else limit
    if limit is None or limit > OOM_MAX_LIMIT_BYTES:
        LOG(who, "vllm_standin.py:oom", f"SIM fault oom ignored: the container's memory limit is {limit}", "WARNING")
        return
    with contextlib.suppress(OSError):
        Path(fault_file).write_text("")
    hoard: list[bytearray] = []
    chunk = 16 << 20
    while len(hoard) * chunk < 4 * limit:
        block = bytearray(chunk)
        block[::4096] = b"\1" * len(range(0, chunk, 4096))  # every page touched: charged to the cgroup
        hoard.append(block)
    LOG(who, "vllm_standin.py:oom", f"SIM fault oom: {len(hoard) * chunk} bytes held and not killed", "ERROR")
