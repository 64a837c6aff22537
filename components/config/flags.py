"""The `vllm serve` flags and environment variables the program owns, and how vLLM's parser reads a flag.

A flag or variable the program renders from a key may not also come through `serve.extraArgs` or
`serve.extraEnv`: extra args come last, so they would override the key (and the capacity rules) silently.
Most owned names are read from the keys' declarations (`setting(flag=..., env=...)`); the tables here hold
only what no single key renders.
"""

from __future__ import annotations

from components.config.declare import Declared, declarations
from components.config.models import Settings

# Flags rendered per rank from the node list (components/serving/spec.py rank_command).
RANK_FLAGS = {
    "--tensor-parallel-size": "it is the number of entries in `nodes`",
    "--nnodes": "it is the number of entries in `nodes`",
    "--node-rank": "it is each node's position in `nodes`",
    "--master-addr": "it is the head's `fabricIp`",
    "--master-port": "set `serve.masterPort`",
    "--headless": "workers get it automatically",
}
# Flags the program never renders and refuses: what they set is passed another way, or not supported.
REFUSED_FLAGS = {
    "--api-key": "set `serve.apiKey` as a secret (it is passed by environment, never argv)",
    "--pipeline-parallel-size": "the program runs one tensor-parallel group, one rank per node",
    "--data-parallel-size": "the program runs one tensor-parallel group, one rank per node",
    "--hf-token": "set `weights.hfToken` as a secret (argv is visible to every process on the node)",
}
# Every data-parallel setting (--data-parallel-rank, -size-local, -address, ...) is owned with --data-parallel-size.
DATA_PARALLEL_PREFIX = "--data-parallel-"

# Variables derived from several keys (components/serving/spec.py common_env).
DERIVED_ENV = {
    "NNODES": "it is the number of entries in `nodes` (the Engram row store splits its cache by it)",
    "VLLM_ENGINE_READY_TIMEOUT_S": "it is derived from `gates.rendezvousTimeoutSeconds` + "
    "`gates.readyTimeoutSeconds`, so the ready gate is the bound that acts",
}

# Every one-dash option of `vllm serve` in vLLM 0.32 (`vllm/engine/arg_utils.py`, `vllm/entrypoints/launchers/
# cli_args.py`, argparse's own -h) and the long option it stands for. argparse reads a one-dash argument as that
# option exactly, the option before a `=` (`-tp=4`), a two-character option with its value attached (`-n2`,
# `-qexl3`), or an unambiguous prefix of one of these (`-t` is `-tp`, `-s` is `-sc`); no option starts with
# `-n` or `-r` but those two, so every `-n...` / `-r...` is --nnodes / --node-rank. `-O` is vLLM's own rewrite
# to --optimization-level, done before argparse.
VLLM_SHORT_OPTIONS = {
    "-h": "--help",
    "-q": "--quantization",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpn": "--data-parallel-rank",
    "-dpr": "--data-parallel-start-rank",
    "-dpl": "--data-parallel-size-local",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-dpb": "--data-parallel-backend",
    "-dph": "--data-parallel-hybrid-lb",
    "-dpe": "--data-parallel-external-lb",
    "-dpm": "--data-parallel-multi-port-external-lb",
    "-ep": "--enable-expert-parallel",
    "-sc": "--speculative-config",
    "-dc": "--diffusion-config",
    "-cc": "--compilation-config",
    "-ac": "--attention-config",
    "-asc": "--api-server-count",
}

DECLARED: tuple[Declared, ...] = tuple(declarations(Settings))
# Flags the program renders itself from structured keys, each with the key to set instead.
OWNED_FLAGS = {d.flag: d.owner for d in DECLARED if d.flag} | RANK_FLAGS | REFUSED_FLAGS
# Environment variables the program renders from structured keys (or derives); `serve.extraEnv` may set any
# other variable of the rendered set (see docs/checks.md, the upstream launcher's settings).
OWNED_ENV = {name: d.owner for d in DECLARED for name in d.env} | DERIVED_ENV
# Boolean flags vLLM declares with argparse.BooleanOptionalAction, which also accept `--no-<flag>`: the keys
# that render a switch.
NEGATABLE_FLAGS = {d.flag for d in DECLARED if d.flag and d.info.annotation is bool}


def canonical_flag(arg: str) -> str | None:
    """The option vLLM's parser reads from one argv element, or None for a value.

    vLLM's FlexibleArgumentParser turns `--max_model_len` into `--max-model-len` and reads
    `--speculative-config.method=x` as part of `--speculative-config`; BooleanOptionalAction flags also
    accept `--no-<flag>`; one-dash aliases take their value attached or are abbreviated (VLLM_SHORT_OPTIONS).
    """
    if arg.startswith("--"):
        name = "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if name.startswith("--no-") and "--" + name[5:] in NEGATABLE_FLAGS:
            return "--" + name[5:]
        return name
    if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit():
        return _one_dash_option(arg)
    return None


def _one_dash_option(arg: str) -> str:
    """The long option argparse reads a one-dash argument as (see VLLM_SHORT_OPTIONS)."""
    if arg.startswith("-O"):
        return "--optimization-level"
    name = arg.split("=", 1)[0]
    if name in VLLM_SHORT_OPTIONS:
        return VLLM_SHORT_OPTIONS[name]
    read = {VLLM_SHORT_OPTIONS[arg[:2]]} if arg[:2] in VLLM_SHORT_OPTIONS else set()
    read |= {long for short, long in VLLM_SHORT_OPTIONS.items() if short.startswith(name)}
    if len(read) == 1:
        return read.pop()
    if read:  # ambiguous (`-d`, `-p`): argparse refuses it, and vLLM with it
        return name
    # A value attached to a longer alias (`-tp4`): argparse refuses that too, but it is meant for that alias.
    meant = [short for short in VLLM_SHORT_OPTIONS if arg.startswith(short)]
    return VLLM_SHORT_OPTIONS[max(meant, key=len)] if meant else name


def owner_of(name: str) -> str | None:
    """Why the program owns the flag vLLM reads as `name`, or None when `serve.extraArgs` may pass it."""
    if name in OWNED_FLAGS:
        return OWNED_FLAGS[name]
    if name.startswith(DATA_PARALLEL_PREFIX):
        return OWNED_FLAGS["--data-parallel-size"]
    return None


def abbreviates(name: str) -> str | None:
    """The owned flag a strict prefix stands for (argparse's allow_abbrev), if any."""
    matches = sorted(f for f in OWNED_FLAGS if f.startswith(name) and f != name and len(name) > 3)
    return matches[0] if matches else None
