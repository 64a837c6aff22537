"""Stage the checkpoint into <root>: runs ON THE HEAD NODE, inside a throwaway container of the staging image.

Self-contained on purpose (stdlib + huggingface_hub only): the program ships this file's text to the
node and runs it with the image's python3. The plan (which repos, which files, which count rules)
comes as JSON from `components/weights/manifest.py`; this script only enforces it.

Per repo: resolve the revision to its commit, list the files at that commit with their sizes and
content ids (the LFS sha256 of large files, the git blob id of small ones), refuse a listing that names
any path outside the repo (absolute, `..`, backslash, NUL, control character: a mirror could list `../x`),
select the planned ones (a planned file missing on the hub is an error naming it); every repo is listed and
checked before anything is written. Then download ONE FILE AT A TIME into <dest-root>/<dest>/. Each
download is hashed as it is written (sha256, and the git blob id), checked against the listing, and only
then moved into place: huggingface_hub checks sizes only.

What was staged is recorded in <dest-root>/dsv41-weights-manifest.json (per file: repo, commit,
size, sha256, how it was verified, mtime), updated after every file. A later run compares records
with the listing instead of re-reading hundreds of GiB: a file whose record matches the hub's
content id is kept; one of another revision (same name and size, other content) is downloaded
again; a file present without a record (staged by an older version of this program) is hashed once.
A file the record names that the new listing no longer selects is removed (this program put it
there); a file nobody recorded and nobody listed is refused, never deleted.
Success prints one line on stdout:
    DSV41_WEIGHTS_MANIFEST {"root": "<host root>", "files": {"model/x.safetensors": 123, ...},
                            "sha256": {"model/x.safetensors": "<hex>", ...}, "manifest_file": "<host path>"}
Progress and errors go to stderr; an error is one line starting with "stage_weights: error:".
The token is stdin's first line (empty: anonymous), never argv nor the environment: `docker run -e HF_TOKEN`
would keep it in the container's Config.Env, which `docker inspect` shows while staging runs (hours). An
HF_TOKEN in the environment (baked into an image) is dropped, so an anonymous run stays anonymous.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

MANIFEST_MARKER = "DSV41_WEIGHTS_MANIFEST"
# The staging step's record, at the weights root on the head (JSON, readable by any later step).
MANIFEST_FILE = "dsv41-weights-manifest.json"
MANIFEST_FORMAT = 1
# Where a download is written (hashed) before it is verified and moved into place.
PARTIAL_SUFFIX = ".dsv41-partial"
# huggingface_hub's own local_dir metadata (left by earlier versions of this script): not weights.
_CLIENT_METADATA_DIR = ".cache"
_HASH_CHUNK = 8 << 20


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


def _lfs_sha256(lfs: Any) -> str | None:
    """The LFS sha256 from a listing entry: an object in recent clients, a dict in old ones."""
    if lfs is None:
        return None
    value = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    return value.lower() if isinstance(value, str) and re.fullmatch(r"[0-9a-fA-F]{64}", value) else None


def _hub_call(repo: str, revision: str, what: str, call: Any) -> Any:
    _, RepositoryNotFoundError, RevisionNotFoundError = _hub_errors()
    try:
        return call()
    except RevisionNotFoundError as exc:
        raise StageError(f"{repo}: revision {revision!r} not found on the hub; fix the revision") from exc
    except RepositoryNotFoundError as exc:
        raise StageError(f"{repo}: repo not found (or gated without a token); fix the repo name or hf token") from exc
    except Exception as exc:  # HTTP, transport (httpx) and disk errors alike: name the file, suggest a re-run
        raise StageError(
            f"{repo}@{revision}: {what} failed: {type(exc).__name__}: {exc}; "
            "check HF_ENDPOINT and the network, then retry"
        ) from exc


def resolve_commit(api: Any, repo: str, revision: str) -> str:
    """The commit `revision` names now: files are listed and downloaded at it, and it is recorded."""
    info = _hub_call(repo, revision, "resolving the revision", lambda: api.model_info(repo, revision=revision))
    sha = getattr(info, "sha", None)
    return str(sha) if sha else revision


DEFAULT_ENDPOINT = "https://huggingface.co"


def unsafe_path(path: str) -> str | None:
    """Why a listed path cannot name a file under the repo's directory, or None: staging writes <dest>/<path>."""
    if "\0" in path:
        return "it holds a NUL byte"
    if "\\" in path:
        return "it holds a backslash"
    if path.startswith("/"):
        return "it is absolute"
    parts = path.split("/")
    if ".." in parts:
        return "it has a `..` component"
    if any(p in ("", ".") for p in parts):
        return "it has an empty or `.` component"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return "it holds a control character (the node-side listings are one path a line)"
    return None


def check_listed_paths(repo: str, revision: str, endpoint: str | None, paths: Iterable[str]) -> None:
    """Refuse a listing naming any path outside the repo, before anything is written (a mirror could list `../x`)."""
    bad = [(p, why) for p in paths if (why := unsafe_path(p)) is not None]
    if bad:
        more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
        shown = "; ".join(f"{p!r}: {why}" for p, why in bad[:3]) + more
        raise StageError(
            f"the hub at {endpoint or DEFAULT_ENDPOINT} lists paths outside {repo}@{revision} ({shown}); "
            "nothing was written. A listing names repo-relative paths only: check weights.hfEndpoint"
        )


def list_tree(api: Any, repo: str, revision: str, endpoint: str | None = None) -> dict[str, HubFile]:
    """Every file in the repo at `revision` (folders skipped), with its size and content ids; every path checked."""
    items = _hub_call(
        repo, revision, "listing files", lambda: list(api.list_repo_tree(repo, revision=revision, recursive=True))
    )
    tree: dict[str, HubFile] = {}
    for item in items:
        size = getattr(item, "size", None)
        if isinstance(size, int) and getattr(item, "path", None):
            blob_id = getattr(item, "blob_id", None)
            tree[str(item.path)] = HubFile(
                size=size, sha256=_lfs_sha256(getattr(item, "lfs", None)), blob_id=str(blob_id) if blob_id else None
            )
    check_listed_paths(repo, revision, endpoint, tree)
    return tree


# --- content ids, computed while the bytes go by ----------------------------------------------------


class _Digests:
    """sha256 and the git blob id of one file's bytes, fed as they are written or read."""

    def __init__(self, size: int) -> None:
        self._size = size
        self.reset()

    def reset(self) -> None:
        self.sha256 = hashlib.sha256()
        self.git = hashlib.sha1(b"blob %d\0" % self._size)  # noqa: S324 (git's blob id is sha1 by definition)

    def update(self, chunk: bytes) -> None:
        self.sha256.update(chunk)
        self.git.update(chunk)

    def mismatch(self, listed: HubFile) -> str | None:
        """What does not match the listing, or None."""
        if listed.sha256 and self.sha256.hexdigest() != listed.sha256:
            return f"sha256 {self.sha256.hexdigest()}, the hub lists {listed.sha256}"
        if not listed.sha256 and listed.blob_id and self.git.hexdigest() != listed.blob_id:
            return f"git blob id {self.git.hexdigest()}, the hub lists {listed.blob_id}"
        return None


class HashingWriter:
    """The file object the client's `http_get` writes to: every chunk is hashed on its way to disk.

    `http_get` appends when it resumes after a dropped connection (the hash goes on), and rewinds to the
    start when a server ignored its Range request (the hash starts over); any other seek is refused."""

    def __init__(self, f: BinaryIO, digests: _Digests) -> None:
        self._f = f
        self.digests = digests

    def write(self, chunk: bytes) -> int:
        self.digests.update(chunk)
        return self._f.write(chunk)

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset != 0:
            raise OSError("a hashed download can only restart from its first byte")
        self.digests.reset()
        return self._f.seek(0)

    def truncate(self, size: int | None = None) -> int:
        return self._f.truncate(size)

    def flush(self) -> None:
        self._f.flush()


def hash_file(path: Path, size: int) -> _Digests:
    """Read a file once (only one present without a record: staged before records existed)."""
    digests = _Digests(size)
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digests.update(chunk)
    return digests


# --- the record ---------------------------------------------------------------------------------------


def load_records(manifest: Path) -> dict[str, dict[str, Any]]:
    """{relative path: record} of what an earlier run staged; nothing when there is no readable record."""
    try:
        raw = json.loads(manifest.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        print(
            f"stage_weights: {manifest} is unreadable ({exc}); files present are hashed once instead",
            file=sys.stderr,
            flush=True,
        )
        return {}
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict):
        return {}
    return {str(k): v for k, v in files.items() if isinstance(v, dict)}


def load_repos(manifest: Path) -> dict[str, Any]:
    """The repos an earlier run recorded (each updated as this run stages it), so a run that changes
    nothing writes back the same record."""
    try:
        raw = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return {}
    repos = raw.get("repos") if isinstance(raw, dict) else None
    return {str(k): v for k, v in repos.items() if isinstance(v, dict)} if isinstance(repos, dict) else {}


def save_records(manifest: Path, records: Mapping[str, Mapping[str, Any]], repos: Mapping[str, Any]) -> None:
    """Written whole and renamed into place: an interrupted run leaves the previous record, never half of one.
    An unchanged record is not rewritten: a run that staged nothing leaves the weights root as it found it."""
    body = {
        "format": MANIFEST_FORMAT,
        "written_by": "dsv41-exl3 stage_weights.py",
        "repos": dict(repos),
        "files": {k: dict(v) for k, v in sorted(records.items())},
    }
    text = json.dumps(body, indent=1, sort_keys=True) + "\n"
    try:
        if manifest.read_text() == text:
            return
    except OSError:
        pass
    tmp = manifest.with_name(f".{manifest.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, manifest)


def _record(repo: str, commit: str, listed: HubFile, digests: _Digests, path: Path) -> dict[str, Any]:
    return {
        "repo": repo,
        "revision": commit,
        "size": listed.size,
        "sha256": digests.sha256.hexdigest(),
        "blob_id": listed.blob_id if listed.sha256 is None else None,
        "verified_by": listed.verified_by,
        "mtime_ns": path.stat().st_mtime_ns,
    }


def record_describes(record: Mapping[str, Any] | None, path: Path) -> bool:
    """The record is of THIS file on disk: same size and modification time as when it was recorded."""
    if record is None:
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return path.is_file() and record.get("size") == st.st_size and record.get("mtime_ns") == st.st_mtime_ns


def same_content(record: Mapping[str, Any], repo: str, commit: str, listed: HubFile) -> bool:
    """The recorded file is the listed one: by the hub's sha256, else the git blob id, else repo and commit."""
    if record.get("size") != listed.size:
        return False
    if listed.sha256:
        return record.get("sha256") == listed.sha256
    if listed.blob_id:
        return record.get("blob_id") == listed.blob_id
    return record.get("repo") == repo and record.get("revision") == commit


def local_files(dest_dir: Path) -> list[str]:
    """Every regular file below dest_dir, relative; the client's metadata and our partial downloads aside."""
    found: list[str] = []
    for path in sorted(dest_dir.rglob("*")):
        rel = path.relative_to(dest_dir)
        if rel.parts[0] == _CLIENT_METADATA_DIR or path.name.endswith(PARTIAL_SUFFIX) or not path.is_file():
            continue
        found.append(rel.as_posix())
    return found


def download_verified(
    repo: str, commit: str, name: str, listed: HubFile, dest_dir: Path, endpoint: str | None, token: str | None
) -> _Digests:
    """Download one file, hashing it as it is written; it replaces the target only once it matches the listing."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]  # exported lazily

    EntryNotFoundError, _, _ = _hub_errors()

    target = dest_dir / name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
    digests = _Digests(listed.size)
    try:
        url = hf_hub_url(repo, name, revision=commit, endpoint=endpoint)
        headers = build_hf_headers(token=token)
        meta = get_hf_file_metadata(url, token=token)
        location = meta.location or url
        if _host(location) != _host(url):
            headers.pop("authorization", None)  # a signed CDN url: the token stays with the hub
        with partial.open("wb") as f:
            # The size is checked below with the content, so the error names the file and the listing.
            # HashingWriter has every method http_get calls on its file (write, tell, seek, truncate).
            http_get(location, cast(BinaryIO, HashingWriter(f, digests)), headers=headers)
    except EntryNotFoundError as exc:
        partial.unlink(missing_ok=True)
        raise StageError(
            f"{repo}@{commit}: file {name} is listed but the hub returned 404 for it; check the revision or retry"
        ) from exc
    except Exception as exc:  # HTTP, transport (httpx) and disk errors alike: name the file, suggest a re-run
        partial.unlink(missing_ok=True)
        raise StageError(
            f"{repo}@{commit}: downloading {name} failed: {type(exc).__name__}: {exc}; re-run to resume"
        ) from exc
    got = partial.stat().st_size
    wrong = f"{got} bytes, the hub lists {listed.size}" if got != listed.size else digests.mismatch(listed)
    if wrong is not None:
        partial.unlink()  # never moved into place: the next run cannot mistake it for the file
        raise StageError(f"{repo}@{commit}: {name} downloaded as {wrong}; not kept, re-run to fetch it again")
    os.replace(partial, target)
    return digests


def _host(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).netloc.lower()


def check_no_foreign_files(repo: str, dest_dir: Path, foreign: list[str], manifest: Path) -> None:
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise StageError(
            f"{repo}: {dest_dir} holds {shown}, which the hub listing does not name and this program did not "
            f"stage (not in {manifest}); it is not deleted. Remove or move it by hand, or use another weights.root"
        )


@dataclass
class Staging:
    """One run's state: the record on disk, updated after every file."""

    dest_root: Path
    endpoint: str | None
    token: str | None
    api: Any
    records: dict[str, dict[str, Any]]
    repos: dict[str, Any]

    @property
    def manifest(self) -> Path:
        return self.dest_root / MANIFEST_FILE

    def save(self) -> None:
        save_records(self.manifest, self.records, self.repos)


@dataclass(frozen=True)
class Listed:
    """One repo as the hub lists it at the revision's commit: the planned files, checked."""

    commit: str
    files: dict[str, HubFile]


def list_repo(plan: RepoPlan, revision: str, st: Staging) -> Listed:
    """Resolve, list and check one repo; writes nothing (every repo is listed before any is staged)."""
    commit = resolve_commit(st.api, plan.repo, revision)
    tree = list_tree(st.api, plan.repo, commit, st.endpoint)
    files = select_files(plan.repo, revision, tree, plan.files)
    if plan.safetensors_count is not None:  # fail before hours of download when the hub side is wrong
        check_safetensors_count(plan.repo, "the hub listing", files, plan.safetensors_count)
    return Listed(commit=commit, files=files)


def stage_repo(plan: RepoPlan, revision: str, st: Staging, listing: Listed) -> dict[str, str]:
    """Stage one listed repo; returns {relative path: sha256} of its planned files."""
    commit, files = listing.commit, listing.files
    dest_dir = st.dest_root / plan.dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    st.repos[plan.dest] = {"repo": plan.repo, "revision": revision, "commit": commit}

    # What is here and not planned: ours (recorded) is removed, anyone else's is refused before any download.
    present = local_files(dest_dir)
    foreign = [n for n in present if n not in files and f"{plan.dest}/{n}" not in st.records]
    check_no_foreign_files(plan.repo, dest_dir, foreign, st.manifest)
    for name in present:
        rel = f"{plan.dest}/{name}"
        if name not in files:
            old = st.records.pop(rel)
            (dest_dir / name).unlink()
            print(
                f"stage_weights: {rel} removed: staged for {old.get('repo')}@{old.get('revision')}, "
                f"not in {plan.repo}@{commit}",
                file=sys.stderr,
                flush=True,
            )
    for rel in [r for r in st.records if r.startswith(f"{plan.dest}/") and r[len(plan.dest) + 1 :] not in files]:
        del st.records[rel]  # recorded, gone from disk, no longer planned
    st.save()

    digests: dict[str, str] = {}
    for i, (name, listed) in enumerate(files.items(), 1):
        rel, target = f"{plan.dest}/{name}", dest_dir / name
        record = st.records.get(rel)
        if record is not None and record_describes(record, target) and same_content(record, plan.repo, commit, listed):
            how = "present (recorded)"
            record.update(repo=plan.repo, revision=commit)  # the same content, now also of this commit
        else:
            checked = None
            if (
                not record_describes(record, target)
                and local_size(target) == listed.size
                and listed.verified_by != "size"
            ):
                local = hash_file(target, listed.size)  # a copy nobody recorded: read it once, keep it if it matches
                if local.mismatch(listed) is None:
                    checked, how = local, "present (hashed once: no record)"
            if checked is None:
                checked, how = (
                    download_verified(plan.repo, commit, name, listed, dest_dir, st.endpoint, st.token),
                    "downloaded",
                )
            st.records[rel] = _record(plan.repo, commit, listed, checked, target)
            st.save()
        digests[rel] = str(st.records[rel]["sha256"])
        print(
            f"stage_weights: {rel} ({listed.size} bytes, {listed.verified_by}) {how} [{i}/{len(files)}]",
            file=sys.stderr,
            flush=True,
        )
    st.save()
    on_disk = [p.name for p in dest_dir.iterdir() if p.is_file()]
    if plan.safetensors_count is not None:
        check_safetensors_count(plan.repo, str(dest_dir), on_disk, plan.safetensors_count)
    if plan.index_file is not None and plan.index_shard_total is not None:
        try:
            index = json.loads((dest_dir / plan.index_file).read_text())
        except (OSError, ValueError) as exc:
            raise StageError(f"{plan.repo}: cannot read {plan.index_file} in {dest_dir}: {exc}") from exc
        check_index(plan.repo, index, plan.index_shard_total)
    check_required_present(plan.repo, dest_dir, plan.required_shards, {n: f.size for n, f in files.items()})
    return digests


def read_token(stream: Any) -> str | None:
    """The token: the first line of `stream` (stdin); an empty line or no input means anonymous."""
    line = stream.readline() if stream is not None else ""
    return line.rstrip("\r\n") or None


def run(plan_json: str, dest_root: Path, host_root: str) -> dict[str, Any]:
    from huggingface_hub import HfApi

    raw = json.loads(plan_json)
    revision = str(raw["revision"])
    endpoint = os.environ.get("HF_ENDPOINT") or None
    os.environ.pop("HF_TOKEN", None)  # the client would fall back to it
    token = read_token(sys.stdin)
    st = Staging(
        dest_root=dest_root,
        endpoint=endpoint,
        token=token,
        api=HfApi(endpoint=endpoint, token=token),
        records=load_records(dest_root / MANIFEST_FILE),
        repos=load_repos(dest_root / MANIFEST_FILE),
    )
    plans = [RepoPlan.from_json(repo_raw) for repo_raw in raw["repos"]]
    listed = [(plan, list_repo(plan, revision, st)) for plan in plans]
    digests: dict[str, str] = {}
    for plan, listing in listed:
        digests.update(stage_repo(plan, revision, st, listing))
    files = {rel: int(st.records[rel]["size"]) for rel in digests}
    return {
        "root": host_root,
        "files": files,
        "sha256": digests,
        "manifest_file": f"{host_root.rstrip('/')}/{MANIFEST_FILE}",
    }


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
