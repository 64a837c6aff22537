"""The vLLM stand-in's checkpoint loading: every file the /model index names, then the Engram tables the table
directory's index names (each looked up in its shard's safetensors header), refused or missing as vLLM's loader
refuses them (`LoadFailure`, FileNotFoundError), read at SIM_LOAD_SECONDS' pace with rank 0's progress bar; the
digest of all their bytes is the model's parameters. Stdlib only, as the whole stand-in (sim/standin/README.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from .cli import ServeArgs
from .faults import SimEnv
from .log import LOG

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
        pace(start + done * per_file)
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
        pace(start + (len(shards) + done) * per_file)
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


def pace(until: float) -> None:
    left = until - time.monotonic()
    if left > 0:
        time.sleep(left)
