"""The slim Engram directory staging builds beside `engram-src/` (issue 34, item 2): what every rank mounts at
/engram-src. The staging program runs for real against the local hub; the refusals name the directory, the value
and the fix, and delete nothing staged."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from components.weights import manifest as wm
from components.weights.staging.engram import SLIM_TMP_SUFFIX, build_engram_vllm, safetensors_names
from components.weights.staging.messages import StageError
from components.weights.staging.plan import EngramVllmPlan, RepoPlan
from components.weights.staging.record import MANIFEST_FILE, Staging, load_records, load_repos
from tests.support.staging import (
    COMMIT,
    ENGRAM_REPO,
    ENGRAM_TABLES,
    FakeHub,
    engram_shard,
    error_line,
    run_stage,
)

SHARD47, SHARD48 = wm.engram_shard_name(47), wm.engram_shard_name(48)
NEW_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
EMBED = {t: shard for shard, tables in ENGRAM_TABLES.items() for t in tables}


def _slim(root: Path) -> Path:
    return root / wm.ENGRAM_VLLM_DIR


def _index(root: Path) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((_slim(root) / wm.ENGRAM_INDEX).read_text())
    return body


def _inode(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def _snapshot(root: Path) -> dict[str, tuple[int, int, int, bytes]]:
    """Every file under the root: inode, mtime, content (what a refusal must leave as it found it)."""
    return {
        p.relative_to(root).as_posix(): (*_inode(p), p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _new_revision(hub: FakeHub, **files: bytes) -> None:
    hub.repos[ENGRAM_REPO].update({name.replace("__", "."): data for name, data in files.items()})
    hub.commit = NEW_COMMIT


def _set_index(hub: FakeHub, weight_map: dict[str, str]) -> None:
    hub.repos[ENGRAM_REPO][wm.ENGRAM_INDEX] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    hub.commit = NEW_COMMIT


def _layers() -> dict[str, str]:
    return {f"layer.{i}.w": wm.engram_shard_name(i) for i in range(1, 49)}


def test_staging_builds_hardlinks_of_shards_47_48_and_config_and_an_embed_only_index(
    hub: FakeHub, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    slim, src = _slim(root), root / wm.ENGRAM_DIR
    assert sorted(p.name for p in slim.iterdir()) == sorted([SHARD47, SHARD48, "config.json", wm.ENGRAM_INDEX])
    for name in (SHARD47, SHARD48, "config.json"):
        assert _inode(slim / name) == _inode(src / name), f"{name} must be a hardlink of engram-src/{name}, not a copy"
        assert (slim / name).stat().st_nlink == 2
    index = _index(root)
    assert index["weight_map"] == EMBED, "the index lists the Engram embed tables and nothing else"
    assert index["metadata"]["dsv41_engram_vllm"] == {
        "source": f"{wm.ENGRAM_DIR}/{wm.ENGRAM_INDEX}",
        "repo": ENGRAM_REPO,
        "commit": COMMIT,
    }
    native = json.loads((src / wm.ENGRAM_INDEX).read_text())
    assert len(set(native["weight_map"].values())) == 48, "the native index stays, for the staging count check"
    assert slim.stat().st_mode & 0o777 == 0o755, "the workers' root-squashed NFS mount must read it"
    staged = wm.parse_stage_output(proc.stdout)
    for name in (SHARD47, SHARD48, "config.json", wm.ENGRAM_INDEX):
        rel = f"{wm.ENGRAM_VLLM_DIR}/{name}"
        data = (root / rel).read_bytes()
        assert staged.files[rel] == len(data) and staged.sha256[rel] == hashlib.sha256(data).hexdigest(), rel
    assert "engram-vllm/: 4 Engram embed tensors in" in proc.stderr


def test_a_second_run_keeps_the_slim_directory_as_it_is(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    before = _snapshot(_slim(root))
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _snapshot(_slim(root)) == before, "same links, same index bytes and mtime: nothing rewritten"


def test_a_new_revision_relinks_the_new_shards_and_derives_the_index_again(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    tables = [*ENGRAM_TABLES[SHARD48], "model.layers.20.engram.embed.weight"]
    new48 = engram_shard(48, tables)
    hub.repos[ENGRAM_REPO][SHARD48] = new48
    _set_index(hub, {**_layers(), **EMBED, "model.layers.20.engram.embed.weight": SHARD48})
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    slim, src = _slim(root), root / wm.ENGRAM_DIR
    assert (slim / SHARD48).read_bytes() == new48, "the slim directory serves the new revision's shard"
    assert _inode(slim / SHARD48) == _inode(src / SHARD48)
    assert _index(root)["weight_map"]["model.layers.20.engram.embed.weight"] == SHARD48
    assert _index(root)["metadata"]["dsv41_engram_vllm"]["commit"] == NEW_COMMIT
    staged = wm.parse_stage_output(proc.stdout)
    assert staged.sha256[f"{wm.ENGRAM_VLLM_DIR}/{SHARD48}"] == hashlib.sha256(new48).hexdigest()
    assert not [p for p in slim.iterdir() if p.name.endswith(SLIM_TMP_SUFFIX)]


def test_an_index_with_no_embed_tensor_is_refused_before_any_shard_is_downloaded(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    _set_index(hub, _layers())  # the 48 shards, no Engram table: not the base model this deployment needs
    proc = run_stage(hub, root)
    assert proc.returncode == 1
    line = error_line(proc)
    assert f"/host/root/{wm.ENGRAM_DIR}/{wm.ENGRAM_INDEX} lists no Engram embed tensor" in line, line
    assert "*.engram.embed.weight / *.engram.embed.scale" in line
    assert f"weights.engramRepo='{ENGRAM_REPO}'" in line and "weights.revision='main'" in line
    assert "Nothing staged was deleted" in line
    assert not hub.gets_of(".safetensors"), "refused in seconds, before hours of shard downloads"
    assert not _slim(root).exists()


def test_an_embed_tensor_outside_shards_47_48_is_refused_and_the_built_directory_is_kept(
    hub: FakeHub, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    before = _snapshot(root)
    _set_index(hub, {**_layers(), **EMBED, "model.layers.3.engram.embed.scale": wm.engram_shard_name(12)})
    hub.requests.clear()
    proc = run_stage(hub, root)
    assert proc.returncode == 1
    line = error_line(proc)
    assert "lists Engram embed tensors outside the shards staged for them" in line, line
    assert f"model.layers.3.engram.embed.scale in {wm.engram_shard_name(12)}" in line
    assert f"/host/root/{wm.ENGRAM_VLLM_DIR} cannot hold them" in line and "weights.engramRepo" in line
    assert not hub.gets_of(".safetensors")
    fetched = (f"{wm.ENGRAM_DIR}/{wm.ENGRAM_INDEX}", MANIFEST_FILE)  # the refused index, and its record
    after = _snapshot(root)
    assert {k: v for k, v in after.items() if k not in fetched} == {
        k: v for k, v in before.items() if k not in fetched
    }, "nothing staged is deleted or changed, the slim directory built before included"


def test_engram_shards_lacking_the_embed_tensors_the_index_names_are_refused(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    hub.repos[ENGRAM_REPO][SHARD47] = engram_shard(47, [])  # a real header, without the tables
    proc = run_stage(hub, root)
    assert proc.returncode == 1
    line = error_line(proc)
    assert f"/host/root/{wm.ENGRAM_DIR}/{SHARD47} lacks the Engram embed tensor(s)" in line, line
    assert "model.layers.1.engram.embed.weight" in line and "weights.engramRepo" in line
    assert (root / wm.ENGRAM_DIR / SHARD47).exists(), "the staged shard is not deleted"
    assert not _slim(root).exists()


def test_a_shard_that_is_not_safetensors_is_refused_naming_it(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    hub.repos[ENGRAM_REPO][SHARD48] = b"\xff" * 64
    proc = run_stage(hub, root)
    assert proc.returncode == 1
    line = error_line(proc)
    assert f"/host/root/{wm.ENGRAM_DIR}/{SHARD48} is not a readable safetensors file" in line, line


def test_a_file_in_the_slim_directory_this_program_did_not_put_there_is_refused_not_deleted(
    hub: FakeHub, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    (_slim(root) / "notes.txt").write_text("mine")
    (_slim(root) / f".{wm.ENGRAM_INDEX}{SLIM_TMP_SUFFIX}").write_text("an interrupted run's")
    proc = run_stage(hub, root)
    assert proc.returncode == 1
    line = error_line(proc)
    assert f"/host/root/{wm.ENGRAM_VLLM_DIR} holds notes.txt" in line and "it is not deleted" in line, line
    assert (_slim(root) / "notes.txt").read_text() == "mine"


def test_a_slim_directory_path_that_is_a_symlink_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.mkdir()
    _slim(root).symlink_to(elsewhere)
    proc = run_stage(hub, root)
    assert proc.returncode == 1
    assert "is not a directory of its own" in error_line(proc)
    assert _slim(root).is_symlink() and not list(elsewhere.iterdir())


# --- the build, called directly -----------------------------------------------------------------------


def _staged(hub: FakeHub, tmp_path: Path) -> tuple[Path, RepoPlan, Staging]:
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    plan_json = wm.staging_plan(model_repo="a/b", engram_repo=ENGRAM_REPO, revision="main")["repos"][1]
    plan = RepoPlan.from_json(plan_json)
    st = Staging(
        dest_root=root,
        endpoint=None,
        token=None,
        api=None,
        records=load_records(root / MANIFEST_FILE),
        repos=load_repos(root / MANIFEST_FILE),
        host_root="/host/root",
    )
    return root, plan, st


def test_a_missing_config_json_is_refused_naming_the_directory_and_the_fix(hub: FakeHub, tmp_path: Path) -> None:
    # An owner's first run: config.json absent, staging passed, and every rank died at boot with
    # FileNotFoundError: /engram-src/config.json.
    root, plan, st = _staged(hub, tmp_path)
    assert plan.engram_vllm is not None
    (root / wm.ENGRAM_DIR / "config.json").unlink()
    before = _snapshot(root)
    with pytest.raises(StageError) as err:
        build_engram_vllm(plan, plan.engram_vllm, "main", st)
    text = str(err.value)
    assert f"/host/root/{wm.ENGRAM_DIR}/config.json is missing" in text
    assert "FileNotFoundError: /engram-src/config.json" in text and f"/host/root/{wm.ENGRAM_VLLM_DIR}" in text
    assert "run staging again" in text
    assert _snapshot(root) == before, "nothing staged is deleted, the slim directory included"


def test_a_hardlink_that_cannot_be_made_is_refused_never_copied(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, plan, st = _staged(hub, tmp_path)
    assert plan.engram_vllm is not None
    (_slim(root) / SHARD47).unlink()

    def cross_device(src: Any, dst: Any) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "link", cross_device)
    with pytest.raises(StageError) as err:
        build_engram_vllm(plan, plan.engram_vllm, "main", st)
    text = str(err.value)
    assert f"cannot hardlink {SHARD47} into /host/root/{wm.ENGRAM_VLLM_DIR}" in text
    assert "never copies" in text and "Fix: keep" in text
    assert not (_slim(root) / SHARD47).exists(), "no copy was made in its place"


def test_the_staging_plan_names_the_slim_directory_and_its_rules() -> None:
    plan = wm.staging_plan(model_repo="a/b", engram_repo=ENGRAM_REPO, revision="main")
    slim = RepoPlan.from_json(plan["repos"][1]).engram_vllm
    assert slim == EngramVllmPlan(
        dest="engram-vllm",
        shards=(SHARD47, SHARD48),
        config="config.json",
        suffixes=(".engram.embed.weight", ".engram.embed.scale"),
    )
    assert RepoPlan.from_json(plan["repos"][0]).engram_vllm is None


def test_safetensors_names_reads_the_header_only(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(engram_shard(47, ENGRAM_TABLES[SHARD47]))
    assert safetensors_names(path) == {"layer.47.w", *ENGRAM_TABLES[SHARD47]}
    for bad in (b"", b"\x01" * 7, (10**12).to_bytes(8, "little") + b"{}", (2).to_bytes(8, "little") + b"[]"):
        path.write_bytes(bad)
        with pytest.raises(ValueError):
            safetensors_names(path)
