#!/usr/bin/env python3
"""Stand-in for the recipe image's `vllm serve` (vLLM 0.33) in the simulated cluster.

Stdlib only: the image carries Debian's python3 and nothing else. It behaves like vLLM at every
point the program touches: the CLI and its argparse errors, the log lines the gates read, a real
TCP rendezvous between the ranks, the checkpoint files read from the mounts, and the OpenAI API
the verifier judges. The "model" is tiny and deterministic: its numbers come from the weight
files' bytes, and for every token the head adds partial logits that each worker computes over
the rendezvous connection, so a dead worker hangs completions exactly as a lost rank does.

Environment knobs (see README.md): SIM_FAULT, SIM_FAULT_FILE, SIM_LOAD_SECONDS, SIM_WORKER_LOAD_SECONDS,
SIM_ENGRAM_INDEX, SIM_GRAPH_SECONDS, SIM_DECODE_TOKENS_PER_SECOND, SIM_RENDEZVOUS_TIMEOUT_S, and vLLM's own
VLLM_API_KEY, VLLM_HOST_IP, VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import math
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO, Literal, NoReturn

VLLM_VERSION = "0.33.0"
NCCL_VERSION = "2.27.3"
PROG = "vllm serve"
SERVE_USAGE = "usage: vllm serve [model_tag] [options]"
TOP_USAGE = "usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ..."
EXIT_USAGE = 2
EXIT_FAILURE = 1
# Real vLLM 0.32 (tests/support/fixtures/real-vllm/stopped-*): the head and a headless worker stopped by SIGTERM
# shut down and exit 0; a worker loading weights does not return to Python to run the handler, so a stop then
# ends in docker's SIGKILL (137).
EXIT_STOPPED = 0
CLAMPED_LOGPROB = -9999.0  # vLLM's max(x, -9999.0) at every output site
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
# vLLM's serving_chat.py refusal of a request with `tools` (tool_choice "auto" is the default then).
AUTO_TOOL_CHOICE_MESSAGE = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
NAN_MESSAGE = "Out of range float values are not JSON compliant"
BANNER = (
    "",
    "       █     █     █▄   ▄█",
    " ▄▄ ▄█ █     █     █ ▀▄▀ █  version {version}",
    "  █▄█▀ █     █     █     █  model   {model}",
    "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀",
    "",
)
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."

# ---------------------------------------------------------------------------------------------
# CLI: a table of the flags vLLM knows, with their arity, parsed the way argparse does.

Arity = Literal["one", "list", "none"]
Kind = Literal["str", "int", "float", "size", "json", "json-list"]


@dataclass(frozen=True)
class FlagSpec:
    arity: Arity
    kind: Kind = "str"
    choices: tuple[str, ...] = ()


def _one(kind: Kind = "str", *choices: str) -> FlagSpec:
    return FlagSpec("one", kind, choices)


_SWITCH = FlagSpec("none")
_BOOLEAN_OPTIONAL = (  # vLLM renders these with argparse.BooleanOptionalAction: --x and --no-x
    "enable-prefix-caching",
    "enable-chunked-prefill",
    "enable-flashinfer-autotune",
    "async-scheduling",
    "enable-log-requests",
    "trust-remote-code",
    "enforce-eager",
    "language-model-only",
)

FLAGS: dict[str, FlagSpec] = {
    "--model": _one(),
    "--host": _one(),
    "--port": _one("int"),
    "--uds": _one(),
    "--api-key": _one(),
    "--served-model-name": FlagSpec("list"),
    "--root-path": _one(),
    "--allowed-origins": _one("json-list"),
    "--ssl-keyfile": _one(),
    "--ssl-certfile": _one(),
    "--response-role": _one(),
    "--api-server-count": _one("int"),
    "--uvicorn-log-level": _one("str", "critical", "error", "warning", "info", "debug", "trace"),
    "--disable-log-stats": _SWITCH,
    "--disable-log-requests": _SWITCH,
    "--disable-uvicorn-access-log": _SWITCH,
    "--enable-per-request-metrics": _SWITCH,
    "--tokenizer": _one(),
    "--tokenizer-mode": _one(),
    "--revision": _one(),
    "--download-dir": _one(),
    "--load-format": _one(),
    "--safetensors-load-strategy": _one(),
    "--quantization": _one(),
    "--dtype": _one("str", "auto", "half", "float16", "bfloat16", "float", "float32"),
    "--kv-cache-dtype": _one(),
    "--kv-cache-memory-bytes": _one("size"),
    "--gpu-memory-utilization": _one("float"),
    "--swap-space": _one("float"),
    "--cpu-offload-gb": _one("float"),
    "--block-size": _one("int"),
    "--max-model-len": _one("size"),
    "--max-num-seqs": _one("int"),
    "--max-num-batched-tokens": _one("size"),
    "--long-prefill-token-threshold": _one("int"),
    "--max-num-partial-prefills": _one("int"),
    "--max-logprobs": _one("int"),
    "--logprobs-mode": _one("str", "raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
    "--seed": _one("int"),
    "--scheduling-policy": _one("str", "fcfs", "priority"),
    "--chat-template": _one(),
    "--tool-call-parser": _one(),
    "--reasoning-parser": _one(),
    "--enable-auto-tool-choice": _SWITCH,
    "--generation-config": _one(),
    "--hf-overrides": _one("json"),
    "--override-generation-config": _one("json"),
    "--speculative-config": _one("json"),
    "--compilation-config": _one("json"),
    "--kv-transfer-config": _one("json"),
    "--limit-mm-per-prompt": _one("json"),
    "--cudagraph-capture-sizes": FlagSpec("list", "int"),
    "--max-seq-len-to-capture": _one("int"),
    "--disable-custom-all-reduce": _SWITCH,
    "--enable-sleep-mode": _SWITCH,
    "--distributed-executor-backend": _one("str", "ray", "mp", "uni", "external_launcher"),
    "--tensor-parallel-size": _one("int"),
    "--pipeline-parallel-size": _one("int"),
    "--data-parallel-size": _one("int"),
    "--data-parallel-size-local": _one("int"),
    "--data-parallel-start-rank": _one("int"),
    "--data-parallel-address": _one(),
    "--data-parallel-rpc-port": _one("int"),
    "--enable-expert-parallel": _SWITCH,
    "--nnodes": _one("int"),
    "--node-rank": _one("int"),
    "--master-addr": _one(),
    "--master-port": _one("int"),
    "--headless": _SWITCH,
    **{f"--{name}": _SWITCH for name in _BOOLEAN_OPTIONAL},
    **{f"--no-{name}": _SWITCH for name in _BOOLEAN_OPTIONAL},
}
ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "-q": "--quantization",
    "-O": "--compilation-config",
}
# Flags whose value must be a JSON object (vLLM parses them into config dataclasses or dicts).
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgGtT]?)$")


class UsageError(Exception):
    """argparse's verdict: printed as `vllm serve: error: ...` after the usage line, exit 2."""


def _looks_like_flag(token: str) -> bool:
    return token.startswith("-") and token != "-" and not _NEGATIVE_NUMBER.match(token)


def _canonical(name: str) -> str:
    if name in ALIASES:
        return ALIASES[name]
    # vLLM's FlexibleArgumentParser accepts --max_model_len for --max-model-len.
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _human_int(raw: str) -> int:
    """vLLM's human_readable_int: 600k = 600,000; 1K = 1,024 (lowercase decimal, uppercase binary)."""
    m = _HUMAN_INT.match(raw)
    if not m:
        raise ValueError(raw)
    number, suffix = m.group(1), m.group(2)
    if not suffix:
        return int(number)
    power = "kmgt".index(suffix.lower()) + 1
    base = 1000 if suffix.islower() else 1024
    return int(float(number) * base**power)


def _convert(flag: str, spec: FlagSpec, raw: str) -> Any:
    if spec.choices and raw not in spec.choices:
        allowed = ", ".join(repr(c) for c in spec.choices)
        raise UsageError(f"argument {flag}: invalid choice: {raw!r} (choose from {allowed})")
    try:
        if spec.kind == "int":
            return int(raw)
        if spec.kind == "float":
            return float(raw)
        if spec.kind == "size":
            return _human_int(raw)
        if spec.kind in ("json", "json-list"):
            value = json.loads(raw)
            wanted = dict if spec.kind == "json" else list
            if not isinstance(value, wanted):
                raise ValueError(raw)
            return value
    except ValueError:
        names = {
            "int": "int",
            "float": "float",
            "size": "human_readable_int",
            "json": "loads",
            "json-list": "loads",
        }
        raise UsageError(f"argument {flag}: invalid {names[spec.kind]} value: {raw!r}") from None
    return raw


@dataclass(frozen=True)
class ServeArgs:
    """The parsed `vllm serve` command line (only what the stand-in acts on, plus everything given)."""

    model: str
    given: Mapping[str, Any]

    def get(self, flag: str, default: Any = None) -> Any:
        return self.given.get(flag, default)

    def switch(self, name: str) -> bool:
        """A BooleanOptionalAction flag: the last of --name / --no-name wins (argparse order)."""
        return bool(self.given.get(f"--{name}")) and not self.given.get(f"--no-{name}")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return tuple(self.get("--served-model-name") or [self.model])

    @property
    def nnodes(self) -> int:
        return int(self.get("--nnodes", 1))

    @property
    def node_rank(self) -> int:
        return int(self.get("--node-rank", 0))

    @property
    def world_size(self) -> int:
        return int(self.get("--tensor-parallel-size", 1)) * int(self.get("--pipeline-parallel-size", 1))

    @property
    def master_addr(self) -> str:
        return str(self.get("--master-addr", "127.0.0.1"))

    @property
    def master_port(self) -> int:
        return int(self.get("--master-port", 29501))

    @property
    def is_worker(self) -> bool:
        return self.node_rank > 0 or bool(self.get("--headless"))

    @property
    def enforce_eager(self) -> bool:
        return self.switch("enforce-eager")

    @property
    def engram_dir(self) -> str | None:
        value = (self.get("--hf-overrides") or {}).get("engram_table_dir")
        return str(value) if value else None


def parse_serve_args(argv: Sequence[str]) -> ServeArgs:
    """Parse what follows `vllm serve`; raise UsageError with argparse's wording."""
    given: dict[str, Any] = {}
    positionals: list[str] = []
    unrecognized: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            positionals.extend(argv[i:])
            break
        if not _looks_like_flag(token):
            if positionals:
                unrecognized.append(token)
            positionals.append(token)
            continue
        name, has_inline, inline = token.partition("=")
        flag = _canonical(name)
        spec = FLAGS.get(flag)
        if spec is None:
            unrecognized.append(token)
            continue
        if spec.arity == "none":
            if has_inline:
                raise UsageError(f"argument {flag}: ignored explicit argument {inline!r}")
            given[flag] = True
            opposite = flag.replace("--no-", "--", 1) if flag.startswith("--no-") else "--no-" + flag[2:]
            given.pop(opposite, None)
        elif spec.arity == "one":
            if has_inline:
                raw = inline
            elif i < len(argv) and not _looks_like_flag(argv[i]):
                raw = argv[i]
                i += 1
            else:
                raise UsageError(f"argument {flag}: expected one argument")
            given[flag] = _convert(flag, spec, raw)
        else:
            items = [inline] if has_inline else []
            while i < len(argv) and not _looks_like_flag(argv[i]):
                items.append(argv[i])
                i += 1
            if not items:
                raise UsageError(f"argument {flag}: expected at least one argument")
            given[flag] = [_convert(flag, spec, item) for item in items]
    if unrecognized:
        raise UsageError(f"unrecognized arguments: {' '.join(unrecognized)}")
    model = positionals[0] if positionals else str(given.get("--model", "Qwen/Qwen3-0.6B"))
    return ServeArgs(model=model, given=given)


def args_line(args: ServeArgs) -> str:
    """vLLM's `non-default args: {...}`; the API key is masked (a secret never reaches the log)."""
    shown: dict[str, Any] = {"model_tag": args.model}
    for flag, value in args.given.items():
        shown[flag[2:].replace("-", "_")] = "***" if flag == "--api-key" else value
    return f"non-default args: {shown!r}"


# ---------------------------------------------------------------------------------------------
# Environment knobs


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


# ---------------------------------------------------------------------------------------------
# Logging: vLLM's format, one flushed line at a time (docker logs reads them as they come).


class Log:
    def __init__(self, out: BinaryIO | None = None, err: BinaryIO | None = None) -> None:
        self._out = out or sys.stdout.buffer
        self._err = err or sys.stderr.buffer
        self._lock = threading.Lock()

    def raw(self, text: str, *, to_stderr: bool = False) -> None:
        stream = self._err if to_stderr else self._out
        with self._lock:
            stream.write((text + "\n").encode("utf-8", "replace"))
            stream.flush()

    def __call__(self, who: str | None, src: str, msg: str, level: str = "INFO") -> None:
        prefix = f"({who} pid={os.getpid()}) " if who else ""
        self.raw(f"{prefix}{level} {datetime.now():%m-%d %H:%M:%S} [{src}] {msg}")

    def traceback(self, frames: Sequence[str], final: str) -> None:
        """A Python traceback on stderr, as an uncaught exception leaves it."""
        lines = ["Traceback (most recent call last):", *frames, final]
        for line in lines:
            self.raw(line, to_stderr=True)


LOG = Log()


def worker_name(rank: int) -> str:
    return f"Worker_TP{rank}"


def die(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def sleep_forever() -> NoReturn:
    while True:
        time.sleep(3600)


# ---------------------------------------------------------------------------------------------
# Checkpoint: every file the index names is read; its bytes become the model's parameters.

_SHARD_NUMBER = re.compile(r"model-0*(\d+)-of-0*(\d+)\.safetensors$")
ENGRAM_SHARDS = (47, 48)
INDEX_NAME = "model.safetensors.index.json"
ENGRAM_EMBED_SUFFIXES = (".engram.embed.weight", ".engram.embed.scale")


class LoadFailure(Exception):
    """The checkpoint cannot be loaded; the message is vLLM's final traceback line."""


def _weight_map(index: Path) -> dict[str, str]:
    with open(index, "rb") as f:  # open(), not exists(): a missing index raises vLLM's FileNotFoundError
        raw = f.read()
    try:
        weight_map = json.loads(raw)["weight_map"]
    except (ValueError, KeyError, TypeError):
        raise LoadFailure(f"ValueError: {index} is not a safetensors index (no weight_map object)") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise LoadFailure(f"ValueError: {index} has a malformed weight_map")
    return {str(k): str(v) for k, v in weight_map.items()}


def model_files(model_dir: Path) -> list[Path]:
    """config.json, then the shards the index names (or every *.safetensors without an index)."""
    config = model_dir / "config.json"
    with open(config, "rb") as f:
        try:
            json.loads(f.read())
        except ValueError as err:
            raise LoadFailure(f"json.decoder.JSONDecodeError: {config}: {err}") from None
    index = model_dir / INDEX_NAME
    if index.exists():
        return [model_dir / name for name in sorted(set(_weight_map(index).values()))]
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise LoadFailure(f"RuntimeError: Cannot find any model weights with `{model_dir}`")
    return shards


def _safetensors_names(path: Path) -> set[str]:
    """The tensor names in a shard's header (u64 little-endian length, JSON), as safe_open reads them."""
    with open(path, "rb") as f:  # open(): a missing shard raises vLLM's FileNotFoundError
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        try:
            if not 2 <= length <= 100 << 20:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except ValueError as err:
            raise LoadFailure(
                f"safetensors_rust.SafetensorError: Error while deserializing header of {path}: {err}"
            ) from None
    return {str(k) for k in header if k != "__metadata__"}


def engram_files(engram_dir: Path, any_index: bool = False) -> list[Path]:
    """The Engram tables' shards (47 and 48 of 48) as the table directory's index names them.

    The index is the loader's authority: every shard it names is opened, and every tensor it lists is loaded as an
    Engram table. The recipe mounts a slim directory (upstream's prepare_engram_src.py): the two shards, config.json
    and an index of the `*.engram.embed.weight` / `.scale` tables only. The base repo's native index (48 shards, 2
    present) fails on the first absent shard, as the default loader pulling the whole tree would; an index listing
    any other tensor is refused; a missing config.json is the FileNotFoundError owners met at boot.
    `any_index` (SIM_ENGRAM_INDEX=any): the stand-in before the slim directory, which took shards 47/48 out of any
    index, for a deployment made by a program from before it (tests/integration/test_program_upgrade.py)."""
    index = engram_dir / INDEX_NAME
    weight_map = _weight_map(index)
    if any_index:
        named = sorted(set(weight_map.values()))
        return [engram_dir / n for n in named if (m := _SHARD_NUMBER.search(n)) and int(m.group(1)) in ENGRAM_SHARDS]
    config = engram_dir / "config.json"
    with open(config, "rb") as f:  # the Engram loader reads engram_layer_ids / engram_num_embeddings there
        try:
            json.loads(f.read())
        except ValueError as err:
            raise LoadFailure(f"json.decoder.JSONDecodeError: {config}: {err}") from None
    shards = sorted(set(weight_map.values()))
    tensors = {shard: _safetensors_names(engram_dir / shard) for shard in shards}
    other = sorted(name for name in weight_map if not name.endswith(ENGRAM_EMBED_SUFFIXES))
    if other:
        more = f" and {len(other) - 3} more" if len(other) > 3 else ""
        raise LoadFailure(
            f"ValueError: Engram table index {index} lists {len(other)} tensor(s) that are not Engram embed tables "
            f"({', '.join(other[:3])}{more}); engram_table_dir must hold an index of *.engram.embed.weight / "
            "*.engram.embed.scale only"
        )
    absent = sorted(name for name, shard in weight_map.items() if name not in tensors[shard])
    if absent:
        raise LoadFailure(f"KeyError: Engram table {absent[0]!r} is not in {engram_dir / weight_map[absent[0]]}")
    wanted = [n for n in shards if (m := _SHARD_NUMBER.search(n)) and int(m.group(1)) in ENGRAM_SHARDS]
    if len(wanted) != len(ENGRAM_SHARDS) or len(shards) != len(ENGRAM_SHARDS):
        raise LoadFailure(
            f"ValueError: Engram table index {index} names the shards {shards}; the Engram tables are in "
            f"{ENGRAM_SHARDS} of the base model"
        )
    return [engram_dir / name for name in wanted]


def _mmss(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 60:02d}:{s % 60:02d}"


def load_checkpoint(args: ServeArgs, env: SimEnv, who: str) -> bytes:
    """Read every file and spread SIM_LOAD_SECONDS over them; return the digest of all their bytes."""
    start = time.monotonic()
    model_dir = Path(args.model)
    LOG(who, "gpu_model_runner.py:2930", f"Starting to load model {args.model}...")
    shards = model_files(model_dir)
    engram_dir = args.engram_dir
    tables = engram_files(Path(engram_dir), env.engram_any_index) if engram_dir else []
    digest = hashlib.sha256()
    seconds = env.load_seconds
    if args.node_rank > 0 and env.worker_load_seconds is not None:
        seconds = env.worker_load_seconds
    per_file = seconds / (len(shards) + len(tables))
    last_line = -math.inf
    for done, path in enumerate(shards, start=1):
        _absorb(digest, path)
        _pace(start + done * per_file)
        now = time.monotonic()
        # The progress bar is rank 0's alone (weight_utils.py: tqdm disabled unless get_rank() == 0): a worker
        # loads in silence (fixtures/real-vllm/boot/worker.log.jsonl).
        if args.node_rank == 0 and (now - last_line >= 1.0 or done in (1, len(shards))):
            elapsed = now - start
            rate = done / elapsed if elapsed > 0 else 0.0
            left = (len(shards) - done) / rate if rate else 0.0
            LOG.raw(
                f"({who} pid={os.getpid()}) Loading safetensors checkpoint shards: "
                f"{100 * done // len(shards):3d}% Completed | {done}/{len(shards)} "
                f"[{_mmss(elapsed)}<{_mmss(left)}, {rate:6.2f}it/s]"
            )
            last_line = now
    for done, path in enumerate(tables, start=1):
        _absorb(digest, path)
        _pace(start + (len(shards) + done) * per_file)
        LOG(who, "engram.py:214", f"Loaded Engram table shard {path.name} from {engram_dir}")
    took = time.monotonic() - start
    LOG(who, "default_loader.py:267", f"Loading weights took {took:.2f} seconds")
    LOG(who, "gpu_model_runner.py:2990", f"Model loading took 99.52 GiB memory and {took:.6f} seconds")
    return digest.digest()


def _absorb(digest: Any, path: Path) -> None:
    digest.update(path.name.encode() + b"\0")
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)


def _pace(until: float) -> None:
    left = until - time.monotonic()
    if left > 0:
        time.sleep(left)


# ---------------------------------------------------------------------------------------------
# The model: a tiny vocabulary, logits = sum of every rank's partial (from its weights) + structure.

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
_WORDS = (
    " the",
    " a",
    " of",
    " and",
    " to",
    " in",
    " is",
    " that",
    " it",
    " for",
    " with",
    " on",
    " as",
    " by",
    " from",
    " at",
    " or",
    " this",
    " are",
    " be",
    " light",
    " sky",
    " blue",
    " red",
    " sun",
    " air",
    " water",
    " time",
    " day",
    " people",
    " city",
    " river",
    " history",
    " small",
    " large",
    " simple",
    " clear",
    " warm",
    " bright",
    " quiet",
    " slowly",
    " often",
    " because",
    " when",
    " which",
    " also",
    " more",
    " each",
    " new",
    " first",
    " table",
    " key",
    " value",
    " bread",
    " flour",
    " email",
    " review",
    " morning",
    " France",
    " capital",
    " Paris",
    ",",
    ".",
    " The",
    " It",
    " We",
    "\n\n",
)
# Index 0 is what an argmax over NaN picks: the garbage a broken deployment emits.
VOCAB: tuple[str, ...] = ("!", BOS, EOS, "Paris", "Rome", "Tokyo", "Berlin", "Madrid", "Lyon", *_WORDS)
EOS_ID = VOCAB.index(EOS)
SPECIAL_IDS = frozenset({VOCAB.index(BOS), EOS_ID})
_WORD_IDS = tuple(range(VOCAB.index(_WORDS[0]), len(VOCAB)))
ALLOWED_PER_STEP = 12  # every other token is masked to -inf (a grammar-like constraint)
MIN_LENGTH_BEFORE_EOS = 48
ANSWER_BIAS = 16.0
# Known questions with a one-word answer; anything else gets Markov-ish prose.
KNOWN_ANSWERS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"capital of france", re.IGNORECASE), "Paris"),
    (re.compile(r"capital of italy", re.IGNORECASE), "Rome"),
    (re.compile(r"capital of japan", re.IGNORECASE), "Tokyo"),
    (re.compile(r"capital of germany", re.IGNORECASE), "Berlin"),
    (re.compile(r"capital of spain", re.IGNORECASE), "Madrid"),
)
# SIM_FAULT=wrong-answer: the same fluent one-word answer shape, the wrong city, finite logprobs.
# Tokens the engine computes for a tool call (every rank takes part, as for any answer).
TOOL_CALL_TOKENS = 8
WRONG_ANSWERS = {"Paris": "Lyon", "Rome": "Madrid", "Tokyo": "Berlin", "Berlin": "Rome", "Madrid": "Tokyo"}


def partial_logits(weights: bytes, rank: int, key: str, nan: bool) -> list[float]:
    """One rank's share of a step's logits: a pure function of its weights and the context."""
    if nan:
        return [math.nan] * len(VOCAB)
    rng = random.Random(hashlib.sha256(weights + rank.to_bytes(4, "big") + key.encode()).digest())
    return [rng.gauss(0.0, 1.0) for _ in VOCAB]


def log_softmax(logits: Sequence[float]) -> list[float]:
    if any(math.isnan(x) for x in logits):
        return [math.nan] * len(logits)
    finite = [x for x in logits if x != -math.inf]
    top = max(finite)
    lse = top + math.log(sum(math.exp(x - top) for x in finite))
    return [x - lse if x != -math.inf else -math.inf for x in logits]


def structure(weights: bytes, prompt: str, generated: Sequence[int], wrong: bool = False) -> list[float]:
    """The mask and biases of one step: which tokens may follow, and the known answers (`wrong`: the
    wrong one, as fluently)."""
    step = len(generated)
    previous = generated[-1] if generated else -1
    rng = random.Random(hashlib.sha256(weights + b"mask" + previous.to_bytes(4, "big", signed=True)).digest())
    allowed = set(rng.sample(_WORD_IDS, ALLOWED_PER_STEP))
    bias = [0.0] * len(VOCAB)
    answer = next((word for pattern, word in KNOWN_ANSWERS if pattern.search(prompt)), None)
    if answer is not None and wrong:
        answer = WRONG_ANSWERS[answer]
    if answer is not None and step == 0:
        allowed.add(VOCAB.index(answer))
        bias[VOCAB.index(answer)] = ANSWER_BIAS
    elif answer is not None and step == 1 and generated[0] == VOCAB.index(answer):
        allowed.add(EOS_ID)
        bias[EOS_ID] = ANSWER_BIAS
    elif step >= MIN_LENGTH_BEFORE_EOS:
        allowed.add(EOS_ID)
        bias[EOS_ID] = (step - MIN_LENGTH_BEFORE_EOS) * 0.25 - 2.0
    return [bias[i] if i in allowed else -math.inf for i in range(len(VOCAB))]


def choose(logits: Sequence[float], temperature: float, top_p: float, top_k: int, rng: random.Random) -> int:
    if any(math.isnan(x) for x in logits):
        return 0
    if temperature < 1e-5:
        return max(range(len(logits)), key=lambda i: (logits[i], -i))
    scaled = [(x / temperature, i) for i, x in enumerate(logits) if x != -math.inf]
    scaled.sort(reverse=True)
    if top_k > 0:
        scaled = scaled[:top_k]
    top = scaled[0][0]
    weights = [math.exp(x - top) for x, _ in scaled]
    total = sum(weights)
    kept, mass = [], 0.0
    for w, (_, i) in zip(weights, scaled, strict=True):
        kept.append((w, i))
        mass += w / total
        if mass >= top_p:
            break
    pick = rng.random() * sum(w for w, _ in kept)
    for w, i in kept:
        pick -= w
        if pick <= 0:
            return i
    return kept[-1][1]


def clamp(logprob: float) -> float:
    """vLLM's max(x, -9999.0): -inf becomes -9999.0, NaN stays NaN."""
    return CLAMPED_LOGPROB if logprob == -math.inf else logprob


# ---------------------------------------------------------------------------------------------
# Rendezvous and model steps between the ranks: JSON lines over the master-port connection.


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _tcp_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class WorkerLink:
    """The head's end of one worker's connection: step requests out, partial logits back."""

    def __init__(self, node_rank: int, sock: socket.socket, reader: BinaryIO) -> None:
        self.node_rank = node_rank
        self.sock = sock
        host, port = sock.getpeername()[:2]
        self.peer = f"[{host}]:{port}"  # as gloo names a peer
        self.reader = reader
        self.ready = threading.Event()
        self.closed = False  # the worker's end went away (its process died, the connection reset)
        self._cond = threading.Condition()
        self._results: dict[int, list[float]] = {}

    def start(self) -> None:
        threading.Thread(target=self._read, name=f"link-{self.node_rank}", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.reader:
                message = json.loads(line)
                if message.get("op") == "ready":
                    self.ready.set()
                elif message.get("op") == "result":
                    with self._cond:
                        self._results[int(message["id"])] = [float(x) for x in message["partial"]]
                        self._cond.notify_all()
        except (OSError, ValueError):
            pass
        # A worker that went away is noticed by nobody until the next step needs it, as in vLLM: an idle head
        # prints nothing and /health stays 200 (fixtures/real-vllm/killed-worker).
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def request(self, step_id: int, key: str) -> None:
        with contextlib.suppress(OSError):  # same: the missing reply is what the head notices
            _send(self.sock, {"op": "step", "id": step_id, "key": key})

    def result(self, step_id: int, deadline: float) -> list[float] | None:
        with self._cond:
            while step_id not in self._results:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self._cond.wait(min(left, 1.0))
            return self._results.pop(step_id)


def _dist_store_timeout(env: SimEnv, joined: int, nnodes: int) -> NoReturn:
    LOG.traceback(
        [
            '  File "/usr/local/lib/python3.12/dist-packages/vllm/distributed/parallel_state.py", line 1221, '
            "in init_distributed_environment",
            "    torch.distributed.init_process_group(",
            '  File "/usr/local/lib/python3.12/dist-packages/torch/distributed/rendezvous.py", line 189, '
            "in _create_c10d_store",
            "    return TCPStore(",
        ],
        f"torch.distributed.DistStoreError: Timed out after {int(env.rendezvous_timeout_s) + 1} seconds "
        f"waiting for clients. {joined}/{nnodes} clients joined.",
    )
    die(EXIT_FAILURE)


def host_rendezvous(args: ServeArgs, env: SimEnv) -> list[WorkerLink]:
    """Node rank 0: the TCP store on master-addr:master-port; wait for every worker, then say go."""
    listener = socket.socket(_family(args.master_addr), socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((args.master_addr, args.master_port))
        listener.listen(16)
    except OSError as err:
        name = errno.errorcode.get(err.errno or 0, "UNKNOWN")
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/torch/distributed/rendezvous.py", line 189, '
                "in _create_c10d_store",
                "    return TCPStore(",
            ],
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
            f"address. port: {args.master_port}, useIPv6: {int(':' in args.master_addr)}, "
            f"code: -{err.errno}, "
            f"name: {name}, message: {err.strerror} (master address {args.master_addr})",
        )
        die(EXIT_FAILURE)
    deadline = time.monotonic() + env.rendezvous_timeout_s
    links: dict[int, WorkerLink] = {}
    while len(links) < args.nnodes - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            _dist_store_timeout(env, 1 + len(links), args.nnodes)
        listener.settimeout(min(left, 1.0))
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(max(min(deadline - time.monotonic(), 10.0), 0.1))
        reader = conn.makefile("rb")
        try:
            hello = json.loads(reader.readline() or b"{}")
        except (OSError, ValueError):
            conn.close()
            continue
        rank = hello.get("node_rank")
        problem = None
        if hello.get("op") != "hello" or not isinstance(rank, int):
            problem = "not a rank of this deployment"
        elif not 0 < rank < args.nnodes or hello.get("nnodes") != args.nnodes:
            problem = f"node rank {rank} of {hello.get('nnodes')} nodes does not fit nnodes={args.nnodes}"
        elif hello.get("world_size") != args.world_size:
            problem = f"world size {hello.get('world_size')} differs from the head's {args.world_size}"
        elif rank in links:
            problem = f"node rank {rank} already joined"
        if problem:
            LOG(
                "EngineCore_DP0",
                "parallel_state.py:1230",
                f"Rejected a rendezvous client: {problem}",
                "WARNING",
            )
            with contextlib.suppress(OSError):
                _send(conn, {"op": "reject", "reason": problem})
            conn.close()
            continue
        conn.settimeout(None)
        links[rank] = WorkerLink(rank, conn, reader)
    listener.close()  # the group is formed: a late or stale rank gets connection refused
    for link in links.values():
        _send(link.sock, {"op": "go"})
        link.start()
    return [links[r] for r in sorted(links)]


def join_rendezvous(args: ServeArgs, env: SimEnv) -> tuple[socket.socket, BinaryIO]:
    """A worker: connect to the master (retrying while it is not up yet), say our rank, wait for go."""
    deadline = time.monotonic() + env.rendezvous_timeout_s
    master = (args.master_addr, args.master_port)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            LOG.traceback(
                [
                    '  File "/usr/local/lib/python3.12/dist-packages/torch/distributed/rendezvous.py", '
                    "line 189, "
                    "in _create_c10d_store",
                    "    return TCPStore(",
                ],
                f"torch.distributed.DistNetworkError: The client socket has timed out after "
                f"{int(env.rendezvous_timeout_s * 1000)}ms while trying to connect to "
                f"({args.master_addr}, {args.master_port}).",
            )
            die(EXIT_FAILURE)
        sock = socket.socket(_family(args.master_addr), socket.SOCK_STREAM)
        if env.host_ip:
            try:
                sock.bind((env.host_ip, 0))  # NCCL/gloo bind to VLLM_HOST_IP: a wrong one fails here too
            except OSError as err:
                LOG.traceback(
                    [],
                    f"RuntimeError: cannot bind to VLLM_HOST_IP={env.host_ip}: {err.strerror}; "
                    "set VLLM_HOST_IP to an address of this node",
                )
                die(EXIT_FAILURE)
        sock.settimeout(min(left, 5.0))
        try:
            sock.connect(master)
            break
        except OSError:
            sock.close()
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
    sock.settimeout(None)
    _send(
        sock,
        {"op": "hello", "node_rank": args.node_rank, "nnodes": args.nnodes, "world_size": args.world_size},
    )
    reader: BinaryIO = sock.makefile("rb")
    reply = reader.readline()
    try:
        message = json.loads(reply) if reply else {}
    except ValueError:
        message = {}
    if message.get("op") != "go":
        reason = message.get("reason") or "the master closed the connection before the group formed"
        LOG.traceback([], f"torch.distributed.DistStoreError: rendezvous with {_tcp_address(*master)} failed: {reason}")
        die(EXIT_FAILURE)
    return sock, reader


def serve_steps(
    sock: socket.socket,
    reader: BinaryIO,
    weights: bytes,
    ranks: Sequence[int],
    nan: bool,
    who: str,
    fault_file: str = DEFAULT_FAULT_FILE,
) -> NoReturn:
    """A headless worker from now on: compute its share of each model step the head sends."""
    for line in reader:
        message = json.loads(line)
        if message.get("op") == "step":
            if runtime_fault(fault_file) == "oom":
                exhaust_memory(fault_file, who)
            key = str(message["key"])
            total = [0.0] * len(VOCAB)
            for rank in ranks:
                total = [a + b for a, b in zip(total, partial_logits(weights, rank, key, nan), strict=True)]
            _send(sock, {"op": "result", "id": message["id"], "partial": total})
    # Real vLLM (fixtures/real-vllm/killed-head): a worker whose head died stays alive and prints nothing.
    sleep_forever()


# ---------------------------------------------------------------------------------------------
# The engine on the head: one model step at a time, every rank's partial summed.


class EngineDead(Exception):
    pass


@dataclass(frozen=True)
class ChatRequest:
    model: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    # The function a tool call names, when the request's tools and tool_choice ask for one.
    tool: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Token:
    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    finish_reason: str | None

    @property
    def text(self) -> str:
        return "" if self.id in SPECIAL_IDS else VOCAB[self.id]


class Engine:
    def __init__(
        self,
        weights: bytes,
        local_ranks: Sequence[int],
        links: Sequence[WorkerLink],
        env: SimEnv,
        served: Sequence[str],
    ) -> None:
        self.weights = weights
        self.local_ranks = tuple(local_ranks)
        self.links = tuple(links)
        self.env = env
        self.served = tuple(served)
        self.dead = False
        self._lock = threading.Lock()
        self._step_id = 0
        self.stats_lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.running = 0
        self.finished = 0
        # What /metrics reports as num_requests_running: like vLLM's scheduler stats, set after each completed
        # step (and lowered as requests finish), so a step that hangs leaves it where the last step left it.
        self.running_reported = 0

    def fault(self) -> str | None:
        return runtime_fault(self.env.fault_file) or self.env.fault

    def logits(self, prompt: str, generated: Sequence[int]) -> list[float]:
        key = hashlib.sha256(json.dumps([prompt, list(generated)]).encode()).hexdigest()
        fault = self.fault()
        if fault == "oom":
            exhaust_memory(self.env.fault_file, "EngineCore_DP0")
        nan = fault == "nan-logits"
        total = structure(self.weights, prompt, generated, wrong=fault == "wrong-answer")
        with self._lock:  # one model step at a time, like the engine loop
            while self.fault() == "hang":  # a hung step: the engine loop stops, the API server does not
                time.sleep(0.2)
            if self.dead:
                raise EngineDead()
            self._step_id += 1
            step_id = self._step_id
            for link in self.links:
                link.request(step_id, key)
            for rank in self.local_ranks:
                total = [a + b for a, b in zip(total, partial_logits(self.weights, rank, key, nan), strict=True)]
            deadline = time.monotonic() + self.env.execute_model_timeout_s
            for link in self.links:
                part = link.result(step_id, deadline)
                if part is None:
                    if link.closed:
                        self._peer_closed(link.node_rank)
                    else:
                        self._die(link.node_rank)
                    raise EngineDead()
                total = [a + b for a, b in zip(total, part, strict=True)]
            with self.stats_lock:
                self.steps += 1
                self.running_reported = self.running
        return total

    def _peer_closed(self, node_rank: int) -> None:
        """A step over a worker that is gone: the collective fails at once (gloo's "Connection closed by peer"),
        the engine core dies, and the API server shuts down and exits 0, as real vLLM 0.32 did
        (tests/support/fixtures/real-vllm/killed-worker). The texts are the recording's."""
        self.dead = True
        peer = self.links[[link.node_rank for link in self.links].index(node_rank)].peer
        gloo = (
            f"[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            f"{peer}. This is typically caused by a remote worker crashing. Check the logs of the remote worker "
            "before reporting an error. GLHF! \U0001f3d6\ufe0f"
        )
        LOG(worker_name(self.local_ranks[0]), "multiproc_executor.py:1063", "WorkerProc hit an exception.", "ERROR")
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/torch/distributed/distributed_c10d.py", '
                "line 3252, in all_reduce",
                "    work.wait()",
            ],
            f"RuntimeError: {gloo}",
        )
        LOG("EngineCore", "core.py:1512", "EngineCore encountered a fatal error.", "ERROR")
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/executor/multiproc_executor.py", '
                "line 444, in get_response",
                "    raise RuntimeError(",
            ],
            f"RuntimeError: Worker failed with error '{gloo}', please check the stack trace above for the root cause",
        )
        LOG("APIServer", "async_llm.py:906", "AsyncLLM output_handler failed.", "ERROR")
        LOG.traceback([], f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}")

        def shut_down() -> None:
            time.sleep(0.2)  # the failing request gets its 500 first
            pid = os.getpid()
            for text in (
                "Shutting down",
                "Waiting for application shutdown.",
                "Application shutdown complete.",
                f"Finished server process [{pid}]",
            ):
                LOG.raw(f"INFO:     {text}")
            die(0)

        threading.Thread(target=shut_down, daemon=True).start()

    def _die(self, node_rank: int) -> None:
        """vLLM's execute_model RPC timeout (a worker alive but not answering): the engine core dies and the
        API server goes with it."""
        self.dead = True
        who = "EngineCore_DP0"
        LOG(who, "core.py:860", "EngineCore encountered a fatal error.", "ERROR")
        LOG(
            who,
            "multiproc_executor.py:268",
            f"RPC call to sample_tokens timed out after "
            f"{self.env.execute_model_timeout_s:g} s (no reply from node rank {node_rank}).",
            "ERROR",
        )
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/executor/multiproc_executor.py", '
                "line 268, in collective_rpc"
            ],
            "TimeoutError: RPC call to sample_tokens timed out.",
        )
        LOG("APIServer", "async_llm.py:480", "AsyncLLM output_handler failed.", "ERROR")
        LOG.traceback([], f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}")

        def shut_down() -> None:
            time.sleep(0.5)  # let the failing request get its 500 first
            LOG("APIServer", "launcher.py:101", "Shutting down FastAPI HTTP server.")
            die(EXIT_FAILURE)

        threading.Thread(target=shut_down, daemon=True).start()

    def generate(self, req: ChatRequest) -> Iterator[Token]:
        """Tokens at SIM_DECODE_TOKENS_PER_SECOND after a short prefill, each yielded when it is due."""
        rng = random.Random(req.seed if req.seed is not None else uuid.uuid4().int)
        first_due = time.monotonic() + min(0.05 + 0.0005 * req.prompt_tokens, 1.0)
        interval = 1.0 / self.env.decode_tokens_per_second
        generated: list[int] = []
        with self.stats_lock:
            self.running += 1
            self.prompt_tokens += req.prompt_tokens
        try:
            for i in range(req.max_tokens):
                logits = self.logits(req.prompt, generated)
                logprobs = log_softmax(logits)
                chosen = choose(logits, req.temperature, req.top_p, req.top_k, rng)
                order = sorted(
                    (j for j in range(len(VOCAB)) if j != chosen),
                    key=lambda j: (-logprobs[j] if not math.isnan(logprobs[j]) else 0.0, j),
                )
                top = tuple((j, clamp(logprobs[j])) for j in [chosen, *order][: req.top_logprobs])
                finish = "stop" if chosen == EOS_ID else ("length" if i == req.max_tokens - 1 else None)
                _pace(first_due + i * interval)
                with self.stats_lock:
                    self.generation_tokens += 1
                yield Token(chosen, clamp(logprobs[chosen]), top, finish)
                generated.append(chosen)
                if finish:
                    with self.stats_lock:
                        self.finished += 1
                    return
        finally:
            with self.stats_lock:
                self.running -= 1
                self.running_reported = min(self.running_reported, self.running)


# ---------------------------------------------------------------------------------------------
# The OpenAI API (head only).


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": status}}


_WORD = re.compile(r"\w+|[^\w\s]")


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    if content is None:
        return ""
    raise ApiError(400, "messages[].content must be a string or a list of content parts", "BadRequestError", "messages")


def _validation_error(name: str, value: Any, kind: str, msg: str) -> ApiError:
    """FastAPI's request validation answer, as real vLLM 0.32 sent it (fixtures/real-vllm/http/error-bad-field)."""
    detail = {"type": kind, "loc": f"body.{name}", "msg": msg, "input": value}
    return ApiError(400, f"1 validation error:\n  {detail!r}", "Bad Request", f"body.{name}")


def _number(body: Mapping[str, Any], name: str, default: Any, kind: type) -> Any:
    """A numeric field as pydantic's lax mode reads it: numbers, and strings that parse as one."""
    value = body.get(name)
    if value is None:
        return default
    word = "an integer" if kind is int else "a number"
    if isinstance(value, str):
        try:
            return kind(value.strip())
        except ValueError:
            raise _validation_error(
                name,
                value,
                f"{kind.__name__}_parsing",
                f"Input should be a valid {word[3:] if kind is int else word[2:]}, unable to parse string as {word}",
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _validation_error(
            name, value, f"{kind.__name__}_type", f"Input should be a valid {'integer' if kind is int else 'number'}"
        )
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise _validation_error(
            name, value, "int_from_float", "Input should be a valid integer, got a number with a fractional part"
        )
    return kind(value)


def parse_chat(
    body: Any,
    served: Sequence[str],
    max_model_len: int,
    max_logprobs: int,
    defaults: Mapping[str, Any],
    tool_parser: str | None = None,
    auto_tools: bool = False,
) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "BadRequestError")
    model = body.get("model") or served[0]
    if model not in served:
        raise ApiError(
            404, f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.", "NotFoundError", "model"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError(
            400, "messages must be a non-empty list of {role, content} objects", "BadRequestError", "messages"
        )
    texts = [f"{m.get('role', 'user')}: {_message_text(m.get('content'))}" for m in messages]
    prompt = "\n".join(texts)
    prompt_tokens = 1 + sum(3 + len(_WORD.findall(t)) for t in texts)
    max_tokens = _number(body, "max_completion_tokens", None, int)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", max_model_len - prompt_tokens, int)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "BadRequestError", "max_tokens")
    if max_tokens > max_model_len:  # checked first, as in vLLM 0.32 (fixtures/real-vllm/http)
        raise ApiError(
            400,
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. Please request fewer "
            f"output tokens. (parameter=max_tokens, value={max_tokens})",
            "BadRequestError",
            "max_tokens",
        )
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            "BadRequestError",
            "max_tokens",
        )
    logprobs = body.get("logprobs") is True
    top_logprobs = _number(body, "top_logprobs", 0, int)
    if body.get("top_logprobs") is not None and not logprobs:
        raise ApiError(
            400,
            "when using `top_logprobs`, `logprobs` must be set to true.",
            "BadRequestError",
            "top_logprobs",
        )
    if top_logprobs < 0 or top_logprobs > max_logprobs:
        raise ApiError(
            400,
            f"Requested sample logprobs of {top_logprobs}, which is greater than max allowed: {max_logprobs}",
            "BadRequestError",
            "top_logprobs",
        )
    if _number(body, "n", 1, int) != 1:
        raise ApiError(400, "the vLLM stand-in serves n=1 only", "BadRequestError", "n")
    options = body.get("stream_options")
    tool = _tool_to_call(body, messages, tool_parser, auto_tools)
    return ChatRequest(
        model=str(model),
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", float(defaults.get("temperature", 1.0)), float),
        top_p=_number(body, "top_p", float(defaults.get("top_p", 1.0)), float),
        top_k=_number(body, "top_k", int(defaults.get("top_k", 0)), int),
        seed=_number(body, "seed", None, int),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        tool=tool,
    )


def _tool_to_call(
    body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], tool_parser: str | None, auto_tools: bool
) -> Mapping[str, Any] | None:
    """vLLM's tool rules: with `tools`, tool_choice defaults to "auto", which needs both
    --enable-auto-tool-choice and --tool-call-parser (HTTP 400 otherwise). The stand-in calls the
    named (or first) function unless the conversation already carries that tool's result."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(x, dict)
        and x.get("type") == "function"
        and isinstance(x.get("function"), dict)
        and isinstance(x["function"].get("name"), str)
        for x in tools
    ):
        raise ApiError(
            400, "tools must be a list of {type: function, function: {name, ...}}", "BadRequestError", "tools"
        )
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice == "none" or not tools:
        return None
    if choice == "auto" and not (auto_tools and tool_parser):
        raise ApiError(400, AUTO_TOOL_CHOICE_MESSAGE, "BadRequestError")
    functions = [x["function"] for x in tools]
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        named = [f for f in functions if f["name"] == name]
        if not named:
            raise ApiError(400, f"Tool '{name}' has not been passed in `tools`.", "BadRequestError", "tool_choice")
        functions = named
    elif choice not in ("auto", "required"):
        raise ApiError(400, f"Invalid value for `tool_choice`: {choice!r}", "BadRequestError", "tool_choice")
    if messages and messages[-1].get("role") == "tool":
        return None  # the result is back: answer in words
    chosen: Mapping[str, Any] = functions[0]
    return chosen


def tool_arguments(function: Mapping[str, Any], prompt: str) -> str:
    """Arguments that fit the function's JSON schema: strings from the prompt's last capitalised word."""
    words = re.findall(r"\b[A-Z][a-z]+\b", prompt.split(":", 1)[-1])
    raw_params = function.get("parameters")
    params: dict[str, Any] = raw_params if isinstance(raw_params, dict) else {}
    raw_props = params.get("properties")
    props: dict[str, Any] = raw_props if isinstance(raw_props, dict) else {}
    out: dict[str, Any] = {}
    for name, schema in props.items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"]:
            out[name] = schema["enum"][0]
        elif kind == "integer":
            out[name] = 1
        elif kind == "number":
            out[name] = 1.0
        elif kind == "boolean":
            out[name] = True
        else:
            out[name] = words[-1] if words else "Paris"
    return json.dumps(out, ensure_ascii=False)


def _for_engine(req: ChatRequest) -> ChatRequest:
    """A tool call's arguments are short: the engine computes a few tokens for it, not max_tokens."""
    return req if req.tool is None else replace(req, max_tokens=min(req.max_tokens, TOOL_CALL_TOKENS))


def tool_call(function: Mapping[str, Any], prompt: str) -> dict[str, Any]:
    """One entry of `message.tool_calls` in vLLM's shape."""
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": function["name"], "arguments": tool_arguments(function, prompt)},
    }


def _entry(token_id: int, logprob: float) -> dict[str, Any]:
    text = VOCAB[token_id]
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def logprobs_content(tokens: Sequence[Token]) -> list[dict[str, Any]]:
    return [{**_entry(t.id, t.logprob), "top_logprobs": [_entry(i, lp) for i, lp in t.top]} for t in tokens]


def json_safe(value: Any) -> Any:
    """What pydantic's model_dump_json writes in a stream: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


@dataclass
class Api:
    engine: Engine
    args: ServeArgs
    max_model_len: int
    api_key: str | None = field(repr=False)
    started: int = field(default_factory=lambda: int(time.time()))

    def models(self) -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.started,
                "owned_by": "vllm",
                "root": self.args.model,
                "parent": None,
                "max_model_len": self.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": self.started,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.engine.served
        ]
        return {"object": "list", "data": data}

    def metrics(self) -> str:
        """The series the program reads, with vLLM 0.32's names and types (fixtures/real-vllm/metrics)."""
        e = self.engine
        labels = f'engine="0",model_name="{e.served[0]}"'
        with e.stats_lock:
            running, steps = e.running_reported, e.steps
            out = [
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{labels}}} {float(running)}",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{labels}}} 0.0",
                # a sequence's KV blocks held while it runs: a tiny share of a GB10's cache per request
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{labels}}} {min(running * 0.001, 1.0)}",
                "# TYPE vllm:prompt_tokens_total counter",
                f"vllm:prompt_tokens_total{{{labels}}} {float(e.prompt_tokens)}",
                "# TYPE vllm:generation_tokens_total counter",
                f"vllm:generation_tokens_total{{{labels}}} {float(e.generation_tokens)}",
                "# TYPE vllm:request_success_total counter",
                f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(e.finished)}',
                # tokens per engine step: its _count counts the steps
                "# TYPE vllm:iteration_tokens_total histogram",
                f'vllm:iteration_tokens_total_bucket{{{labels},le="+Inf"}} {float(steps)}',
                f"vllm:iteration_tokens_total_count{{{labels}}} {float(steps)}",
                f"vllm:iteration_tokens_total_sum{{{labels}}} {float(e.prompt_tokens + e.generation_tokens)}",
            ]
        return "\n".join(out) + "\n"


def make_handler(api: Api) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def version_string(self) -> str:
            return "uvicorn"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each SSE event at once

        def log_message(self, format: str, *args: Any) -> None:
            pass  # uvicorn's access line is written in _access

        def _access(self, status: int) -> None:
            host, port = self.client_address[:2]
            phrase = self.responses.get(status, ("",))[0]
            LOG.raw(f'INFO:     {host}:{port} - "{self.command} {self.path} {self.request_version}" {status} {phrase}')

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self._access(status)

        def _json(self, status: int, payload: Any) -> None:
            self._send(status, json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode())

        def _route(self) -> str:
            return self.path.split("?", 1)[0]

        def _authorized(self) -> bool:
            if not api.api_key or not self._route().startswith("/v1"):
                return True
            given = self.headers.get("Authorization", "").encode()
            return hmac.compare_digest(given, f"Bearer {api.api_key}".encode())

        def _unauthorized(self) -> None:
            self._json(
                401,
                {
                    "error": {
                        "message": "Unauthorized",
                        "type": "AuthenticationError",
                        "param": None,
                        "code": 401,
                    }
                },
            )

        def do_GET(self) -> None:
            route = self._route()
            if not self._authorized():
                self._unauthorized()
            elif route in ("/health", "/ping"):
                self._send(503 if api.engine.dead else 200, b"")
            elif route == "/version":
                self._json(200, {"version": VLLM_VERSION})
            elif route == "/v1/models":
                self._json(200, api.models())
            elif route == "/metrics":
                self._send(200, api.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif route == "/v1/chat/completions":
                self._json(405, {"detail": "Method Not Allowed"})
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(min(length, 16 << 20))
            if self._route() != "/v1/chat/completions":
                self._json(
                    404 if self._route() not in ("/health", "/v1/models") else 405,
                    {"detail": "Not Found" if self._route() not in ("/health", "/v1/models") else "Method Not Allowed"},
                )
                return
            if not self._authorized():
                self._unauthorized()
                return
            try:
                try:
                    body = json.loads(raw)
                except ValueError as err:
                    raise ApiError(400, f"JSON decode error: {err}", "BadRequestError") from None
                req = parse_chat(
                    body,
                    api.engine.served,
                    api.max_model_len,
                    int(api.args.get("--max-logprobs", 20)),
                    api.args.get("--override-generation-config") or {},
                    api.args.get("--tool-call-parser"),
                    bool(api.args.get("--enable-auto-tool-choice")),
                )
            except ApiError as err:
                self._json(err.status, err.body)
                return
            if req.stream:
                self._stream(req)
            else:
                self._complete(req)

        def _complete(self, req: ChatRequest) -> None:
            try:
                tokens = list(api.engine.generate(_for_engine(req)))
            except EngineDead:
                self._json(500, ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError").body)
                return
            completion = sum(1 for _ in tokens)
            calls = [tool_call(req.tool, req.prompt)] if req.tool is not None else []
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None if calls else "".join(t.text for t in tokens),
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    # vLLM 0.32 sends `tool_calls` only when there are some, and the reasoning as `reasoning`
                    **({"tool_calls": calls} if calls else {}),
                    "reasoning": None,
                },
                "logprobs": {"content": logprobs_content(tokens)} if req.logprobs else None,
                "finish_reason": "tool_calls" if calls else (tokens[-1].finish_reason if tokens else "length"),
                "stop_reason": None,
            }
            payload = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": req.model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": {
                    "prompt_tokens": req.prompt_tokens,
                    "total_tokens": req.prompt_tokens + completion,
                    "completion_tokens": completion,
                    "prompt_tokens_details": None,
                },
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
            try:
                # Starlette's JSONResponse renders with allow_nan=False: a NaN logprob becomes this 400.
                body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            except ValueError:
                self._json(400, ApiError(400, NAN_MESSAGE, "BadRequestError").body)
                return
            self._send(200, body)

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _event(self, payload: Any) -> None:
            self._chunk(
                b"data: " + json.dumps(json_safe(payload), ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
            )

        def _stream(self, req: ChatRequest) -> None:
            if api.engine.dead:  # an engine already known dead answers a stream as plain JSON (as recorded)
                self._json(500, ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError").body)
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream; charset=utf-8")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self._access(200)
            head = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": req.model,
            }
            usage: dict[str, Any] = {"usage": None} if req.include_usage else {}
            completion = 0
            # The role chunk goes out with the first step's output, as in vLLM: a step that fails first leaves
            # the error event alone in the stream (fixtures/real-vllm/killed-worker-streamed).
            pending = [
                {
                    **head,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **usage,
                }
            ]

            def emit(payload: Any) -> None:
                while pending:
                    self._event(pending.pop())
                self._event(payload)

            try:
                try:
                    if req.tool is not None:
                        completion = sum(1 for _ in api.engine.generate(_for_engine(req)))
                        call = tool_call(req.tool, req.prompt)
                        emit(
                            {
                                **head,
                                "choices": [
                                    {
                                        "index": 0,
                                        "delta": {"tool_calls": [{"index": 0, **call}]},
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ],
                                **usage,
                            }
                        )
                        emit(
                            {
                                **head,
                                "choices": [
                                    {
                                        "index": 0,
                                        "delta": {},
                                        "logprobs": None,
                                        "finish_reason": "tool_calls",
                                        "stop_reason": None,
                                    }
                                ],
                                **usage,
                            }
                        )
                    for token in [] if req.tool is not None else api.engine.generate(req):
                        completion += 1
                        emit(
                            {
                                **head,
                                "choices": [
                                    {
                                        "index": 0,
                                        "delta": {"content": token.text},
                                        "logprobs": {"content": logprobs_content([token])} if req.logprobs else None,
                                        "finish_reason": token.finish_reason,
                                        # only on the last chunk, as vLLM 0.32 sends it
                                        **({"stop_reason": None} if token.finish_reason else {}),
                                    }
                                ],
                                **usage,
                            }
                        )
                except EngineDead:  # sent as vLLM does, with json.dumps' default separators
                    self._chunk(
                        b"data: "
                        + json.dumps(ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError").body).encode()
                        + b"\n\n"
                    )
                if req.include_usage:
                    self._event(
                        {
                            **head,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": req.prompt_tokens,
                                "completion_tokens": completion,
                                "total_tokens": req.prompt_tokens + completion,
                            },
                        }
                    )
                self._chunk(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True  # the client went away: vLLM aborts the request

    return Handler


def log_engine_stats(engine: Engine, interval_s: float = 10.0) -> None:
    """vLLM's periodic `Engine 000: Avg prompt throughput ...` line, while there is work."""
    last = (0, 0)
    while True:
        time.sleep(interval_s)
        with engine.stats_lock:
            now = (engine.prompt_tokens, engine.generation_tokens)
            running = engine.running
        if now != last or running:
            LOG(
                "APIServer",
                "loggers.py:123",
                f"Engine 000: Avg prompt throughput: {(now[0] - last[0]) / interval_s:.1f} tokens/s, "
                f"Avg generation throughput: {(now[1] - last[1]) / interval_s:.1f} tokens/s, "
                f"Running: {running} "
                f"reqs, Waiting: 0 reqs, GPU KV cache usage: {min(running * 0.1, 100):.1f}%, "
                "Prefix cache hit rate: 0.0%",
            )
        last = now


# ---------------------------------------------------------------------------------------------
# The serve command


# What SIGTERM does depends on who we are and what we are doing: set by serve().
_ROLE = {"headless": False, "loading": False}


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if signum != signal.SIGTERM:
        die(130)
    if _ROLE["headless"]:
        if _ROLE["loading"]:
            return  # busy in the loader: the stop ends in docker's SIGKILL
        die(EXIT_STOPPED)
    threading.Thread(target=_head_shutdown, daemon=True).start()  # not in the handler: LOG takes a lock


def _head_shutdown() -> None:
    """The head's SIGTERM, as recorded: uvicorn shuts down, the engine client dies with it, exit 0."""
    LOG("APIServer", "launcher.py:254", "[shutdown] API server: shutdown triggered")
    LOG.raw("INFO:     Shutting down")
    LOG("APIServer", "async_llm.py:906", "AsyncLLM output_handler failed.", "ERROR")
    LOG.traceback([], f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}")
    LOG.raw("INFO:     Waiting for application shutdown.")
    LOG.raw("INFO:     Application shutdown complete.")
    die(EXIT_STOPPED)


def _kv_lines(args: ServeArgs, max_model_len: int) -> tuple[str, str]:
    kv_bytes = int(args.get("--kv-cache-memory-bytes", 2_684_354_560))
    tokens = kv_bytes // 2048  # bytes per token of this model's fp8_ds_mla cache
    return (
        f"Available KV cache memory: {kv_bytes / 2**30:.2f} GiB",
        f"GPU KV cache size: {tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per "
        f"request: {tokens / max_model_len:.2f}x",
    )


def _graph_lines(args: ServeArgs, env: SimEnv, who: str) -> None:
    if args.enforce_eager:
        return
    sizes = len(args.get("--cudagraph-capture-sizes") or range(67))
    if args.node_rank == 0:  # the bar is the global first rank's alone (is_global_first_rank)
        LOG.raw(
            f"({who} pid={os.getpid()}) Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|"
            f"██████████| {sizes}/{sizes} [00:02<00:00,  3.90it/s]"
        )
    time.sleep(env.graph_seconds)
    LOG(who, "gpu_model_runner.py:3900", f"Graph capturing finished in {env.graph_seconds:g} secs, took 0.12 GiB")


def _validate(args: ServeArgs) -> str | None:
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        return f"ValueError: --node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})"
    if args.world_size < args.nnodes or args.world_size % args.nnodes:
        return (
            f"ValueError: world size {args.world_size} (tensor x pipeline parallel) must be a multiple of "
            f"--nnodes {args.nnodes}: each node runs the same number of ranks"
        )
    if args.nnodes > 1 and args.get("--distributed-executor-backend", "mp") != "mp":
        return "ValueError: the vLLM stand-in runs multi-node only with --distributed-executor-backend mp"
    if args.node_rank == 0 and args.get("--headless"):
        return "ValueError: --headless is for the worker nodes (--node-rank > 0); node rank 0 serves the API"
    template = args.get("--chat-template")
    if template and not args.is_worker:
        # vLLM's load_chat_template: a path-like value must open, or the API server does not start.
        try:
            with open(template, encoding="utf-8") as f:
                f.read()
        except OSError as err:
            if not any(c in template for c in "{}\n"):
                return (
                    f"ValueError: The supplied chat template ({template}) looks like a file path, but it "
                    f"failed to be opened. Reason: {err}"
                )
    return None


def serve(args: ServeArgs, env: SimEnv) -> NoReturn:
    start = time.monotonic()
    local_world = args.world_size // max(args.nnodes, 1)
    local_ranks = [args.node_rank * local_world + i for i in range(local_world)]
    api_key = env.api_key or args.get("--api-key")
    headless = args.is_worker
    _ROLE["headless"] = headless
    if not headless:  # the API server's line: a headless worker prints none (fixtures/real-vllm/boot)
        LOG("APIServer", "api_utils.py:286", args_line(args))
    if headless:
        LOG(
            None,
            "api_server.py:1869",
            f"Launching vLLM (v{VLLM_VERSION}) headless multiproc executor, with head "
            f"node address {args.master_addr} for torch.distributed process group.",
        )
    else:
        for text in BANNER:  # vLLM 0.32's start banner (api_utils.py), as recorded
            LOG("APIServer", "api_utils.py:347", text.format(version=VLLM_VERSION, model=args.model))
    httpd: ThreadingHTTPServer | None = None
    if not headless:
        # vLLM binds the API socket before the engine starts and listens only once it is ready:
        # until then a client gets connection refused.
        httpd = ThreadingHTTPServer(
            (args.get("--host") or "0.0.0.0", int(args.get("--port", 8000))),
            BaseHTTPRequestHandler,
            bind_and_activate=False,
        )
        httpd.daemon_threads = True
        try:
            httpd.server_bind()
        except OSError as err:
            LOG.traceback(
                [],
                f"OSError: [Errno {err.errno}] {err.strerror}: {args.get('--host') or '0.0.0.0'}:"
                f"{args.get('--port', 8000)} (--host/--port)",
            )
            die(EXIT_FAILURE)
        LOG(
            "EngineCore_DP0",
            "core.py:93",
            f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: "
            f"model={args.model!r}, quantization={args.get('--quantization')}, tensor_parallel_size="
            f"{args.get('--tensor-parallel-size', 1)}, served_model_name={args.served_model_names[0]}, "
            f"enforce_eager={args.enforce_eager}, "
            f"enable_prefix_caching={args.switch('enable-prefix-caching')}",
        )
        if args.nnodes > 1:
            LOG(
                "EngineCore",
                "multiproc_executor.py:153",
                f"DP group leader: node_rank=0, node_rank_within_dp=0, master_addr={args.master_addr}, "
                f"mq_connect_ip={args.master_addr} (local), world_size={args.world_size}, "
                f"local_world_size={local_world}",
            )
    init = f"tcp://{_tcp_address(args.master_addr, args.master_port)}"
    for rank in local_ranks:
        LOG(
            worker_name(rank),
            "parallel_state.py:1208",
            f"world_size={args.world_size} rank={rank} "
            f"local_rank={rank - local_ranks[0]} distributed_init_method={init} backend=nccl",
        )
    links: list[WorkerLink] = []
    head_link: tuple[socket.socket, BinaryIO] | None = None
    if args.nnodes > 1:
        if headless:
            if env.fault == "rank-never-joins":
                sleep_forever()  # alive, never connects: the head's store times out
            head_link = join_rendezvous(args, env)
        else:
            links = host_rendezvous(args, env)
    ep = args.switch("enable-expert-parallel")
    for rank in local_ranks:
        # Printed once per process after the group formed (vLLM 0.32 wording, fixtures/real-vllm/boot).
        LOG(
            "Worker",
            "parallel_state.py:2350",
            f"rank {rank} in world size {args.world_size} is assigned as DP rank 0, PP rank 0, PCP rank 0, "
            f"TP rank {rank}, ETP rank {rank}, EP rank {rank if ep else 'N/A'}, EPLB rank N/A",
        )
        if rank == 0:  # pynccl's version line: rank 0 only (hardware only: the CPU build has no NCCL)
            LOG(worker_name(rank), "pynccl.py:103", f"vLLM is using nccl=={NCCL_VERSION}")
    who = worker_name(local_ranks[0])
    _ROLE["loading"] = True
    try:
        weights = load_checkpoint(args, env, who)
    except (OSError, LoadFailure) as err:
        final = (
            f"FileNotFoundError: {err}"
            if isinstance(err, FileNotFoundError)
            else (str(err) if isinstance(err, LoadFailure) else f"{type(err).__name__}: {err}")
        )
        LOG(who, "multiproc_executor.py:671", "WorkerProc failed to start.", "ERROR")
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/model_loader/'
                'weight_utils.py", line 612, in safetensors_weights_iterator',
                '    with safe_open(st_file, framework="pt") as f:',
            ],
            final,
        )
        if not headless:
            LOG("EngineCore_DP0", "core.py:708", "EngineCore failed to start.", "ERROR")
            LOG.traceback(
                [],
                "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            )
        die(EXIT_FAILURE)
    _ROLE["loading"] = False
    if env.fault == "stall-after-load":
        sleep_forever()
    max_model_len = int(args.get("--max-model-len") or _config_max_len(Path(args.model)))
    available, kv_size = _kv_lines(args, max_model_len)
    LOG(who, "gpu_worker.py:390", available)
    if head_link is not None:
        _graph_lines(args, env, who)
        _send(head_link[0], {"op": "ready"})
        if env.fault == "worker-exit-after-load":
            LOG(who, "multiproc_executor.py:702", "WorkerProc hit an exception.", "ERROR")
            LOG.traceback(
                [
                    '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/gpu_worker.py", '
                    "line 512, in execute_model"
                ],
                "RuntimeError: CUDA error: unspecified launch failure",
            )
            die(EXIT_FAILURE)
        serve_steps(head_link[0], head_link[1], weights, local_ranks, env.fault == "nan-logits", who, env.fault_file)
    for link in links:  # profiling and KV allocation are collective: wait for every worker
        while not link.ready.wait(1.0):
            pass
    LOG("EngineCore_DP0", "kv_cache_utils.py:1087", kv_size)
    _graph_lines(args, env, who)
    LOG(
        "EngineCore_DP0",
        "core.py:250",
        f"init engine (profile, create kv cache, warmup model) took {time.monotonic() - start:.2f} s",
    )
    assert httpd is not None
    engine = Engine(weights, local_ranks, links, env, args.served_model_names)
    api = Api(engine=engine, args=args, max_model_len=max_model_len, api_key=api_key)
    httpd.RequestHandlerClass = make_handler(api)
    host, port = args.get("--host") or "0.0.0.0", int(args.get("--port", 8000))
    LOG("APIServer", "api_server.py:1935", f"Starting vLLM server on http://{_tcp_address(host, port)}")
    LOG("APIServer", "launcher.py:37", "Available routes are:")
    for route, methods in (
        ("/health", "GET"),
        ("/v1/models", "GET"),
        ("/version", "GET"),
        ("/v1/chat/completions", "POST"),
        ("/metrics", "GET"),
    ):
        LOG("APIServer", "launcher.py:45", f"Route: {route}, Methods: {methods}")
    httpd.server_activate()
    pid = os.getpid()
    for text in (
        f"Started server process [{pid}]",
        "Waiting for application startup.",
        "Application startup complete.",
    ):
        LOG.raw(f"INFO:     {text}")  # uvicorn's own lines carry no vLLM prefix
    threading.Thread(target=log_engine_stats, args=(engine,), daemon=True).start()
    httpd.serve_forever(poll_interval=0.2)
    die(0)


def _config_max_len(model_dir: Path) -> int:
    try:
        return int(json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 163840))
    except (OSError, ValueError, TypeError, AttributeError):
        return 163840


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(TOP_USAGE)
        return 0 if argv else EXIT_USAGE
    if argv[0] in ("-v", "--version"):
        print(VLLM_VERSION)
        return 0
    if argv[0] != "serve":
        print(TOP_USAGE, file=sys.stderr)
        print(
            f"vllm: error: argument subparser: invalid choice: {argv[0]!r} (choose from 'chat', 'complete', "
            "'serve', 'bench', 'collect-env', 'run-batch')",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if any(a in ("-h", "--help") for a in argv[1:]):
        print(SERVE_USAGE)
        print("\nflags known to this vLLM stand-in:\n  " + "\n  ".join(sorted(FLAGS)))
        return 0
    try:
        args = parse_serve_args(argv[1:])
    except UsageError as err:
        print(SERVE_USAGE, file=sys.stderr)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        env = SimEnv.from_environ(os.environ)
    except ValueError as err:
        print(f"ERROR: {err}", file=sys.stderr)
        return EXIT_FAILURE
    problem = _validate(args)
    if problem:
        LOG.traceback([], problem)
        return EXIT_FAILURE
    # PID 1 in a container ignores SIGTERM without a handler: docker stop must end us at once.
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    serve(args, env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
