"""The vLLM stand-in's command line: a table of the flags vLLM knows with their arity and kind, parsed the way argparse
does (`parse_serve_args`, with argparse's wording in `UsageError`), into `ServeArgs`, and vLLM's `non-default args`
line with the API key masked. Stdlib only, as the whole stand-in (sim/standin/README.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

PROG = "vllm serve"
SERVE_USAGE = "usage: vllm serve [model_tag] [options]"
TOP_USAGE = "usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ..."
EXIT_USAGE = 2

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
