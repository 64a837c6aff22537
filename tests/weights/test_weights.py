"""Weight store: the staging plan, the staging script against a local hub stand-in, the check scripts, and
the WeightStore component under Pulumi mocks.

The staging script runs for real with the venv's python (standing in for the container's python3) and the
real huggingface_hub client against an http.server on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from components.weights import local_copy as lc
from components.weights import manifest as wm
from components.weights import stage_weights as sw
from tests.support.fake_docker import install_fake_docker as _fake_docker
from tests.support.scripts import header_value

PYTHON = sys.executable  # the venv's python: stands for the staging container's python3
SCRIPT = Path(wm.__file__).with_name("stage_weights.py")
MODEL_REPO = "Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw"
ENGRAM_REPO = "deepseek-ai/DeepSeek-V4.1-Flash"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_SECRETtokenVALUE123"
PREFIX = "dsv41-exl3-dev"


# --- a local hub stand-in --------------------------------------------------------------------------


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
        f"size {len(data)}\n".encode()
    )


@dataclass
class FakeHub:
    """The hub's API shape: tree entries carry `oid` (git blob id; of the pointer for LFS files) and, for
    LFS files (*.safetensors here), `lfs: {oid: sha256, size, pointerSize}`; model info names the commit."""

    repos: dict[str, dict[str, bytes]]
    listed_size: dict[tuple[str, str], int] = field(default_factory=dict)  # tree lies about a size
    listed_sha256: dict[tuple[str, str], str] = field(default_factory=dict)  # tree lies about a content id
    unresolvable: set[tuple[str, str]] = field(default_factory=set)  # listed, but resolve says 404
    commit: str = COMMIT  # what every revision resolves to; a test moves it to make a new revision
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, auth)
    url: str = ""

    def gets_of(self, suffix: str) -> list[str]:
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p and p.endswith(suffix)]

    def entry(self, repo: str, name: str, data: bytes) -> dict[str, Any]:
        size = self.listed_size.get((repo, name), len(data))
        if not name.endswith(".safetensors"):
            return {"type": "file", "path": name, "oid": git_blob_id(data), "size": size}
        sha = self.listed_sha256.get((repo, name), hashlib.sha256(data).hexdigest())
        pointer = lfs_pointer(data)
        return {
            "type": "file",
            "path": name,
            "oid": git_blob_id(pointer),
            "size": size,
            "lfs": {"oid": sha, "size": size, "pointerSize": len(pointer)},
        }


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def _send(
            self, code: int, body: bytes = b"", headers: dict[str, str] | None = None, send_body: bool = True
        ) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def _route(self, send_body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Authorization")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                repo = f"{parts[2]}/{parts[3]}"
                if repo not in hub.repos:
                    self._send(
                        404,
                        b'{"error":"Repository not found"}',
                        {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"},
                    )
                    return
                tree = [hub.entry(repo, name, data) for name, data in sorted(hub.repos[repo].items())]
                self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
                return
            if parts[:2] == ["api", "models"] and len(parts) in (4, 6):
                repo = f"{parts[2]}/{parts[3]}"
                if repo not in hub.repos:
                    self._send(
                        404,
                        b'{"error":"Repository not found"}',
                        {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"},
                    )
                    return
                info = {
                    "id": repo,
                    "modelId": repo,
                    "sha": hub.commit,
                    "private": False,
                    "siblings": [{"rfilename": n} for n in sorted(hub.repos[repo])],
                }
                self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
                return
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, name = f"{parts[0]}/{parts[1]}", "/".join(parts[4:])
                data = hub.repos.get(repo, {}).get(name)
                if data is None or (repo, name) in hub.unresolvable:
                    self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"}, send_body)
                    return
                etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else git_blob_id(data)
                self._send(
                    200,
                    data,
                    {"X-Repo-Commit": hub.commit, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"},
                    send_body,
                )
                return
            self._send(404, b"not found", {}, send_body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._route(send_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._route(send_body=False)

    return Handler


def small_checkpoint() -> dict[str, dict[str, bytes]]:
    """39 tiny EXL3 shards + side files; the base repo has all 48 shards and an index naming them."""
    model = {f"model-{i:05d}-of-00039.safetensors": f"exl3 shard {i}".encode() * (i % 5 + 1) for i in range(1, 40)}
    model.update(
        {
            "config.json": b'{"model_type":"deepseek_v41"}',
            "tokenizer.json": b'{"t":1}',
            "quantization_config.json": b'{"bits":2.9}',
        }
    )
    index = {"metadata": {}, "weight_map": {f"layer.{i}.w": wm.engram_shard_name(i) for i in range(1, 49)}}
    engram = {wm.engram_shard_name(i): f"base shard {i}".encode() * 3 for i in range(1, 49)}
    engram.update(
        {wm.ENGRAM_INDEX: json.dumps(index).encode(), "config.json": b'{"model_type":"base"}', "README.md": b"# base"}
    )
    return {MODEL_REPO: model, ENGRAM_REPO: engram}


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    fake = FakeHub(repos=small_checkpoint())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()


def hub_env(hub: FakeHub, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k != "HF_TOKEN"}
    env.update(
        {
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(home),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "NO_PROXY": "*",
            "HF_HUB_ETAG_TIMEOUT": "5",
            "HF_HUB_DOWNLOAD_TIMEOUT": "10",
        }
    )
    return env


def run_stage(
    hub: FakeHub, root: Path, token: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """stage_weights.py as the container runs it: the token line (empty: anonymous) on stdin."""
    plan = wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="main")
    return subprocess.run(
        [PYTHON, str(SCRIPT), "--plan", json.dumps(plan), "--dest-root", str(root), "--host-root", "/host/root"],
        env={**hub_env(hub, root.parent / "hf-home"), **(env or {})},
        input=f"{token or ''}\n",
        capture_output=True,
        text=True,
        timeout=120,
    )


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stage_weights: error:")]
    assert lines, f"expected a one-line error, stderr was:\n{proc.stderr[-3000:]}"
    return lines[-1]


# --- the staging script, for real ------------------------------------------------------------------


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


def test_plan_selects_every_model_file_and_four_engram_files() -> None:
    plan = wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="main")
    model, engram = (sw.RepoPlan.from_json(r) for r in plan["repos"])
    assert (model.dest, model.files, model.safetensors_count) == ("model", None, 39)
    assert engram.dest == "engram-src"
    assert engram.files == tuple(
        sorted(
            [
                "model-00047-of-00048.safetensors",
                "model-00048-of-00048.safetensors",
                "model.safetensors.index.json",
                "config.json",
            ]
        )
    )
    assert (engram.index_file, engram.index_shard_total) == ("model.safetensors.index.json", 48)
    assert engram.required_shards == ("model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors")


def test_plan_rejects_bad_repo_and_revision() -> None:
    with pytest.raises(ValueError, match="model_repo='nope'"):
        wm.staging_plan(model_repo="nope", engram_repo=ENGRAM_REPO, revision="main")
    with pytest.raises(ValueError, match="revision=''"):
        wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="")


# --- rendering and parsing (pure) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("root", "expected"),
    [
        ("~/dsv41-exl3", '"$HOME"/dsv41-exl3'),
        ("~", '"$HOME"'),
        ("~/a b/", "\"$HOME\"/'a b'"),
        ("/srv/w", "/srv/w"),
    ],
)
def test_root_expands_tilde_on_the_node(root: str, expected: str) -> None:
    assert wm.root_shell_expr(root) == expected
    out = subprocess.run(
        ["sh", "-c", f"printf %s {wm.root_shell_expr(root)}"],
        capture_output=True,
        text=True,
        env={"HOME": "/home/remote", "PATH": os.environ["PATH"]},
        check=True,
    ).stdout
    assert out == root.replace("~", "/home/remote", 1).rstrip("/") or out == "/srv/w"


@pytest.mark.parametrize("root", ["relative/dir", "~other/x", ""])
def test_root_must_be_absolute_or_home(root: str) -> None:
    with pytest.raises(ValueError, match="must be absolute or start with '~/'"):
        wm.root_shell_expr(root)


def stage_command(**kw: Any) -> str:
    args: dict[str, Any] = {
        "root": "~/dsv41-exl3",
        "image": "img:tag",
        "hf_endpoint": "http://127.0.0.1:9",
        "with_token": True,
        "timeout_s": 7200,
        "stack_prefix": PREFIX,
        "plan": wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="main"),
    }
    args.update(kw)
    return wm.render_stage_command(**args)


@dataclass
class Logged:
    """What a rendered script ran, with docker and timeout stand-ins on PATH: one `timeout ...` / `docker ...`
    line per call (argv joined by spaces), HF_TOKEN as each `docker run` saw it, the whole environment of
    each `docker run`, and what it read on stdin."""

    proc: subprocess.CompletedProcess[str]
    argv: list[str]
    docker_env: list[str]
    docker_stdin: str
    docker_environ: str

    def line(self, start: str) -> str:
        found = [ln for ln in self.argv if ln.startswith(start)]
        assert len(found) == 1, f"expected one call starting {start!r}, got {self.argv}"
        return found[0]


def run_logged(cmd: str, tmp_path: Path, stdin: str = "", home: Path | None = None) -> Logged:
    bin_dir, log, env_log, stdin_log = tmp_path / "log-bin", tmp_path / "argv", tmp_path / "env", tmp_path / "stdin"
    environ_log = tmp_path / "environ"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (
        (
            "docker",
            f'echo "docker $*" >> {log}\n[ "$1" = run ] || exit 0\n'
            f'echo "HF_TOKEN=${{HF_TOKEN-unset}}" >> {env_log}\nenv >> {environ_log}\n'
            f"cat > {stdin_log}\n",
        ),
        (
            "timeout",
            f'echo "timeout $*" >> {log}\nwhile case "$1" in -*) true;; *) false;; esac; do shift; done\n'
            'shift\nexec "$@"\n',
        ),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / name).chmod(0o755)
    if home is None:
        home = tmp_path / "log-home"
        home.mkdir(exist_ok=True)
    proc = subprocess.run(
        ["sh", "-c", cmd],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home)},
    )
    assert proc.returncode == 0, proc.stderr
    read = lambda p: p.read_text() if p.exists() else ""  # noqa: E731
    return Logged(proc, read(log).splitlines(), read(env_log).splitlines(), read(stdin_log), read(environ_log))


def test_stage_command_gives_the_token_to_the_container_on_stdin_only_and_is_bounded(tmp_path: Path) -> None:
    cmd = stage_command()
    assert "HF_TOKEN=" not in cmd and TOKEN not in cmd and header_value(cmd, "WITH_TOKEN") == "1"
    ran = run_logged(cmd, tmp_path, stdin=wm.stage_stdin(TOKEN, "script"))
    bounded = ran.line("timeout ")
    assert bounded.startswith("timeout --kill-after=60 7200 docker run --rm -i "), bounded
    run = ran.line("docker run ")
    assert " -e HF_TOKEN" not in run and " -e HF_ENDPOINT=http://127.0.0.1:9 " in run, (
        "no `-e HF_TOKEN`: docker would copy it into the container's Config.Env (`docker inspect`)"
    )
    assert all(TOKEN not in line for line in ran.argv), "the token must never be in argv"
    assert ran.docker_env == ["HF_TOKEN=unset"] and TOKEN not in ran.docker_environ, (
        "the token is in no environment docker could pass on"
    )
    assert ran.docker_stdin == f"{TOKEN}\n", "the staging program's stdin is the token line, nothing else"
    assert " --network host " in run and " --entrypoint python3 img:tag /stage/stage_weights.py " in run
    assert " -e HF_HUB_OFFLINE=0 " in run, "the serving image's offline default must not break staging"
    anonymous = stage_command(with_token=False, hf_endpoint=None)
    assert "HF_TOKEN" not in anonymous.split("\n", 1)[0] and header_value(anonymous, "WITH_TOKEN") == "0"
    ran = run_logged(anonymous, _fresh(tmp_path / "anonymous"), stdin=wm.stage_stdin(None, "script"))
    run = ran.line("docker run ")
    assert "HF_TOKEN" not in run and "HF_ENDPOINT" not in run
    assert ran.docker_env == ["HF_TOKEN=unset"] and ran.docker_stdin == "\n", "anonymous: an empty token line"
    with pytest.raises(ValueError, match="stage_timeout_s=0"):
        stage_command(timeout_s=0)


def _fresh(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize(
    ("root", "expected"),
    [("~/dsv41-exl3", "{home}/dsv41-exl3"), ("~/a b/", "{home}/a b"), ("{tmp}/srv/w/", "{tmp}/srv/w")],
)
def test_stage_script_expands_tilde_to_the_remote_home(root: str, expected: str, tmp_path: Path) -> None:
    home = _fresh(tmp_path / "remote-home").resolve()
    cmd = stage_command(root=root.format(tmp=tmp_path))
    ran = run_logged(cmd, tmp_path, stdin=wm.stage_stdin(None, "script"), home=home)
    want = expected.format(home=home, tmp=tmp_path.resolve())
    run = ran.line("docker run ")
    assert f" -v {want}:/weights " in run and f" --host-root {want}" in run, run
    assert (Path(want) / "model").is_dir() and (Path(want) / "engram-src").is_dir()


def test_stage_stdin_is_token_line_then_script() -> None:
    assert wm.stage_stdin(TOKEN, "print(1)\n") == f"{TOKEN}\nprint(1)\n"
    assert wm.stage_stdin(None, "x") == "\nx"
    with pytest.raises(ValueError, match="line break") as err:
        wm.stage_stdin("a\nb", "x")
    assert "a\nb" not in str(err.value)


def test_stage_command_runs_end_to_end_with_token_only_on_stdin(hub: FakeHub, tmp_path: Path) -> None:
    """The rendered shell, with a stand-in docker CLI: token from stdin reaches the hub, never argv."""
    log = tmp_path / "docker-argv.log"
    _fake_docker(tmp_path / "bin", log)
    home = tmp_path / "home"
    home.mkdir()
    cmd = stage_command(hf_endpoint=hub.url, timeout_s=120)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(home), "NO_PROXY": "*"}
    proc = subprocess.run(
        ["sh", "-c", cmd],
        input=wm.stage_stdin(TOKEN, wm.stage_script_source()),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged = wm.parse_stage_output(proc.stdout)
    assert staged.root == str((home / "dsv41-exl3").resolve()), "root is expanded on the node, absolute"
    assert (home / "dsv41-exl3" / "model" / "config.json").is_file()
    assert {a for _, _, a in hub.requests} == {f"Bearer {TOKEN}"}
    assert TOKEN not in log.read_text(), "the token must never be in docker's argv"
    container_env = [json.loads(ln) for ln in Path(f"{log}.env").read_text().splitlines()]
    assert container_env and all(TOKEN not in json.dumps(e) for e in container_env), (
        "the token must not be in the container's environment (its Config.Env, which `docker inspect` shows)"
    )
    assert TOKEN not in cmd


def test_parse_stage_output_takes_the_marker_line() -> None:
    out = "pulling...\nDSV41_WEIGHTS_MANIFEST " + json.dumps({"root": "/r", "files": {"b": 2, "a": 1}}) + "\n"
    staged = wm.parse_stage_output(out)
    assert staged.root == "/r" and list(staged.files) == ["a", "b"]
    assert json.loads(staged.manifest_json()) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="no 'DSV41_WEIGHTS_MANIFEST' line"):
        wm.parse_stage_output("Traceback ...")
    with pytest.raises(ValueError, match="root='rel'"):
        wm.parse_stage_output('DSV41_WEIGHTS_MANIFEST {"root": "rel", "files": {"a": 1}}')
    with pytest.raises(ValueError, match="no files"):
        wm.parse_stage_output('DSV41_WEIGHTS_MANIFEST {"root": "/r", "files": {}}')


def test_exports_are_read_only_and_limited_to_worker_ips() -> None:
    text = wm.render_exports("/home/u/dsv41-exl3", ["10.0.0.2", "10.0.0.3"])
    line = text.splitlines()[-1]
    assert line == '"/home/u/dsv41-exl3" 10.0.0.2(ro,sync,no_subtree_check) 10.0.0.3(ro,sync,no_subtree_check)'
    assert "*" not in text
    with pytest.raises(ValueError, match="worker fabric_ip='worker1'"):
        wm.render_exports("/r", ["worker1"])
    assert "# export: 10.0.0.2 /home/u/dsv41-exl3\n# export: 10.0.0.3 /home/u/dsv41-exl3\n" in text


def test_nfs_volume_options() -> None:
    opts = wm.nfs_volume_options(head_ip="10.0.0.1", device_path="/home/u/dsv41-exl3/model")
    assert opts == {
        "type": "nfs",
        "device": ":/home/u/dsv41-exl3/model",
        "o": "addr=10.0.0.1,nfsvers=4.2,ro,nconnect=8,rsize=1048576,wsize=1048576,hard,timeo=600",
    }
    other = wm.nfs_volume_options(head_ip="10.0.0.9", device_path="/home/u/dsv41-exl3/model")
    assert wm.volume_name("ws-w1", "model", opts) != wm.volume_name("ws-w1", "model", other)
    assert wm.volume_name("ws-w1", "model", opts) == wm.volume_name("ws-w1", "model", dict(opts))


def _staged_tree(root: Path) -> dict[str, int]:
    files = {"model/a.safetensors": 5, "model/config.json": 2, "engram-src/model-00047-of-00048.safetensors": 3}
    for rel, size in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * size)
    return files


def test_bind_check_passes_when_every_file_is_visible(tmp_path: Path) -> None:
    files = _staged_tree(tmp_path)
    cmd = wm.render_bind_check(node="head", abs_root=str(tmp_path), files=files, timeout_s=30)
    proc = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "weights visible on node head: 3 files" in proc.stdout


def test_bind_check_fails_naming_node_and_missing_files(tmp_path: Path) -> None:
    files = _staged_tree(tmp_path)
    (tmp_path / "model/a.safetensors").write_bytes(b"x")  # wrong size
    (tmp_path / "engram-src/model-00047-of-00048.safetensors").unlink()
    cmd = wm.render_bind_check(node="spark-2", abs_root=str(tmp_path), files=files, timeout_s=30)
    proc = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    summary = proc.stderr.strip().splitlines()[-1]
    assert "weights not visible on node spark-2" in summary
    assert "model/a.safetensors" in summary and "engram-src/model-00047-of-00048.safetensors" in summary
    assert "model/config.json" not in summary
    assert "found missing" in proc.stderr and "expected 5 bytes, found 1" in proc.stderr


def test_volume_check_mounts_both_volumes_read_only_and_is_bounded(tmp_path: Path) -> None:
    cmd = wm.render_volume_check(
        node="w1",
        image="sha256:abc",
        model_volume="ws-w1-model-1",
        engram_volume="ws-w1-engram-src-2",
        files={"model/a": 1},
        timeout_s=45,
        stack_prefix=PREFIX,
    )
    ran = run_logged(cmd, tmp_path)
    bounded = ran.line("timeout ")
    assert bounded.startswith("timeout --kill-after=30 45 docker run --rm -i "), bounded
    assert " -v ws-w1-model-1:/w/model:ro " in bounded and " -v ws-w1-engram-src-2:/w/engram-src:ro " in bounded
    assert " --entrypoint sh " in bounded and bounded.endswith(" sha256:abc -s")
    inner = header_value(cmd, "SIZE_CHECK", as_text=True)
    assert ran.docker_stdin == inner, "the size check reaches the container's sh on stdin"
    assert header_value(inner, "FILES", as_text=True) == "1 model/a\n" and header_value(inner, "WEIGHTS_ROOT") == "/w"


def test_volume_check_script_runs_inside_the_container_root(tmp_path: Path) -> None:
    """Run the volume check with a docker stand-in that maps the two volumes to directories."""
    files = _staged_tree(tmp_path / "head")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        f"#!/bin/sh\n[ \"$1\" = run ] || exit 0\nsed 's# WEIGHTS_ROOT=/w;# WEIGHTS_ROOT={tmp_path}/head;#' | sh -s\n"
    )
    (bin_dir / "docker").chmod(0o755)
    cmd = wm.render_volume_check(
        node="w1", image="img", model_volume="m", engram_volume="e", files=files, timeout_s=30, stack_prefix=PREFIX
    )
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    ok = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30, env=env)
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "head/model/config.json").unlink()
    bad = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30, env=env)
    assert bad.returncode == 1 and "node w1" in bad.stderr and "model/config.json" in bad.stderr


def test_check_timeout_names_the_node(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\n[ "$1" = run ] || exit 0\nexec sleep 30\n')
    (bin_dir / "docker").chmod(0o755)
    cmd = wm.render_volume_check(
        node="w9",
        image="img",
        model_volume="m",
        engram_volume="e",
        files={"model/a": 1},
        timeout_s=1,
        stack_prefix=PREFIX,
    )
    proc = subprocess.run(
        ["sh", "-c", cmd], capture_output=True, text=True, timeout=60, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    )
    assert proc.returncode == 124
    assert "weights check on node w9 timed out after 1s" in proc.stderr


# --- the component under Pulumi mocks --------------------------------------------------------------

SIG_SECRET = "1b47061264138c4ac30d75fd1eb44270"
STAGED_ROOT = "/home/u/dsv41-exl3"
STAGED_FILES = {"model/config.json": 10, "model/a.safetensors": 20, "engram-src/config.json": 5}
STAGED_DIGESTS = {p: hashlib.sha256(p.encode()).hexdigest() for p in STAGED_FILES}


def _mocked_program(share: str, *, workers: int = 1, token: str | None = TOKEN) -> dict[str, Any]:
    import pulumi
    import pulumi_docker as docker
    from pulumi.runtime import mocks
    from pulumi_command import remote

    from components.weights.weight_store import CopySettings, WeightNode, WeightStore, WeightStoreArgs

    class Mocks(pulumi.runtime.Mocks):
        def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
            outs = dict(args.inputs)
            if args.typ == "command:remote:Command" and args.name.endswith("-stage"):
                outs["stdout"] = (
                    "log\n"
                    + sw.MANIFEST_MARKER
                    + " "
                    + json.dumps({"root": STAGED_ROOT, "files": STAGED_FILES, "sha256": STAGED_DIGESTS})
                )
            if args.name.startswith("ws-copy-"):
                outs["root"] = f"/copies/{args.inputs['worker']}"  # what the copier reports back: also the id
                return outs["root"], outs
            return f"{args.name}-id", outs

        def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]]]:
            return {}, []

    class RecordingMonitor(mocks.MockMonitor):
        def __init__(self, m: pulumi.runtime.Mocks) -> None:
            super().__init__(m)
            self.requests: list[Any] = []

        def RegisterResource(self, request: Any) -> Any:  # noqa: N802 (gRPC name)
            self.requests.append(request)
            return super().RegisterResource(request)

    m = Mocks()
    monitor = RecordingMonitor(m)
    pulumi.runtime.set_mocks(m, preview=False, monitor=monitor)
    result: dict[str, Any] = {"monitor": monitor}

    @pulumi.runtime.test
    def program() -> Any:
        def node(name: str, ip: str) -> WeightNode:
            provider = docker.Provider(f"{name}-docker", host=f"ssh://u@{ip}")
            conn = remote.ConnectionArgs(host=ip, user="u", private_key=pulumi.Output.secret("KEY"))
            copy_root = f"~/copies/{name}" if share == "copy" and name != "head" else None
            return WeightNode(
                name=name,
                connection=conn,
                fabric_ip=ip,
                host=ip,
                port=22,
                user="u",
                copy_root=copy_root,
                ready=[],
                docker_provider=provider,
                image=f"sha256:{name}",
            )

        store = WeightStore(
            "ws",
            WeightStoreArgs(
                head=node("head", "10.0.0.1"),
                workers=[node(f"w{i}", f"10.0.0.{i + 1}") for i in range(1, workers + 1)],
                root="~/dsv41-exl3",
                share=share,  # type: ignore[arg-type]
                staging_image="sha256:serving",
                model_repo=MODEL_REPO,
                engram_repo=ENGRAM_REPO,
                revision="main",
                hf_token=pulumi.Output.secret(token) if token else None,
                hf_endpoint="http://127.0.0.1:9",
                stage_timeout_s=3600,
                stack_prefix=PREFIX,
                copy=CopySettings(
                    ssh_private_key=pulumi.Output.secret("KEY"),
                    ssh_agent_socket=None,
                    ssh_known_hosts_file=None,
                    streams=4,
                    timeout_s=3600,
                )
                if share == "copy"
                else None,
            ),
        )
        result["store"] = store
        outs = [
            store.manifest,
            *store.model_source.values(),
            *store.engram_source.values(),
            *(getattr(r, "stdout", r.urn) for r in store.visible.values()),
        ]
        return pulumi.Output.all(*outs).apply(lambda v: result.__setitem__("values", v))

    program()
    return result


def _by_name(monitor: Any) -> dict[str, Any]:
    return {r.name: r for r in monitor.requests}


def _field(req: Any, key: str) -> Any:
    from google.protobuf import json_format

    return json_format.MessageToDict(req.object).get(key)


def test_staging_command_is_retained_and_triggered_by_what_is_staged() -> None:
    run = _mocked_program("bind")
    reqs = _by_name(run["monitor"])
    stage = reqs["ws-stage"]
    assert stage.type == "command:remote:Command"
    assert stage.retainOnDelete is True, "destroying the stack must never delete the weights"
    assert not _field(stage, "delete"), "staging has no delete command"
    assert _field(stage, "triggers") == [MODEL_REPO, ENGRAM_REPO, "main", "~/dsv41-exl3"]
    assert stage.parent.endswith("::ws"), "children are parented to the component"


def test_no_secret_in_any_command_text_and_token_only_in_secret_stdin() -> None:
    run = _mocked_program("nfs")
    for req in run["monitor"].requests:
        if req.type != "command:remote:Command":
            continue
        for key in ("create", "update", "delete", "triggers"):
            assert TOKEN not in json.dumps(_field(req, key)), f"{req.name}.{key} carries the token"
    stdin = _field(_by_name(run["monitor"])["ws-stage"], "stdin")
    assert isinstance(stdin, dict) and TOKEN in json.dumps(stdin), "the token travels on stdin"
    assert SIG_SECRET in json.dumps(stdin), "stdin must stay a secret"


def test_anonymous_staging_sends_empty_token_line() -> None:
    run = _mocked_program("bind", token=None)
    stage = _by_name(run["monitor"])["ws-stage"]
    stdin = _field(stage, "stdin")
    assert isinstance(stdin, str) and stdin.startswith("\n") and "def main" in stdin
    create = _field(stage, "create")
    assert header_value(create, "WITH_TOKEN") == "0" and "HF_TOKEN" not in create.split("\n", 1)[0], (
        "anonymous: stage.sh reads the empty line and passes no token to docker"
    )


def test_bind_share_gives_every_node_the_head_path() -> None:
    run = _mocked_program("bind", workers=2)
    store, reqs = run["store"], _by_name(run["monitor"])
    assert store.mount_type == {"head": "bind", "w1": "bind", "w2": "bind"}
    values = run["values"]
    assert json.loads(values[0]) == STAGED_FILES
    assert values[1:4] == [f"{STAGED_ROOT}/model"] * 3 and values[4:7] == [f"{STAGED_ROOT}/engram-src"] * 3
    assert not [r for r in run["monitor"].requests if r.type == "docker:index/volume:Volume"]
    assert "ws-nfs-export" not in reqs
    for node in ("head", "w1", "w2"):
        check = reqs[f"ws-visible-{node}"]
        assert any(d.endswith("::ws-stage") for d in check.dependencies), f"{node} check must wait for staging"
        inner = header_value(_field(check, "create"), "SIZE_CHECK", as_text=True)
        assert header_value(_field(check, "create"), "MODE") == "bind"
        assert header_value(inner, "WEIGHTS_ROOT") == STAGED_ROOT
        assert "a.safetensors" in header_value(inner, "FILES", as_text=True)


def test_nfs_share_mounts_worker_volumes_with_options() -> None:
    run = _mocked_program("nfs", workers=2)
    store, reqs = run["store"], _by_name(run["monitor"])
    assert store.mount_type == {"head": "bind", "w1": "volume", "w2": "volume"}
    export = reqs["ws-nfs-export"]
    assert '"/home/u/dsv41-exl3" 10.0.0.2(ro,sync,no_subtree_check) 10.0.0.3(ro,sync,no_subtree_check)' in header_value(
        _field(export, "create"), "EXPORTS", as_text=True
    )
    assert any(d.endswith("::ws-stage") for d in export.dependencies)
    for w in ("w1", "w2"):
        for which in ("model", "engram-src"):
            vol = reqs[f"ws-{w}-{which}"]
            assert vol.type == "docker:index/volume:Volume"
            assert f"pulumi:providers:docker::{w}-docker::" in vol.provider, "the volume lives on that worker's daemon"
            assert _field(vol, "driver") == "local"
            assert _field(vol, "driverOpts") == {
                "type": "nfs",
                "device": f":{STAGED_ROOT}/{which}",
                "o": "addr=10.0.0.1,nfsvers=4.2,ro,nconnect=8,rsize=1048576,wsize=1048576,hard,timeo=600",
            }
            assert any(d.endswith("::ws-nfs-export") for d in vol.dependencies)
        check = reqs[f"ws-visible-{w}"]
        deps = check.dependencies
        for dep in ("ws-stage", "ws-nfs-export", f"ws-{w}-model", f"ws-{w}-engram-src"):
            assert any(d.endswith(f"::{dep}") for d in deps), f"{w} check must wait for {dep}"
        create = _field(check, "create")
        assert header_value(create, "IMAGE") == f"sha256:{w}", "the check runs the image pulled on that worker"
        assert header_value(create, "MODE") == "volume"
        assert header_value(create, "MODEL_VOLUME").startswith(f"ws-{w}-model-")
        assert (header_value(create, "MOUNT"), header_value(create, "MODEL_DIR")) == ("/w", "model")
        assert "engram-src/config.json" in header_value(
            header_value(create, "SIZE_CHECK", as_text=True), "FILES", as_text=True
        )
    values = run["values"]
    model_vols, engram_vols = values[2:4], values[5:7]
    assert values[1] == f"{STAGED_ROOT}/model" and values[4] == f"{STAGED_ROOT}/engram-src"
    assert all(v.startswith(f"ws-w{i}-model-") for i, v in enumerate(model_vols, 1))
    assert all(v.startswith(f"ws-w{i}-engram-src-") for i, v in enumerate(engram_vols, 1))
    assert "ws-visible-head" in reqs and reqs["ws-visible-head"].dependencies


def test_copy_share_gives_each_worker_its_own_verified_copy_after_staging() -> None:
    run = _mocked_program("copy", workers=2)
    store, reqs = run["store"], _by_name(run["monitor"])
    assert store.mount_type == {"head": "bind", "w1": "bind", "w2": "bind"}
    values = run["values"]
    assert values[1:4] == [f"{STAGED_ROOT}/model", "/copies/w1/model", "/copies/w2/model"]
    assert values[4:7] == [f"{STAGED_ROOT}/engram-src", "/copies/w1/engram-src", "/copies/w2/engram-src"]
    assert "ws-nfs-export" not in reqs and not [
        r for r in run["monitor"].requests if r.type == "docker:index/volume:Volume"
    ]
    for i, w in enumerate(("w1", "w2"), 2):
        copy = reqs[f"ws-copy-{w}"]
        assert copy.type == "pulumi-python:dynamic/weights:WorkerCopy"
        assert any(d.endswith("::ws-stage") for d in copy.dependencies), f"{w}'s copy waits for staging"
        assert store.visible[w] is not None and f"ws-visible-{w}" not in reqs, "the copy is the worker's check"
        fields = {
            k: _field(copy, k)
            for k in (
                "worker",
                "copy_root",
                "head_root",
                "files",
                "sha256",
                "worker_fabric_ip",
                "head_fabric_ip",
                "worker_image",
            )
        }
        assert fields == {
            "worker": w,
            "copy_root": f"~/copies/{w}",
            "head_root": STAGED_ROOT,
            "files": STAGED_FILES,
            "sha256": STAGED_DIGESTS,
            "worker_fabric_ip": f"10.0.0.{i}",
            "head_fabric_ip": "10.0.0.1",
            "worker_image": f"sha256:{w}",
        }
        assert SIG_SECRET in json.dumps(_field(copy, "ssh_private_key")), "the ssh key reaches the copy as a secret"
    assert "ws-visible-head" in reqs


def test_copy_without_a_workers_copy_root_is_rejected() -> None:
    from pulumi_command import remote

    from components.weights.weight_store import CopySettings, WeightNode, WeightStore, WeightStoreArgs

    conn = remote.ConnectionArgs(host="127.0.0.1", user="u")
    plain = {"connection": conn, "host": "127.0.0.1", "port": 22, "user": "u", "ready": []}
    settings = CopySettings(
        ssh_private_key=None, ssh_agent_socket=None, ssh_known_hosts_file=None, streams=1, timeout_s=10
    )
    args = WeightStoreArgs(
        head=WeightNode(name="h", fabric_ip="10.0.0.1", copy_root=None, **plain),
        workers=[WeightNode(name="w", fabric_ip="10.0.0.2", copy_root=None, **plain)],
        root="~/x",
        share="copy",
        staging_image="i",
        model_repo=MODEL_REPO,
        engram_repo=ENGRAM_REPO,
        revision="main",
        hf_token=None,
        hf_endpoint=None,
        stage_timeout_s=10,
        stack_prefix=PREFIX,
        copy=settings,
    )
    with pytest.raises(ValueError, match="worker w has no copy_root"):
        WeightStore._validate(args)
    with pytest.raises(ValueError, match="needs copy settings"):
        WeightStore._validate(WeightStoreArgs(**{**args.__dict__, "copy": None}))


def test_nfs_without_worker_docker_provider_is_rejected() -> None:
    from pulumi_command import remote

    from components.weights.weight_store import WeightNode, WeightStore, WeightStoreArgs

    conn = remote.ConnectionArgs(host="127.0.0.1", user="u")
    plain = {"connection": conn, "host": "127.0.0.1", "port": 22, "user": "u", "copy_root": None, "ready": []}
    args = WeightStoreArgs(
        head=WeightNode(name="h", fabric_ip="10.0.0.1", **plain),
        workers=[WeightNode(name="w", fabric_ip="10.0.0.2", **plain)],
        root="~/x",
        share="nfs",
        staging_image="i",
        model_repo=MODEL_REPO,
        engram_repo=ENGRAM_REPO,
        revision="main",
        hf_token=None,
        hf_endpoint=None,
        stage_timeout_s=10,
        stack_prefix=PREFIX,
        copy=None,
    )
    with pytest.raises(ValueError, match="worker w has no docker_provider"):
        WeightStore._validate(args)
    bad_root = WeightStoreArgs(**{**args.__dict__, "root": "x", "share": "bind"})
    with pytest.raises(ValueError, match="weights root='x'"):
        WeightStore._validate(bad_root)


def test_stage_timeout_fails_with_resume_hint(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\n[ "$1" = run ] || exit 0\nexec sleep 30\n')
    (bin_dir / "docker").chmod(0o755)
    proc = subprocess.run(
        ["sh", "-c", stage_command(timeout_s=1)],
        input=wm.stage_stdin(None, "script"),
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 124
    assert "weights staging timed out after 1s on the head; raise stage_timeout_s" in proc.stderr


# --- per-stack names and exports that touch only this stack (issue 12, item 10) -----------------------

OTHER = "dsv41-exl3-prod"


@pytest.fixture
def head(tmp_path: Path) -> dict[str, str]:
    """A fake head: exportfs and systemctl that log their argv, sudo that just runs, a temp exports.d."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    for name, body in (
        ("exportfs", f'echo "exportfs $*" >> {log}\n'),
        ("systemctl", "exit 0\n"),
        ("sudo", '[ "$1" = -n ] && shift\nexec "$@"\n'),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "home").mkdir()
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "TEST_EXPORTS_DIR": str(tmp_path / "exports.d"),
        "CALLS": str(log),
    }


def sh(script: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    for shell in ("sh", "bash"):
        syntax = subprocess.run([shell, "-n", "-c", script], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{shell} -n: {syntax.stderr}"
    return subprocess.run(["sh", "-c", script], env=env, input=stdin, capture_output=True, text=True, timeout=60)


def calls(env: dict[str, str]) -> list[str]:
    path = Path(env["CALLS"])
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return lines


def export(env: dict[str, str], root: Path, ips: list[str], prefix: str = PREFIX) -> subprocess.CompletedProcess[str]:
    return sh(
        wm.render_export_command(
            head_name="head",
            abs_root=str(root),
            worker_ips=ips,
            stack_prefix=prefix,
            exports_dir=env["TEST_EXPORTS_DIR"],
        ),
        env,
    )


def test_two_stacks_export_their_own_entries_and_never_resync_the_host(head: dict[str, str], tmp_path: Path) -> None:
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    root_a.mkdir()
    root_b.mkdir()
    assert export(head, root_a, ["10.0.0.2"]).returncode == 0
    assert calls(head) == [f"exportfs -o ro,sync,no_subtree_check 10.0.0.2:{root_a}"]
    proc = export(head, root_b, ["10.0.0.3"], prefix=OTHER)
    assert proc.returncode == 0, proc.stderr
    assert calls(head) == [f"exportfs -o ro,sync,no_subtree_check 10.0.0.3:{root_b}"], "no -ra: only our entry"
    exports = Path(head["TEST_EXPORTS_DIR"])
    assert sorted(p.name for p in exports.iterdir()) == sorted([f"{OTHER}.exports", f"{PREFIX}.exports"])
    assert f'"{root_a}" 10.0.0.2(ro,sync,no_subtree_check)' in (exports / f"{PREFIX}.exports").read_text()

    unexport = wm.render_unexport_command(
        abs_root=str(root_a), worker_ips=["10.0.0.2"], stack_prefix=PREFIX, exports_dir=head["TEST_EXPORTS_DIR"]
    )
    assert sh(unexport, head).returncode == 0
    assert calls(head) == [f"exportfs -u 10.0.0.2:{root_a}"], "destroying one stack withdraws only its entry"
    assert sorted(p.name for p in exports.iterdir()) == [f"{OTHER}.exports"]


def test_export_change_withdraws_only_the_entries_this_stack_no_longer_exports(
    head: dict[str, str], tmp_path: Path
) -> None:
    root = tmp_path / "w"
    root.mkdir()
    assert export(head, root, ["10.0.0.2", "10.0.0.3"]).returncode == 0
    calls(head)
    assert export(head, root, ["10.0.0.3"]).returncode == 0
    assert calls(head) == [f"exportfs -u 10.0.0.2:{root}", f"exportfs -o ro,sync,no_subtree_check 10.0.0.3:{root}"]


def test_legacy_export_file_is_removed_only_when_it_holds_exactly_this_export(
    head: dict[str, str], tmp_path: Path
) -> None:
    exports = Path(head["TEST_EXPORTS_DIR"])
    exports.mkdir()
    legacy = exports / wm.LEGACY_EXPORTS_NAME
    root = tmp_path / "w"
    root.mkdir()
    legacy.write_text(wm.legacy_exports(str(tmp_path / "someone-else"), ["10.0.0.9"]))
    assert export(head, root, ["10.0.0.2"]).returncode == 0
    assert legacy.exists(), "another stack's export (an earlier version's shared file) is left alone"
    legacy.write_text(wm.legacy_exports(str(root), ["10.0.0.2"]))
    assert export(head, root, ["10.0.0.2"]).returncode == 0
    assert not legacy.exists(), "our own export moved to our per-stack file"
    assert (exports / f"{PREFIX}.exports").exists()


@pytest.mark.parametrize("which", ["slash", "home", "link-to-home"])
def test_staging_and_export_refuse_a_root_that_is_slash_or_home_on_the_node(
    which: str, head: dict[str, str], tmp_path: Path
) -> None:
    home = Path(head["HOME"])
    (tmp_path / "link").symlink_to(home)
    root = {"slash": "/", "home": "~", "link-to-home": str(tmp_path / "link")}[which]
    log = tmp_path / "docker-argv.log"
    _fake_docker(tmp_path / "docker-bin", log)
    env = {**head, "PATH": f"{tmp_path / 'docker-bin'}:{head['PATH']}"}
    proc = sh(stage_command(root=root), env, stdin=wm.stage_stdin(None, "script"))
    assert proc.returncode == 1
    assert "is / or the home directory of" in proc.stderr and "use a directory of its own" in proc.stderr
    assert not log.exists(), "refused before any container runs"
    assert not (home / "model").exists() and not Path("/model").exists(), "nothing is created there"
    abs_root = "/" if which == "slash" else str(home.resolve())
    refused = export(head, Path(abs_root), ["10.0.0.2"])
    assert refused.returncode == 1 and "is / or the home directory of" in refused.stderr
    assert calls(head) == [] and not Path(head["TEST_EXPORTS_DIR"]).exists(), "nothing exported"


def test_staging_and_the_copy_refuse_a_root_resolving_to_a_path_docker_v_would_split(
    head: dict[str, str], tmp_path: Path
) -> None:
    odd = tmp_path / "a:b,c"
    odd.mkdir()
    (tmp_path / "link").symlink_to(odd)  # config cannot see this: the node resolves it
    log = tmp_path / "docker-argv.log"
    _fake_docker(tmp_path / "docker-bin", log)
    env = {**head, "PATH": f"{tmp_path / 'docker-bin'}:{head['PATH']}"}
    proc = sh(stage_command(root=str(tmp_path / "link")), env, stdin=wm.stage_stdin(None, "script"))
    assert proc.returncode == 1 and f"weights root {odd} on the head holds ':' or ','" in proc.stderr
    assert "(weights.root)" in proc.stderr
    copy = lc.render_copy_command(
        node="w1",
        copy_root=str(tmp_path / "link"),
        source="http://10.0.0.1:1",
        source_ident="m:1:2",
        bind="10.0.0.2",
        image="img",
        container="c",
        streams=1,
        expected="{}",
        timeout_s=60,
    )
    proc = sh(copy, env, stdin='{"token": "t"}\n')
    assert proc.returncode == 1 and f"copy root {odd} on w1 holds ':' or ','" in proc.stderr
    assert "(weights.copyRoot)" in proc.stderr
    assert not log.exists(), "refused before any container runs"
    assert list(odd.iterdir()) == [], "nothing is created there"


def test_stage_and_check_containers_are_named_per_stack(tmp_path: Path) -> None:
    cmd = stage_command()
    assert header_value(cmd, "CONTAINER") == f"{PREFIX}-stage-weights" and "dsv41-exl3-stage-weights" not in cmd
    ran = run_logged(cmd, _fresh(tmp_path / "stage"), stdin=wm.stage_stdin(None, "script"))
    assert ran.line("docker rm ") == f"docker rm -f {PREFIX}-stage-weights"
    assert ran.line("docker run ").startswith(f"docker run --rm -i --name {PREFIX}-stage-weights ")
    check = wm.render_volume_check(
        node="w1", image="img", model_volume="m", engram_volume="e", files={"model/a": 1}, stack_prefix=OTHER
    )
    assert header_value(check, "CONTAINER") == f"{OTHER}-weights-check"
    ran = run_logged(check, _fresh(tmp_path / "check"))
    assert ran.line("docker rm ") == f"docker rm -f {OTHER}-weights-check"
    assert ran.line("docker run ").startswith(f"docker run --rm -i --name {OTHER}-weights-check ")
    with pytest.raises(ValueError, match="stack_prefix='a b'"):
        stage_command(stack_prefix="a b")
