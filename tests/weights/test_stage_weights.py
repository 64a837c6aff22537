"""The staging program (`components/weights/staging/`, shipped as stage_weights.pyz), run for real against a local
hub: what it fetches, keeps, records and refuses, and its count rules."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from components.weights import manifest as wm
from components.weights.staging.digests import DownloadStopped, HashingWriter, _Digests, digests_for
from components.weights.staging.download import partial_path
from components.weights.staging.hub import unsafe_path
from components.weights.staging.messages import StageError
from components.weights.staging.page_cache import PageCacheDrop, drop_page_cache, report_page_cache
from components.weights.staging.plan import (
    HubFile,
    check_index,
    check_required_present,
    check_safetensors_count,
    count_safetensors,
    plan_streams,
)
from components.weights.staging.progress import Progress, format_duration, format_progress, progress_interval
from components.weights.staging.record import MANIFEST_FILE, PARTIAL_SUFFIX
from tests.support.page_cache import cached_files, resident_pages, warm
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
    slim = {f"engram-vllm/{n}": (root / "engram-vllm" / n).stat().st_size for n in _slim_names()}
    assert staged.files == {**model_files, **engram_files, **slim}, (
        "manifest must be every model file + the 4 engram files + the slim Engram directory's 4"
    )
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
    assert proc.stderr.count("present (recorded) [") == staged - 4 == 46, "the records decide; no file is read again"


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
    assert unsafe_path(name) is None


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


def _slim_names() -> list[str]:
    return [wm.engram_shard_name(47), wm.engram_shard_name(48), "config.json", wm.ENGRAM_INDEX]


def _downloaded(files: dict[str, int]) -> set[str]:
    """The staged files fetched from the hub: all but the slim Engram directory's (derived from them)."""
    return {rel for rel in files if not rel.startswith("engram-vllm/")}


# --- content verified by the hub's ids, recorded on the head (issue 12, item 6) ----------------------

SHARD = "model-00005-of-00039.safetensors"
NEW_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def records(root: Path) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((root / MANIFEST_FILE).read_text())
    return body


def test_staging_records_name_size_sha256_and_revision_on_the_head(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged = wm.parse_stage_output(proc.stdout)
    body = records(root)
    assert body["format"] == 1 and set(body["files"]) == _downloaded(staged.files), "one record per staged file"
    assert body["repos"]["model"] == {"repo": MODEL_REPO, "revision": "main", "commit": COMMIT}
    for rel, rec in body["files"].items():
        data = (root / rel).read_bytes()
        assert rec["size"] == len(data) and rec["revision"] == COMMIT, rel
        assert rec["sha256"] == hashlib.sha256(data).hexdigest() == staged.sha256[rel], rel
    assert body["files"][f"model/{SHARD}"]["verified_by"] == "lfs-sha256"
    assert body["files"]["model/config.json"]["verified_by"] == "git-blob-id"
    assert staged.manifest_file == f"/host/root/{MANIFEST_FILE}"


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
    assert not list((root / "model").glob(f".*{PARTIAL_SUFFIX}")), "nor is its partial copy left behind"


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
    (root / MANIFEST_FILE).unlink()
    target = root / "model" / SHARD
    target.write_bytes(bytes(b ^ 0x55 for b in target.read_bytes()))  # same size, wrong content
    hub.requests.clear()
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fetched = [p.rsplit("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert fetched == [SHARD], "only the copy whose sha256 differs from the hub's is downloaded"
    assert target.read_bytes() == hub.repos[MODEL_REPO][SHARD]
    assert proc.stderr.count("present (hashed once: no record)") == 45
    assert set(records(root)["files"]) == _downloaded(wm.parse_stage_output(proc.stdout).files)


def test_hashing_writer_follows_the_clients_resume_and_restart() -> None:
    import io

    data = b"0123456789" * 7
    digests = _Digests(len(data))
    w = HashingWriter(io.BytesIO(), digests)
    w.write(b"garbage from a server that ignored Range")
    w.seek(0)
    w.truncate()
    w.write(data[:30])
    w.write(data[30:])  # resumed after a dropped connection: appended
    assert digests.sha256.hexdigest() == hashlib.sha256(data).hexdigest()
    assert digests.git is not None and digests.git.hexdigest() == git_blob_id(data)
    with pytest.raises(OSError, match="first byte"):
        w.seek(10)


# --- count rules (pure) ----------------------------------------------------------------------------


def test_include_pitfall_only_last_shard_present_fails(tmp_path: Path) -> None:
    """`hf download --include a b` keeps only the last file: the required-shard rule must catch it."""
    (tmp_path / wm.engram_shard_name(48)).write_bytes(b"x" * 4)
    sizes = {wm.engram_shard_name(47): 4, wm.engram_shard_name(48): 4}
    with pytest.raises(StageError, match=wm.engram_shard_name(47)):
        check_required_present(ENGRAM_REPO, tmp_path, sizes, sizes)


def test_safetensors_count_ignores_subfolders_and_other_files() -> None:
    names = [f"s{i}.safetensors" for i in range(39)] + ["sub/x.safetensors", "config.json"]
    assert count_safetensors(names) == 39
    check_safetensors_count("r", "here", names, 39)
    with pytest.raises(StageError, match="has 40 .*exactly 39"):
        check_safetensors_count("r", "here", [*names, "extra.safetensors"], 39)


def test_index_with_foreign_shard_name_fails() -> None:
    weight_map = {f"w{i}": wm.engram_shard_name(i) for i in range(1, 48)} | {"x": "model-00048-of-00049.safetensors"}
    with pytest.raises(StageError, match="unexpected: model-00048-of-00049"):
        check_index("r", {"weight_map": weight_map}, 48)
    check_index("r", {"weight_map": {f"w{i}": wm.engram_shard_name(i) for i in range(1, 49)}}, 48)


# --- several files at once, resumable, with progress (issue 23, item 9) -------------------------------


def _on_disk(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST_FILE and not p.name.endswith(PARTIAL_SUFFIX)
    }


def _stage_lines(proc: Any) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("stage_weights: ")]


def test_downloads_overlap_and_never_exceed_download_streams(hub: FakeHub, tmp_path: Path) -> None:
    # The first downloads wait at the hub until one more than the streams is being served (10 s at most): four
    # streams reach four at once, and a fifth must never come while those four are held.
    hub.hold_until = 5
    proc = run_stage(hub, tmp_path / "root", streams=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.max_in_flight == 4, (
        f"with downloadStreams 4 the hub must serve exactly 4 downloads at once at most, saw {hub.max_in_flight}"
    )
    assert len(_downloaded(wm.parse_stage_output(proc.stdout).files)) == 46


def test_a_plan_without_a_stream_count_downloads_one_file_at_a_time(hub: FakeHub, tmp_path: Path) -> None:
    hub.hold_until = 2  # never reached one at a time: the first download waits 10 s, then none does
    proc = run_stage(hub, tmp_path / "root")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.max_in_flight == 1, "callers that render no download_streams keep the old behaviour"


def test_a_failing_file_leaves_the_finished_ones_recorded_and_is_the_one_error(hub: FakeHub, tmp_path: Path) -> None:
    bad = "model-00012-of-00039.safetensors"
    hub.unresolvable.add((MODEL_REPO, bad))
    hub.delay_s[(MODEL_REPO, bad)] = 1.0  # the others finish meanwhile
    root = tmp_path / "root"
    proc = run_stage(hub, root, streams=4)
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("stage_weights: error:")]
    assert len(errors) == 1 and bad in errors[0] and "404" in errors[0], errors
    assert _stage_lines(proc)[-1] == errors[0], "the error comes after every other file has stopped or finished"
    recorded = records(root)["files"]
    finished = _on_disk(root)
    assert finished and set(recorded) == finished, "every file in place is recorded, and only those"
    for rel in finished:
        assert recorded[rel]["sha256"] == hashlib.sha256((root / rel).read_bytes()).hexdigest(), rel
    assert f"model/{bad}" not in finished

    hub.unresolvable.clear()
    hub.requests.clear()
    proc = run_stage(hub, root, streams=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dest = {MODEL_REPO: "model", ENGRAM_REPO: "engram-src"}
    fetched = {
        f"{dest['/'.join(parts[:2])]}/{'/'.join(parts[4:])}"
        for m, p, _ in hub.requests
        if m == "GET" and "/resolve/" in p and (parts := p.strip("/").split("/"))
    }
    planned = _downloaded(wm.parse_stage_output(proc.stdout).files)
    assert fetched == planned - finished, "the re-run fetches exactly what the failed run had not finished"


BIG = 24 << 20  # more than the client's 10 MiB write chunk, so a stopped download has bytes on disk


def test_a_download_stopped_by_another_files_failure_is_resumed_from_its_kept_bytes(
    hub: FakeHub, tmp_path: Path
) -> None:
    big = bytes(range(256)) * (BIG // 256)
    hub.repos[MODEL_REPO][SHARD] = big
    hub.pace[(MODEL_REPO, SHARD)] = 8 << 20  # 3 s for the whole file, its first 10 MiB written at 1.25 s
    bad = "model-00012-of-00039.safetensors"
    hub.unresolvable.add((MODEL_REPO, bad))
    hub.delay_s[(MODEL_REPO, bad)] = 1.9  # fails while the big file is between its first and last write
    root = tmp_path / "root"
    proc = run_stage(hub, root, streams=4)
    assert proc.returncode == 1
    assert bad in error_line(proc)
    (partial,) = (root / "model").glob(f".{SHARD}.*{PARTIAL_SUFFIX}")
    kept = partial.stat().st_size
    assert 0 < kept < BIG, f"the stopped download keeps what it had written, {kept} bytes"
    assert partial.read_bytes() == big[:kept]
    assert f"model/{SHARD} stopped (another file failed); its {kept} bytes are kept" in proc.stderr
    assert not (root / "model" / SHARD).exists() and f"model/{SHARD}" not in records(root)["files"]

    hub.unresolvable.clear()
    del hub.pace[(MODEL_REPO, SHARD)]
    hub.ranges.clear()
    proc = run_stage(hub, root, streams=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.ranges[SHARD] == [f"bytes={kept}-"], "the next run asks only for the bytes it lacks"
    assert f"resuming after the {kept} bytes an earlier run downloaded (hashed again)" in proc.stderr
    assert (root / "model" / SHARD).read_bytes() == big
    assert records(root)["files"][f"model/{SHARD}"]["sha256"] == hashlib.sha256(big).hexdigest()
    assert not list((root / "model").glob(f".*{PARTIAL_SUFFIX}"))


def test_a_kept_partial_with_a_wrong_byte_is_refused_then_fetched_whole(hub: FakeHub, tmp_path: Path) -> None:
    """The kept bytes are hashed again, so a partial damaged on disk fails the check: never moved into place."""
    data = hub.repos[MODEL_REPO][SHARD]
    root = tmp_path / "root"
    listed = HubFile(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    partial = partial_path(root / "model" / SHARD, listed)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(bytes([data[0] ^ 1]) + data[1:8])
    stale = root / "model" / f".{SHARD}.{'f' * 16}{PARTIAL_SUFFIX}"  # of other content: never resumed
    stale.write_bytes(data[:8])
    proc = run_stage(hub, root, streams=8)
    assert proc.returncode == 1
    line = error_line(proc)
    assert SHARD in line and "sha256" in line and "not kept" in line, line
    assert hub.ranges[SHARD] == ["bytes=8-"]
    assert not partial.exists() and not stale.exists() and not (root / "model" / SHARD).exists()
    proc = run_stage(hub, root, streams=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.ranges[SHARD] == ["bytes=8-", None], "fetched whole the second time"
    assert (root / "model" / SHARD).read_bytes() == data


def test_a_corrupted_byte_is_refused_while_other_files_download(hub: FakeHub, tmp_path: Path) -> None:
    hub.corrupt.add((MODEL_REPO, SHARD))
    root = tmp_path / "root"
    proc = run_stage(hub, root, streams=8)
    assert proc.returncode == 1
    line = error_line(proc)
    assert SHARD in line and hashlib.sha256(hub.repos[MODEL_REPO][SHARD]).hexdigest() in line and "not kept" in line
    assert not (root / "model" / SHARD).exists()
    assert not list((root / "model").glob(f".{SHARD}*")), "its partial copy is not kept either"
    assert f"model/{SHARD}" not in records(root)["files"]


def test_a_run_prints_progress_with_bytes_rate_streams_and_files(hub: FakeHub, tmp_path: Path) -> None:
    proc = run_stage(hub, tmp_path / "root", streams=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("stage_weights: progress ")]
    assert progress, proc.stderr[-2000:]
    total = sum(len(hub.repos[MODEL_REPO][n]) for n in hub.repos[MODEL_REPO]) + sum(
        len(hub.repos[ENGRAM_REPO][n])
        for n in [wm.engram_shard_name(47), wm.engram_shard_name(48), wm.ENGRAM_INDEX, "config.json"]
    )
    assert progress[-1].startswith(f"stage_weights: progress {total / 1024:.1f}/{total / 1024:.1f} KiB (100.0%), ")
    assert progress[-1].endswith(", 0/8 streams, 46/46 files") and " took " in progress[-1], progress[-1]


def test_a_run_with_nothing_to_fetch_prints_no_progress(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_stage(hub, root, streams=8).returncode == 0
    proc = run_stage(hub, root, streams=8)
    assert proc.returncode == 0 and "stage_weights: progress" not in proc.stderr


def test_hashing_writer_stops_before_hashing_or_writing_a_chunk() -> None:
    import io
    import threading

    stop = threading.Event()
    data = b"abcdef"
    digests = _Digests(len(data))
    out = io.BytesIO()
    w = HashingWriter(out, digests, stop=stop)
    w.write(data[:3])
    stop.set()
    with pytest.raises(DownloadStopped):
        w.write(data[3:])
    assert out.getvalue() == data[:3] and digests.sha256.hexdigest() == hashlib.sha256(data[:3]).hexdigest()


def test_an_lfs_file_is_identified_by_sha256_alone() -> None:
    data = b"x" * 100
    lfs = digests_for(HubFile(size=100, sha256=hashlib.sha256(data).hexdigest(), blob_id="0" * 40))
    small = digests_for(HubFile(size=100, blob_id=git_blob_id(data)))
    for d in (lfs, small):
        d.update(data)
    assert lfs.git is None and lfs.mismatch(HubFile(size=100, sha256=hashlib.sha256(data).hexdigest())) is None
    assert small.mismatch(HubFile(size=100, blob_id=git_blob_id(data))) is None
    assert "git blob id" in str(small.mismatch(HubFile(size=100, blob_id="1" * 40)))


@pytest.mark.parametrize("bad", [0, 65, -1, "8", True, 2.0])
def test_a_plan_with_a_stream_count_out_of_range_is_refused(bad: Any) -> None:
    with pytest.raises(StageError, match=r"download_streams=.* from 1 to 64; set weights.downloadStreams"):
        plan_streams({"download_streams": bad})
    assert plan_streams({}) == 1 and plan_streams({"download_streams": 8}) == 8


# --- progress (pure) ---------------------------------------------------------------------------------

GiB, MiB = 1 << 30, 1 << 20


def test_progress_line_shows_bytes_percent_rate_eta_streams_and_files() -> None:
    line = format_progress(
        done_bytes=int(12.3 * GiB),
        total_bytes=387 * GiB,
        rate=410 * MiB,
        active=8,
        streams=8,
        files_done=3,
        files_total=41,
    )
    # (387 - 12.3) GiB at 410 MiB/s: 935.8 s
    assert line == "progress 12.3/387.0 GiB (3.2%), 410 MiB/s, ETA 15m36s, 8/8 streams, 3/41 files"


def test_progress_line_units_follow_the_total_and_the_end_says_how_long() -> None:
    kib = format_progress(done_bytes=512, total_bytes=2048, rate=0.0, active=1, streams=8, files_done=0, files_total=4)
    assert kib == "progress 0.5/2.0 KiB (25.0%), 0.0 KiB/s, ETA -, 1/8 streams, 0/4 files"
    end = format_progress(
        done_bytes=300 * MiB,
        total_bytes=300 * MiB,
        rate=2.5 * GiB,
        active=0,
        streams=8,
        files_done=4,
        files_total=4,
        elapsed_s=7300,
    )
    assert end == "progress 300.0/300.0 MiB (100.0%), 2.5 GiB/s, took 2h01m, 0/8 streams, 4/4 files"
    assert "ETA 0s" in format_progress(
        done_bytes=1, total_bytes=1, rate=0.0, active=0, streams=1, files_done=1, files_total=1
    )
    assert "(100.0%)" in format_progress(
        done_bytes=0, total_bytes=0, rate=0.0, active=0, streams=1, files_done=0, files_total=0
    )


@pytest.mark.parametrize(
    ("seconds", "shown"), [(0, "0s"), (59.4, "59s"), (60, "1m00s"), (3599, "59m59s"), (3600, "1h00m")]
)
def test_durations_are_short(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown


def test_progress_lines_come_every_5_s_then_every_30_s_after_10_minutes() -> None:
    assert progress_interval(0) == progress_interval(599) == 5.0
    assert progress_interval(600) == progress_interval(36000) == 30.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_counts_present_files_as_done_but_not_in_the_rate() -> None:
    clock = FakeClock()
    p = Progress(total_bytes=1000 * MiB, total_files=4, streams=2, clock=clock)
    assert p.present(400 * MiB) == 1  # staged by an earlier run
    t = p.start()
    t.kept(100 * MiB)  # a partial an earlier run left
    clock.now += 10
    t.wrote(100 * MiB)
    assert p.line() == "progress 600.0/1000.0 MiB (60.0%), 10.0 MiB/s, ETA 40s, 1/2 streams, 1/4 files"
    t.restart()  # the server ignored Range: the file starts over
    assert p.done_bytes == 400 * MiB
    t.wrote(50 * MiB)
    assert t.finish(200 * MiB) == 2 and p.done_bytes == 600 * MiB and p.active == 0
    u = p.start()
    u.wrote(10 * MiB)
    u.abandon()  # failed: its bytes are not staged
    assert p.done_bytes == 600 * MiB and p.active == 0 and p.files_done == 2
    clock.now += 10
    assert p.line(final=True) == "progress 600.0/1000.0 MiB (60.0%), 8.0 MiB/s, took 20s, 0/2 streams, 2/4 files"


def test_the_rate_follows_the_last_30_seconds() -> None:
    clock = FakeClock()
    p = Progress(total_bytes=10 * GiB, total_files=1, streams=1, clock=clock)
    t = p.start()
    for _ in range(12):  # 60 s at 100 MiB/s, a line every 5 s
        clock.now += 5
        t.wrote(500 * MiB)
        p.line()
    for _ in range(6):  # then 30 s at 10 MiB/s
        clock.now += 5
        t.wrote(50 * MiB)
        last = p.line()
    assert ", 10.0 MiB/s, " in last, last


# --- the page cache after staging ---------------------------------------------------------------------------
# The GB10 driver allocates the ranks' memory from free memory and does not reclaim page cache; staging writes
# hundreds of GiB just before the ranks start. Residency is read with mincore(2) (tests/support/page_cache.py).


def unique_files(root: Path) -> dict[tuple[int, int], int]:
    """Every file under `root` once (a hard link shares its pages): (device, inode) -> size."""
    return {(s.st_dev, s.st_ino): s.st_size for s in (p.stat() for p in root.rglob("*") if p.is_file())}


def test_staging_leaves_no_page_of_the_files_it_wrote_in_the_page_cache(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged = wm.parse_stage_output(proc.stdout)
    assert cached_files(root) == {}, "every staged file's pages, just written (dirty ones too), must be dropped"
    inodes = unique_files(root)
    assert staged.page_cache == wm.PageCacheDropped(files=len(inodes), bytes=sum(inodes.values()), failed=0), (
        "every file under the root once: the staged ones, the slim Engram directory's index, the record"
    )
    assert len(inodes) == 48, "46 staged, the slim index (its other files are hard links), the record"
    assert f"page cache: dropped the pages of 48 files ({staged.page_cache.bytes / 2**30:.2f} GiB)" in proc.stderr


def test_a_run_that_stages_nothing_still_drops_the_pages_of_files_already_present(hub: FakeHub, tmp_path: Path) -> None:
    # A re-run (the weights staged by an earlier up, read since: a boot, a hash check) downloads nothing.
    root = tmp_path / "root"
    assert run_stage(hub, root).returncode == 0
    shard = root / "model" / SHARD
    assert warm(shard) > 0, "precondition: a file read is in the page cache"
    hub.requests.clear()
    proc = run_stage(hub, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not hub.gets_of(".safetensors")
    assert cached_files(root) == {}
    staged = wm.parse_stage_output(proc.stdout)
    assert staged.page_cache is not None and staged.page_cache.files == len(unique_files(root))


def test_the_drop_covers_every_directory_under_the_root_and_each_hard_link_once(tmp_path: Path) -> None:
    # A directory built from the staged files (hard links: the same pages) is dropped with them, counted once.
    root = tmp_path / "root"
    (root / "engram-src").mkdir(parents=True)
    shard = root / "engram-src" / "model-00047-of-00048.safetensors"
    shard.write_bytes(os.urandom(3 << 20))
    (root / "engram-slim").mkdir()
    os.link(shard, root / "engram-slim" / shard.name)
    (root / "engram-slim" / "config.json").write_bytes(b'{"a": 1}\n')
    for path in (shard, root / "engram-slim" / "config.json"):
        assert warm(path) > 0
    dropped = drop_page_cache(root)
    assert dropped == PageCacheDrop(files=2, bytes=(3 << 20) + 9, failed=())
    assert cached_files(root) == {}


def test_the_drop_follows_no_link_out_of_the_root_and_opens_no_fifo(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(os.urandom(1 << 20))
    root = tmp_path / "root"
    (root / "model").mkdir(parents=True)
    (root / "model" / "linked.bin").symlink_to(outside)
    (root / "model-dir-link").symlink_to(tmp_path)
    os.mkfifo(root / "model" / "a-fifo")  # an open without O_NONBLOCK would wait for a writer forever
    assert warm(outside) > 0
    dropped = drop_page_cache(root)
    assert dropped == PageCacheDrop(files=0, bytes=0, failed=())
    assert resident_pages(outside) > 0, "a file outside the root is not staging's to advise"


def test_a_file_that_cannot_be_advised_is_named_and_the_others_are_still_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    (root / "model").mkdir(parents=True)
    for name in ("a.safetensors", "b.safetensors"):
        (root / "model" / name).write_bytes(os.urandom(1 << 20))
    refused = (root / "model" / "a.safetensors").stat().st_ino
    advise = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if os.fstat(fd).st_ino == refused:
            raise OSError(5, "Input/output error")
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    dropped = drop_page_cache(root)
    assert dropped.files == 1 and dropped.bytes == 1 << 20
    assert dropped.failed == (f"{root}/model/a.safetensors: Input/output error",)
    assert resident_pages(root / "model" / "b.safetensors") == 0
    report_page_cache(dropped, Path("/host/root"))
    err = capsys.readouterr().err
    assert "page cache: 1 files not dropped (" in err and "a.safetensors: Input/output error" in err
    assert "the ranks check MemAvailable before they start" in err
    assert dropped.to_json() == {"files": 1, "bytes": 1 << 20, "failed": 1}


@pytest.mark.parametrize("program", ["stage_weights", "copy_weights"])
def test_a_filesystem_that_cannot_sync_a_read_only_descriptor_still_takes_the_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, program: str
) -> None:
    # Both shipped programs keep their own copy of the drop (each is sent to its node alone): the same rule.
    import errno

    from components.weights import copy_weights as cw

    shard = tmp_path / "model" / "a.safetensors"
    shard.parent.mkdir()
    shard.write_bytes(os.urandom(1 << 20))
    os.sync()
    assert warm(shard) > 0

    def no_sync(fd: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fdatasync", no_sync)  # the one os module both programs call
    if program == "stage_weights":
        assert drop_page_cache(tmp_path) == PageCacheDrop(files=1, bytes=1 << 20, failed=())
    else:
        assert cw.drop_page_cache([shard]) == ({"files": 1, "bytes": 1 << 20, "failed": 0}, [])
    assert resident_pages(shard) == 0
