"""The staging plan as the program reads it (from `components/weights/manifest.py`), and its rules on files.

Part of the staging program (components/weights/staging/main.py), which runs on the head node: the repos, their
destinations and selected files, the count rules every repo must pass (on the hub listing and on disk), how many
files download at once, and the line the program prints on success.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.weights.staging.messages import StageError

# Starts the one stdout line of a successful run (manifest.parse_stage_output reads it).
MANIFEST_MARKER = "DSV41_WEIGHTS_MANIFEST"

# Files downloaded at once: the plan's `download_streams` (weights.downloadStreams); a plan without it (rendered
# by a caller that predates the setting) stages one file at a time, as this program did then.
UNPLANNED_STREAMS = 1
MAX_STREAMS = 64


@dataclass(frozen=True)
class EngramVllmPlan:
    """The slim Engram directory built beside a repo's: hardlinks of its Engram shards and config, and an index
    listing only the tensors whose names end with one of `suffixes` (what every rank mounts at /engram-src)."""

    dest: str
    shards: tuple[str, ...]
    config: str
    suffixes: tuple[str, ...]

    @staticmethod
    def from_json(raw: Any) -> EngramVllmPlan | None:
        if not raw:
            return None
        return EngramVllmPlan(
            dest=str(raw["dest"]),
            shards=tuple(str(s) for s in raw["shards"]),
            config=str(raw["config"]),
            suffixes=tuple(str(s) for s in raw["suffixes"]),
        )


@dataclass(frozen=True)
class RepoPlan:
    """One repo to stage: where it goes and which rules its files must satisfy."""

    repo: str
    dest: str
    files: tuple[str, ...] | None  # None: every file in the repo
    safetensors_count: int | None  # exact number of top-level *.safetensors expected in dest
    index_file: str | None  # safetensors index whose weight_map names every shard of the full model
    index_shard_total: int | None  # how many distinct shards the index must name
    required_shards: tuple[str, ...]  # shards that must be on disk in dest
    engram_vllm: EngramVllmPlan | None = None  # the slim Engram directory built from this repo's files

    @staticmethod
    def from_json(raw: dict[str, Any]) -> RepoPlan:
        files = raw.get("files")
        return RepoPlan(
            repo=str(raw["repo"]),
            dest=str(raw["dest"]),
            files=None if files is None else tuple(str(f) for f in files),
            safetensors_count=raw.get("safetensors_count"),
            index_file=raw.get("index_file"),
            index_shard_total=raw.get("index_shard_total"),
            required_shards=tuple(raw.get("required_shards") or ()),
            engram_vllm=EngramVllmPlan.from_json(raw.get("engram_vllm")),
        )


@dataclass(frozen=True)
class HubFile:
    """One file as the hub lists it: its size and what identifies its content."""

    size: int
    sha256: str | None = None  # the LFS object id (large files)
    blob_id: str | None = None  # the git blob id: the content's id for a non-LFS file, the pointer's for LFS

    @property
    def verified_by(self) -> str:
        return "lfs-sha256" if self.sha256 else "git-blob-id" if self.blob_id else "size"


def select_files(
    repo: str, revision: str, tree: dict[str, HubFile], wanted: Iterable[str] | None
) -> dict[str, HubFile]:
    """The planned files as listed; a planned file absent from the hub listing is an error."""
    if wanted is None:
        return dict(sorted(tree.items()))
    wanted = list(wanted)
    missing = [f for f in wanted if f not in tree]
    if missing:
        raise StageError(
            f"{repo}@{revision} has no file {', '.join(missing)} on the hub; "
            "check the repo name and revision (the file list is in the staging plan)"
        )
    return {f: tree[f] for f in sorted(wanted)}


def count_safetensors(names: Iterable[str]) -> int:
    """Top-level *.safetensors only: a stray file in a subfolder is not a shard vLLM loads."""
    return sum(1 for n in names if "/" not in n and n.endswith(".safetensors"))


def check_safetensors_count(repo: str, where: str, names: Iterable[str], expected: int) -> None:
    found = count_safetensors(names)
    if found != expected:
        raise StageError(
            f"{repo}: {where} has {found} *.safetensors shards, expected exactly {expected}; "
            "the repo or revision is not the 2.9bpw EXL3 checkpoint this deployment expects"
        )


_SHARD_TOTAL = re.compile(r"-of-(\d{5})\.safetensors$")


def check_index(repo: str, index: dict[str, Any], shard_total: int) -> None:
    """The index must describe the whole model: exactly `shard_total` shards, all named -of-<total>."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise StageError(f"{repo}: the safetensors index has no weight_map; the download is not the model index")
    shards = {str(v) for v in weight_map.values()}
    wrong = sorted(s for s in shards if (m := _SHARD_TOTAL.search(s)) is None or int(m.group(1)) != shard_total)
    if wrong or len(shards) != shard_total:
        raise StageError(
            f"{repo}: the index names {len(shards)} shards (expected {shard_total}, all '-of-{shard_total:05d}')"
            + (f"; unexpected: {', '.join(wrong[:3])}" if wrong else "")
            + "; the repo or revision is not the base model this deployment expects"
        )


def check_required_present(repo: str, dest_dir: Path, required: Iterable[str], sizes: Mapping[str, int]) -> None:
    """Verify by count, not by exit code: every required shard is on disk with its listed size."""
    absent = [s for s in required if not (dest_dir / s).is_file() or (dest_dir / s).stat().st_size != sizes.get(s)]
    if absent:
        raise StageError(f"{repo}: required shard(s) {', '.join(absent)} not present in {dest_dir} after staging")


def plan_streams(raw: Mapping[str, Any]) -> int:
    """Files to download at once, as the plan says (weights.downloadStreams)."""
    streams = raw.get("download_streams", UNPLANNED_STREAMS)
    if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
        raise StageError(
            f"the staging plan's download_streams={streams!r} is not a whole number from 1 to {MAX_STREAMS}; "
            "set weights.downloadStreams within it"
        )
    return streams
