"""The staging program (`stage_weights.py`), run for real against a local hub: what it fetches, keeps,
records and refuses, and its count rules."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from components.weights import manifest as wm
from components.weights import stage_weights as sw
from tests.support.staging import (
    COMMIT,
    ENGRAM_REPO,
    MODEL_REPO,
    TOKEN,
    FakeHub,
    error_line,
    git_blob_id,
    run_stage,
)


def test_stage_downloads_expected_files_and_reports_manifest(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged = wm.parse_stage_output(proc.stdout)
    assert staged.root == "/host/root"
    model_files = {f"model/{n}": len(d) for n, d in hub.repos[MODEL_REPO].items()}
    engram = hub.repos[ENGRAM_REPO]
    engram_files = {
        f"engram-src/{n}": len(engram[n])
        for n in [wm.engram_shard_name(47), wm.engram_shard_name(48), wm.ENGRAM_INDEX, "config.json"]
    }
    assert staged.files == {**model_files, **engram_files}, "manifest must be every model file + the 4 engram files"
    for rel, size in staged.files.items():
        assert (root / rel).stat().st_size == size, rel
    assert len(list((root / "model").glob("*.safetensors"))) == 39
    assert sorted(p.name for p in (root / "engram-src").glob("*.safetensors")) == [
        wm.engram_shard_name(47),
        wm.engram_shard_name(48),
    ]
    assert not hub.gets_of(wm.engram_shard_name(1)), "engram shards other than 47/48 must never be fetched"
    assert not hub.gets_of("README.md")


def test_second_run_downloads_nothing(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    hub.requests.clear()
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolves = [(m, p) for m, p, _ in hub.requests if "/resolve/" in p]
    assert resolves == [], f"a resumed run must fetch nothing already present, saw {resolves[:5]}"
    assert {p.split("/tree/")[0].split("/revision/")[0] for m, p, _ in hub.requests} == {
        f"/api/models/{MODEL_REPO}",
        f"/api/models/{ENGRAM_REPO}",
    }, "only each repo's commit and listing"
    staged = len(wm.parse_stage_output(proc.stdout).files)
    assert proc.stderr.count("present (recorded) [") == staged == 46, "the records decide; no file is read again"


def test_partial_stage_resumes_only_missing_files(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    (root / "model" / "model-00007-of-00039.safetensors").unlink()
    (root / "engram-src" / wm.engram_shard_name(48)).write_bytes(b"truncated")
    hub.requests.clear()
    assert run_stage(hub, root).returncode == 0
    fetched = sorted(p.rsplit("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p)
    assert fetched == sorted([wm.engram_shard_name(48), "model-00007-of-00039.safetensors"])
    assert (root / "engram-src" / wm.engram_shard_name(48)).read_bytes() == hub.repos[ENGRAM_REPO][
        wm.engram_shard_name(48)
    ]


def test_token_reaches_hub_from_stdin(hub: FakeHub, tmp_path: Path) -> None:
    proc = run_stage(hub, tmp_path / "root", token=TOKEN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    auths = {a for _, _, a in hub.requests}
    assert auths == {f"Bearer {TOKEN}"}, f"every hub request must carry the token, saw {auths}"
    assert TOKEN not in proc.stdout + proc.stderr


def test_an_anonymous_run_ignores_a_token_in_the_environment(hub: FakeHub, tmp_path: Path) -> None:
    # A token baked into the image's environment must not turn an anonymous staging into an authenticated one.
    proc = run_stage(hub, tmp_path / "root", env={"HF_TOKEN": "hf_baked_into_the_image"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {a for _, _, a in hub.requests} == {None}


def test_engram_shard_missing_on_hub_fails_naming_repo_and_file(hub: FakeHub, tmp_path: Path) -> None:
    del hub.repos[ENGRAM_REPO][wm.engram_shard_name(47)]
    proc = run_stage(hub, tmp_path / "root")
    assert proc.returncode == 1
    line = error_line(proc)
    assert ENGRAM_REPO in line and wm.engram_shard_name(47) in line


@pytest.mark.parametrize(
    ("repo", "name"),
    [
        (MODEL_REPO, "../outside.safetensors"),
        (MODEL_REPO, "{tmp}/absolute.json"),
        (MODEL_REPO, "sub/../../x.json"),
        (MODEL_REPO, "win\\dows.json"),
        (MODEL_REPO, "nul\0.json"),
        (MODEL_REPO, "two\nlines.json"),
        # The base repo's listing is checked whole, not only the four selected files, and before the model is staged.
        (ENGRAM_REPO, "../../evil.py"),
    ],
)
def test_a_listing_naming_a_path_outside_the_repo_is_refused_before_anything_is_written(
    hub: FakeHub, tmp_path: Path, repo: str, name: str
) -> None:
    name = name.format(tmp=tmp_path)  # absolute, yet inside this test's directory should a regression write it
    hub.repos[repo][name] = b"planted by a mirror"
    root = tmp_path / "weights" / "root"
    proc = run_stage(hub, root)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = error_line(proc)
    assert repr(name) in line and hub.url in line and repo in line, line
    assert "nothing was written" in line and "weights.hfEndpoint" in line
    assert not root.exists(), "refused before any directory or file of the weights root is written"
    assert not hub.gets_of(".safetensors"), "no download started"
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.read_bytes() == b"planted by a mirror"]


@pytest.mark.parametrize("name", ["config.json", "a/b/c.safetensors", "..hidden/x", "x..y", "dir.v2/model.bin"])
def test_ordinary_repo_paths_pass_the_listing_check(name: str) -> None:
    assert sw.unsafe_path(name) is None


def test_listed_file_that_404s_fails_naming_it(hub: FakeHub, tmp_path: Path) -> None:
    hub.unresolvable.add((MODEL_REPO, "model-00012-of-00039.safetensors"))
    proc = run_stage(hub, tmp_path / "root")
    assert proc.returncode == 1
    line = error_line(proc)
    assert MODEL_REPO in line and "model-00012-of-00039.safetensors" in line and "404" in line


def test_wrong_size_fails_and_removes_the_bad_copy(hub: FakeHub, tmp_path: Path) -> None:
    name = "model-00003-of-00039.safetensors"
    hub.listed_size[(MODEL_REPO, name)] = len(hub.repos[MODEL_REPO][name]) + 100
    root = tmp_path / "root"
    proc = run_stage(hub, root)
    assert proc.returncode == 1
    line = error_line(proc)
    assert name in line and "the hub lists" in line
    assert not (root / "model" / name).exists(), "a wrong-size file must not be trusted by the next run"


def test_only_38_shards_fails_count_rule_before_downloading(hub: FakeHub, tmp_path: Path) -> None:
    del hub.repos[MODEL_REPO]["model-00039-of-00039.safetensors"]
    proc = run_stage(hub, tmp_path / "root")
    assert proc.returncode == 1
    line = error_line(proc)
    assert "38" in line and "exactly 39" in line
    assert not hub.gets_of(".safetensors"), "a wrong repo must fail before hours of download"


def test_index_naming_47_shards_fails(hub: FakeHub, tmp_path: Path) -> None:
    index = {"weight_map": {f"w{i}": wm.engram_shard_name(i, 47) for i in range(1, 48)}}
    hub.repos[ENGRAM_REPO][wm.ENGRAM_INDEX] = json.dumps(index).encode()
    proc = run_stage(hub, tmp_path / "root")
    assert proc.returncode == 1
    assert "index names 47 shards (expected 48" in error_line(proc)


# --- content verified by the hub's ids, recorded on the head (issue 12, item 6) ----------------------

SHARD = "model-00005-of-00039.safetensors"
NEW_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def records(root: Path) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((root / sw.MANIFEST_FILE).read_text())
    return body


def test_staging_records_name_size_sha256_and_revision_on_the_head(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged = wm.parse_stage_output(proc.stdout)
    body = records(root)
    assert body["format"] == 1 and set(body["files"]) == set(staged.files), "one record per staged file"
    assert body["repos"]["model"] == {"repo": MODEL_REPO, "revision": "main", "commit": COMMIT}
    for rel, rec in body["files"].items():
        data = (root / rel).read_bytes()
        assert rec["size"] == len(data) and rec["revision"] == COMMIT, rel
        assert rec["sha256"] == hashlib.sha256(data).hexdigest() == staged.sha256[rel], rel
    assert body["files"][f"model/{SHARD}"]["verified_by"] == "lfs-sha256"
    assert body["files"]["model/config.json"]["verified_by"] == "git-blob-id"
    assert staged.manifest_file == f"/host/root/{sw.MANIFEST_FILE}"


def test_a_run_that_stages_nothing_leaves_every_file_on_the_head_untouched(hub: FakeHub, tmp_path: Path) -> None:
    # The record included: `destroy` then `up` must not touch the weights root (the lifecycle e2e checks it).
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    hub.requests.clear()
    assert run_stage(hub, root).returncode == 0
    assert not hub.gets_of(".safetensors")
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == before


def test_same_name_same_size_file_of_another_revision_is_downloaded_again(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    old = hub.repos[MODEL_REPO][SHARD]
    new = bytes(b ^ 0x55 for b in old)  # same name, same size, other content
    hub.repos[MODEL_REPO][SHARD] = new
    hub.repos[MODEL_REPO]["config.json"] = b'{"model_type":"deepseek_v42"}'  # non-LFS, same size
    assert len(hub.repos[MODEL_REPO]["config.json"]) == len(b'{"model_type":"deepseek_v41"}')
    hub.commit = NEW_COMMIT
    hub.requests.clear()
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fetched = sorted(p.rsplit("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p)
    assert fetched == sorted([SHARD, "config.json"]), "exactly the files whose content changed are fetched again"
    assert (root / "model" / SHARD).read_bytes() == new
    rec = records(root)["files"]
    assert rec[f"model/{SHARD}"]["revision"] == NEW_COMMIT
    assert rec[f"model/{SHARD}"]["sha256"] == hashlib.sha256(new).hexdigest()
    assert rec["model/tokenizer.json"]["revision"] == NEW_COMMIT, "unchanged content is now also of the new commit"


def test_content_that_does_not_match_the_hubs_sha256_is_not_kept(hub: FakeHub, tmp_path: Path) -> None:
    hub.listed_sha256[(MODEL_REPO, SHARD)] = "0" * 64
    root = tmp_path / "root"
    proc = run_stage(hub, root)
    assert proc.returncode == 1
    line = error_line(proc)
    assert SHARD in line and "sha256" in line and "0" * 64 in line and "not kept" in line
    assert not (root / "model" / SHARD).exists(), "an unverified download never takes the file's place"
    assert not list((root / "model").glob(f".*{sw.PARTIAL_SUFFIX}")), "nor is its partial copy left behind"


def test_file_removed_upstream_that_staging_recorded_is_removed(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    del hub.repos[MODEL_REPO]["quantization_config.json"]
    hub.commit = NEW_COMMIT
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (root / "model" / "quantization_config.json").exists(), "a file of the old revision stayed"
    assert "model/quantization_config.json" not in records(root)["files"]
    assert "model/quantization_config.json removed: staged for" in proc.stderr


def test_file_staging_did_not_record_is_refused_not_deleted(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "model").mkdir(parents=True)
    (root / "model" / "generation_config.json").write_text("{}")  # someone else's, or an old version's
    proc = run_stage(hub, root)
    assert proc.returncode == 1
    line = error_line(proc)
    assert "generation_config.json" in line and "did not stage" in line and "not deleted" in line
    assert (root / "model" / "generation_config.json").read_text() == "{}"
    assert not hub.gets_of(".safetensors"), "refused before any download"


def test_unrecorded_copy_is_hashed_once_and_replaced_only_when_it_differs(hub: FakeHub, tmp_path: Path) -> None:
    """A root staged before records existed: files of the listed size are read once and kept if they match."""
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    (root / sw.MANIFEST_FILE).unlink()
    target = root / "model" / SHARD
    target.write_bytes(bytes(b ^ 0x55 for b in target.read_bytes()))  # same size, wrong content
    hub.requests.clear()
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fetched = [p.rsplit("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert fetched == [SHARD], "only the copy whose sha256 differs from the hub's is downloaded"
    assert target.read_bytes() == hub.repos[MODEL_REPO][SHARD]
    assert proc.stderr.count("present (hashed once: no record)") == 45
    assert set(records(root)["files"]) == set(wm.parse_stage_output(proc.stdout).files)


def test_hashing_writer_follows_the_clients_resume_and_restart() -> None:
    import io

    data = b"0123456789" * 7
    digests = sw._Digests(len(data))
    w = sw.HashingWriter(io.BytesIO(), digests)  # type: ignore[arg-type]
    w.write(b"garbage from a server that ignored Range")
    w.seek(0)
    w.truncate()
    w.write(data[:30])
    w.write(data[30:])  # resumed after a dropped connection: appended
    assert digests.sha256.hexdigest() == hashlib.sha256(data).hexdigest()
    assert digests.git.hexdigest() == git_blob_id(data)
    with pytest.raises(OSError, match="first byte"):
        w.seek(10)


# --- count rules (pure) ----------------------------------------------------------------------------


def test_include_pitfall_only_last_shard_present_fails(tmp_path: Path) -> None:
    """`hf download --include a b` keeps only the last file: the required-shard rule must catch it."""
    (tmp_path / wm.engram_shard_name(48)).write_bytes(b"x" * 4)
    sizes = {wm.engram_shard_name(47): 4, wm.engram_shard_name(48): 4}
    with pytest.raises(sw.StageError, match=wm.engram_shard_name(47)):
        sw.check_required_present(ENGRAM_REPO, tmp_path, sizes, sizes)


def test_safetensors_count_ignores_subfolders_and_other_files() -> None:
    names = [f"s{i}.safetensors" for i in range(39)] + ["sub/x.safetensors", "config.json"]
    assert sw.count_safetensors(names) == 39
    sw.check_safetensors_count("r", "here", names, 39)
    with pytest.raises(sw.StageError, match="has 40 .*exactly 39"):
        sw.check_safetensors_count("r", "here", [*names, "extra.safetensors"], 39)


def test_index_with_foreign_shard_name_fails() -> None:
    weight_map = {f"w{i}": wm.engram_shard_name(i) for i in range(1, 48)} | {"x": "model-00048-of-00049.safetensors"}
    with pytest.raises(sw.StageError, match="unexpected: model-00048-of-00049"):
        sw.check_index("r", {"weight_map": weight_map}, 48)
    sw.check_index("r", {"weight_map": {f"w{i}": wm.engram_shard_name(i) for i in range(1, 49)}}, 48)
