"""Stage the checkpoint into <root>: runs ON THE HEAD NODE, inside a throwaway container of the staging image.

Self-contained on purpose (stdlib + huggingface_hub only): the program ships this file's text to the
node and runs it with the image's python3. The plan (which repos, which files, which count rules)
comes as JSON from `components/weights_manifest.py`; this script only enforces it.

Per repo: list the files with sizes, select the planned ones (a planned file missing on the hub is
an error naming it), download ONE FILE AT A TIME into <dest-root>/<dest>/, skipping files already
present with the listed size (so a re-run is cheap and an interrupted run resumes), verify each by
name and size, then apply the count rules. Success prints one line on stdout:
    DSV41_WEIGHTS_MANIFEST {"root": "<host root>", "files": {"model/x.safetensors": 123, ...}}
Progress and errors go to stderr; an error is one line starting with "stage_weights: error:".
The token comes from the environment (HF_TOKEN), never from argv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_MARKER = "DSV41_WEIGHTS_MANIFEST"


class StageError(Exception):
    """A failure the operator can act on; the message names the repo/file and the fix."""


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
        )


def select_files(repo: str, revision: str, tree: dict[str, int], wanted: Iterable[str] | None) -> dict[str, int]:
    """The planned files with their hub sizes; a planned file absent from the hub listing is an error."""
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


def check_required_present(repo: str, dest_dir: Path, required: Iterable[str], sizes: dict[str, int]) -> None:
    """Verify by count, not by exit code: every required shard is on disk with its listed size."""
    absent = [s for s in required if not (dest_dir / s).is_file() or (dest_dir / s).stat().st_size != sizes.get(s)]
    if absent:
        raise StageError(f"{repo}: required shard(s) {', '.join(absent)} not present in {dest_dir} after staging")


def local_size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def _hub_errors() -> tuple[type[Exception], type[Exception], type[Exception]]:
    """(EntryNotFound, RepositoryNotFound, RevisionNotFound) across hub versions."""
    try:
        from huggingface_hub import errors
    except ImportError:  # huggingface_hub < 0.24 keeps them in utils
        from huggingface_hub import utils as errors  # type: ignore[no-redef]
    return errors.EntryNotFoundError, errors.RepositoryNotFoundError, errors.RevisionNotFoundError


def list_tree(api: Any, repo: str, revision: str) -> dict[str, int]:
    """{path: size} of every file in the repo at `revision` (folders skipped)."""
    _, RepositoryNotFoundError, RevisionNotFoundError = _hub_errors()
    try:
        items = list(api.list_repo_tree(repo, revision=revision, recursive=True))
    except RevisionNotFoundError as exc:
        raise StageError(f"{repo}: revision {revision!r} not found on the hub; fix the revision") from exc
    except RepositoryNotFoundError as exc:
        raise StageError(f"{repo}: repo not found (or gated without a token); fix the repo name or hf token") from exc
    except Exception as exc:  # HTTP, transport (httpx) and disk errors alike: name the file, suggest a re-run
        raise StageError(f"{repo}@{revision}: listing files failed: {type(exc).__name__}: {exc}; "
                         "check HF_ENDPOINT and the network, then retry") from exc
    tree: dict[str, int] = {}
    for item in items:
        size = getattr(item, "size", None)
        if isinstance(size, int) and getattr(item, "path", None):
            tree[str(item.path)] = size
    return tree


def fetch_one(repo: str, revision: str, name: str, size: int, dest_dir: Path, endpoint: str | None,
              token: str | None) -> bool:
    """Download one file unless it is already there with the right size; returns True when it downloaded."""
    from huggingface_hub import hf_hub_download
    EntryNotFoundError, _, _ = _hub_errors()

    target = dest_dir / name
    have = local_size(target)
    if have == size:
        return False
    try:
        hf_hub_download(repo, name, revision=revision, local_dir=str(dest_dir), endpoint=endpoint, token=token,
                        force_download=have is not None)
    except EntryNotFoundError as exc:
        raise StageError(f"{repo}@{revision}: file {name} is listed but the hub returned 404 for it; "
                         "check the revision or retry") from exc
    except Exception as exc:  # HTTP, transport (httpx) and disk errors alike: name the file, suggest a re-run
        raise StageError(f"{repo}@{revision}: downloading {name} failed: {type(exc).__name__}: {exc}; "
                         "re-run to resume") from exc
    got = local_size(target)
    if got != size:
        if got is not None:
            target.unlink()  # so the next run fetches it again instead of trusting a bad copy
        raise StageError(f"{repo}@{revision}: {name} is {got} bytes after download, the hub lists {size}; "
                         "removed it, re-run to fetch it again")
    return True


def stage_repo(plan: RepoPlan, revision: str, dest_root: Path, endpoint: str | None, token: str | None,
               api: Any) -> dict[str, int]:
    tree = list_tree(api, plan.repo, revision)
    files = select_files(plan.repo, revision, tree, plan.files)
    if plan.safetensors_count is not None:  # fail before hours of download when the hub side is wrong
        check_safetensors_count(plan.repo, "the hub listing", files, plan.safetensors_count)
    dest_dir = dest_root / plan.dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    for i, (name, size) in enumerate(files.items(), 1):
        fetched = fetch_one(plan.repo, revision, name, size, dest_dir, endpoint, token)
        print(f"stage_weights: {plan.dest}/{name} ({size} bytes) {'downloaded' if fetched else 'present'} "
              f"[{i}/{len(files)}]", file=sys.stderr, flush=True)
    on_disk = [p.name for p in dest_dir.iterdir() if p.is_file()]
    if plan.safetensors_count is not None:
        check_safetensors_count(plan.repo, str(dest_dir), on_disk, plan.safetensors_count)
    if plan.index_file is not None and plan.index_shard_total is not None:
        try:
            index = json.loads((dest_dir / plan.index_file).read_text())
        except (OSError, ValueError) as exc:
            raise StageError(f"{plan.repo}: cannot read {plan.index_file} in {dest_dir}: {exc}") from exc
        check_index(plan.repo, index, plan.index_shard_total)
    check_required_present(plan.repo, dest_dir, plan.required_shards, files)
    return {f"{plan.dest}/{name}": size for name, size in files.items()}


def run(plan_json: str, dest_root: Path, host_root: str) -> dict[str, Any]:
    from huggingface_hub import HfApi

    raw = json.loads(plan_json)
    revision = str(raw["revision"])
    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.pop("HF_TOKEN", "") or None  # empty means anonymous
    api = HfApi(endpoint=endpoint, token=token)
    files: dict[str, int] = {}
    for repo_raw in raw["repos"]:
        files.update(stage_repo(RepoPlan.from_json(repo_raw), revision, dest_root, endpoint, token, api))
    return {"root": host_root, "files": files}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stage the dsv41-exl3 checkpoint (one file at a time).")
    parser.add_argument("--plan", required=True, help="staging plan JSON (from weights_manifest.staging_plan)")
    parser.add_argument("--dest-root", required=True, help="where <root> is mounted in this container")
    parser.add_argument("--host-root", required=True, help="<root> as the host sees it (reported back)")
    ns = parser.parse_args(argv)
    try:
        result = run(ns.plan, Path(ns.dest_root), ns.host_root)
    except StageError as exc:
        print(f"stage_weights: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"{MANIFEST_MARKER} {json.dumps(result, sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
