"""The slim Engram directory, built beside the base repo's from what was staged.

Part of the staging program (components/weights/staging/main.py), which runs on the head node.

vLLM's default loader loads every shard an index names: pointed at the base repo's native index (48 shards
listed, 2 present) it would pull the whole tree. Every rank mounts a directory of its own instead, built here
after each staging run from what was staged (as upstream's scripts/prepare_engram_src.py builds it): hardlinks of
the Engram shards and config.json (no extra bytes) and an index whose weight_map lists only the Engram embed
tables. The index's weight_map is what the loader goes by, so it is the authority checked here: each table it
lists must be in an Engram shard's own header. Rebuilt on every run, so a new revision's files (downloaded to new
inodes) are linked again and the index derived again; a refusal changes nothing on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

from components.weights.staging.messages import StageError, say
from components.weights.staging.plan import EngramVllmPlan, RepoPlan, check_index
from components.weights.staging.record import Staging

# safetensors' own bound on a header; a larger length field means the file is not a safetensors file.
MAX_SAFETENSORS_HEADER = 100 << 20
# Where the index is written before it is renamed into place (an interrupted run leaves the previous one).
SLIM_TMP_SUFFIX = ".dsv41-tmp"


def _base_repo_fix(plan: RepoPlan, revision: str) -> str:
    return (
        f"weights.engramRepo={plan.repo!r} at weights.revision={revision!r} is not the base model whose shards "
        f"{' and '.join(plan.engram_vllm.shards if plan.engram_vllm else ())} hold the Engram tables; set them to "
        "the base model (deepseek-ai/DeepSeek-V4.1-Flash) and run again. Nothing staged was deleted"
    )


def engram_tables(plan: RepoPlan, slim: EngramVllmPlan, revision: str, st: Staging) -> dict[str, str]:
    """The slim index's weight_map: the native index's Engram embed tables, every one in an Engram shard."""
    rel = f"{plan.dest}/{plan.index_file}"
    try:
        native = json.loads((st.dest_root / rel).read_text())
        weight_map = native.get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise StageError(f"{plan.repo}: cannot read the index {st.on_host(rel)}: {exc}; run staging again") from exc
    if plan.index_shard_total is not None:  # the native index's own rule first: the whole model, 48 shards
        check_index(plan.repo, native, plan.index_shard_total)
    if not isinstance(weight_map, dict):
        raise StageError(
            f"{plan.repo}: the index {st.on_host(rel)} has no weight_map; {_base_repo_fix(plan, revision)}"
        )
    tables = {str(k): str(v) for k, v in sorted(weight_map.items()) if str(k).endswith(slim.suffixes)}
    kinds = " / ".join(f"*{suffix}" for suffix in slim.suffixes)
    if not tables:
        raise StageError(
            f"{plan.repo}: the index {st.on_host(rel)} lists no Engram embed tensor ({kinds}) among its "
            f"{len(weight_map)}, so {st.on_host(slim.dest)} would give the ranks no Engram tables; "
            + _base_repo_fix(plan, revision)
        )
    outside = {name: shard for name, shard in tables.items() if shard not in slim.shards}
    if outside:
        shown = ", ".join(f"{name} in {shard}" for name, shard in list(outside.items())[:3])
        more = f" and {len(outside) - 3} more" if len(outside) > 3 else ""
        raise StageError(
            f"{plan.repo}: the index {st.on_host(rel)} lists Engram embed tensors outside the shards staged for "
            f"them ({', '.join(slim.shards)}): {shown}{more}; {st.on_host(slim.dest)} cannot hold them. "
            + _base_repo_fix(plan, revision)
        )
    return tables


def engram_sources(plan: RepoPlan, slim: EngramVllmPlan, revision: str, st: Staging) -> dict[str, str]:
    """What the slim directory is built from, checked before any shard is downloaded: the index's embed tables,
    and the config the Engram loader reads at boot (without it every rank dies after the rendezvous)."""
    tables = engram_tables(plan, slim, revision, st)
    rel = f"{plan.dest}/{slim.config}"
    try:
        config = json.loads((st.dest_root / rel).read_text())
    except FileNotFoundError:
        raise StageError(
            f"{plan.repo}: {st.on_host(rel)} is missing, and the Engram loader reads it from /engram-src at boot "
            f"(every rank would fail with FileNotFoundError: /engram-src/{slim.config}); {st.on_host(slim.dest)} is "
            f"not built without it. Fix: run staging again (it fetches {slim.config} of {plan.repo}@{revision}); if "
            "that repo has none, set weights.engramRepo to the base model"
        ) from None
    except (OSError, ValueError) as exc:
        raise StageError(
            f"{plan.repo}: {st.on_host(rel)} is not readable JSON ({exc}); the Engram loader reads it at boot. Fix: "
            f"move it aside and run staging again (it fetches {slim.config} of {plan.repo}@{revision})"
        ) from exc
    if not isinstance(config, dict):
        raise StageError(
            f"{plan.repo}: {st.on_host(rel)} is not a JSON object, which the Engram loader reads at boot; "
            + _base_repo_fix(plan, revision)
        )
    return tables


def safetensors_names(path: Path) -> set[str]:
    """The tensor names in a safetensors file's header: an 8-byte little-endian length, then that much JSON."""
    with path.open("rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= length <= min(MAX_SAFETENSORS_HEADER, path.stat().st_size - 8):
            raise ValueError(f"no safetensors header (length field {length})")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    return {str(name) for name in header if name != "__metadata__"}


def check_tables_in_shards(plan: RepoPlan, tables: Mapping[str, str], revision: str, st: Staging) -> None:
    """Every table the index lists is in its shard's own header: the loader opens the shard and asks for it."""
    for shard in sorted(set(tables.values())):
        rel = f"{plan.dest}/{shard}"
        try:
            names = safetensors_names(st.dest_root / rel)
        except (OSError, ValueError) as exc:
            raise StageError(
                f"{plan.repo}: {st.on_host(rel)} is not a readable safetensors file ({exc}); "
                + _base_repo_fix(plan, revision)
            ) from exc
        absent = [name for name, where in tables.items() if where == shard and name not in names]
        if absent:
            more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
            raise StageError(
                f"{plan.repo}: {st.on_host(rel)} lacks the Engram embed tensor(s) {', '.join(absent[:3])}{more} "
                f"that {plan.index_file} maps to it; " + _base_repo_fix(plan, revision)
            )


def _same_file(a: Path, b: Path) -> bool:
    try:
        sa, sb = a.stat(), b.stat()
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _link(src: Path, dst: Path, st: Staging, slim: EngramVllmPlan) -> None:
    """`dst` as a hardlink of `src`, swapped in by rename (a rank never sees it missing); kept when it already is."""
    if _same_file(src, dst):
        return
    tmp = dst.with_name(f".{dst.name}{SLIM_TMP_SUFFIX}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError as exc:
        raise StageError(
            f"cannot hardlink {src.name} into {st.on_host(slim.dest)} ({exc.strerror or exc}): the slim Engram "
            f"directory holds hardlinks of the base shards, never copies (~189 GiB more). Fix: keep "
            f"{st.on_host(slim.dest)} on the filesystem of {src.parent.name}/ (no mount of its own under "
            "weights.root), then run again. Nothing staged was deleted"
        ) from exc
    os.replace(tmp, dst)


def build_engram_vllm(plan: RepoPlan, slim: EngramVllmPlan, revision: str, st: Staging) -> dict[str, tuple[int, str]]:
    """Build (or bring up to date) the slim directory; {relative path: (size, sha256)} of its files.

    Everything is checked before anything is written. Only the directory's own files are replaced; a file in it
    this program does not put there is refused, never deleted."""
    tables = engram_sources(plan, slim, revision, st)
    check_tables_in_shards(plan, tables, revision, st)
    src, dst = st.dest_root / plan.dest, st.dest_root / slim.dest
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise StageError(
            f"{st.on_host(slim.dest)} is not a directory of its own (a file or a symlink), and staging builds the "
            "slim Engram directory there; it is not deleted. Move it away by hand and run again"
        )
    linked = [*slim.shards, slim.config]
    ours = {*linked, plan.index_file or ""}
    if dst.is_dir():
        leftovers = {f".{name}{SLIM_TMP_SUFFIX}" for name in ours}
        for path in dst.iterdir():
            if path.name in leftovers:
                path.unlink()  # an interrupted run's
        foreign = sorted(p.name for p in dst.iterdir() if p.name not in ours)
        if foreign:
            raise StageError(
                f"{st.on_host(slim.dest)} holds {', '.join(foreign[:5])}, which this program does not put in the "
                "slim Engram directory (the ranks mount it at /engram-src); it is not deleted. Remove or move it "
                "by hand and run again"
            )
    native = json.loads((src / (plan.index_file or "")).read_text())
    metadata = native.get("metadata") if isinstance(native.get("metadata"), dict) else {}
    commit = st.repos.get(plan.dest, {}).get("commit", revision)
    body = {
        "metadata": {
            **metadata,
            "dsv41_engram_vllm": {"source": f"{plan.dest}/{plan.index_file}", "repo": plan.repo, "commit": commit},
        },
        "weight_map": tables,
    }
    text = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
    try:
        dst.mkdir(exist_ok=True)
        dst.chmod(0o755)  # the workers' root-squashed NFS mount reads it as `others`
        for name in linked:
            _link(src / name, dst / name, st, slim)
        index = dst / (plan.index_file or "")
        if not index.is_file() or index.read_bytes() != text:
            tmp = index.with_name(f".{index.name}{SLIM_TMP_SUFFIX}")
            tmp.write_bytes(text)
            tmp.chmod(0o644)
            os.replace(tmp, index)
    except OSError as exc:
        raise StageError(
            f"cannot write the slim Engram directory {st.on_host(slim.dest)}: {exc}; fix its ownership or "
            "permissions (staging runs as the ssh user), then run again"
        ) from exc
    say(
        f"{slim.dest}/: {len(tables)} Engram embed tensors in {', '.join(sorted(set(tables.values())))}, "
        f"hardlinked from {plan.dest}/ with {slim.config}; its index lists nothing else"
    )
    out = {f"{slim.dest}/{name}": st.records[f"{plan.dest}/{name}"] for name in linked}
    built = {rel: (int(record["size"]), str(record["sha256"])) for rel, record in out.items()}
    built[f"{slim.dest}/{plan.index_file}"] = (len(text), hashlib.sha256(text).hexdigest())
    return built
