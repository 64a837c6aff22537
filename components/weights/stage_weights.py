"""Stage the checkpoint into <root>: runs ON THE HEAD NODE, inside a throwaway container of the staging image.

Self-contained on purpose (stdlib + huggingface_hub only): the program ships this file's text to the
node and runs it with the image's python3. The plan (which repos, which files, which count rules)
comes as JSON from `components/weights/manifest.py`; this script only enforces it.

Per repo: resolve the revision to its commit, list the files at that commit with their sizes and
content ids (the LFS sha256 of large files, the git blob id of small ones), refuse a listing that names
any path outside the repo (absolute, `..`, backslash, NUL, control character: a mirror could list `../x`),
select the planned ones (a planned file missing on the hub is an error naming it); every repo is listed and
checked before anything is written. Then download the files into <dest-root>/<dest>/, the plan's
`download_streams` at once (one at a time when the plan names no count), largest first. Each download is
hashed as it is written (sha256, or the git blob id of a non-LFS file), checked against the listing, and
only then moved into place: huggingface_hub checks sizes only. The first failure stops the rest: no new file
starts, the running ones stop at their next chunk, and the failure is reported once they have.

A download is written to a partial file named by the content id it should end as. One that stops early (a
failure of another file, a dropped connection after the client's retries, the staging timeout) is kept; the
next run hashes the bytes it holds from the first one and asks the hub for the rest (`Range`), so the final
check still covers every byte. A partial of other content, or of a file the listing identifies by size only,
is not resumed. Every few seconds a progress line (bytes, rate, ETA, streams, files) goes to stderr.

What was staged is recorded in <dest-root>/dsv41-weights-manifest.json (per file: repo, commit,
size, sha256, how it was verified, mtime), updated after every file. A later run compares records
with the listing instead of re-reading hundreds of GiB: a file whose record matches the hub's
content id is kept; one of another revision (same name and size, other content) is downloaded
again; a file present without a record (staged by an older version of this program) is hashed once.
A file the record names that the new listing no longer selects is removed (this program put it
there); a file nobody recorded and nobody listed is refused, never deleted.

The base repo's plan names a slim Engram directory (`engram_vllm`): its index and config.json are fetched before
any shard, and an index listing no Engram embed tensor, or one outside the Engram shards, or a missing config.json,
is refused then. Once everything is staged, the directory is built (or brought up to date) beside the base repo's:
hardlinks of the Engram shards and config.json, and an index listing only the embed tensors, each checked against
its shard's safetensors header. Its files are reported with the staged ones; every rank mounts it at /engram-src.

Once every file is checked, the pages of every file under <dest-root> (staged now or already present, and any
directory built from them) are dropped from the head's page cache: each file is flushed (`fdatasync`: a dirty
page is not dropped) and advised `POSIX_FADV_DONTNEED`. No root is needed, and only these files are touched (not
`/proc/sys/vm/drop_caches`). Why: the GB10 driver allocates the ranks' memory from free memory and does not
reclaim page cache, and the ranks start right after staging wrote hundreds of GiB.
Success prints one line on stdout:
    DSV41_WEIGHTS_MANIFEST {"root": "<host root>", "files": {"model/x.safetensors": 123, ...},
                            "sha256": {"model/x.safetensors": "<hex>", ...}, "manifest_file": "<host path>",
                            "page_cache": {"files": <advised>, "bytes": <their size>, "failed": <not advised>}}
Progress and errors go to stderr; an error is one line starting with "stage_weights: error:".
The token is stdin's first line (empty: anonymous), never argv nor the environment: `docker run -e HF_TOKEN`
would keep it in the container's Config.Env, which `docker inspect` shows while staging runs (hours). An
HF_TOKEN in the environment (baked into an image) is dropped, so an anonymous run stays anonymous.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import stat
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
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
# Files downloaded at once: the plan's `download_streams` (weights.downloadStreams); a plan without it (rendered
# by a caller that predates the setting) stages one file at a time, as this program did then.
UNPLANNED_STREAMS = 1
MAX_STREAMS = 64
# A progress line every PROGRESS_EVERY_S, every PROGRESS_LATER_EVERY_S after PROGRESS_LATER_AFTER_S: the lines
# are the command's stderr, which the stack's state keeps (hours of 5 s lines would be thousands).
PROGRESS_EVERY_S = 5.0
PROGRESS_LATER_AFTER_S = 600.0
PROGRESS_LATER_EVERY_S = 30.0
# The rate shown is over this window: recent enough to follow the link, long enough not to jump per chunk.
RATE_WINDOW_S = 30.0

_OUT = threading.Lock()


def say(message: str) -> None:
    """One whole `stage_weights:` line on stderr; the lock keeps lines of concurrent downloads apart."""
    with _OUT:
        sys.stderr.write(f"stage_weights: {message}\n")
        sys.stderr.flush()


class StageError(Exception):
    """A failure the operator can act on; the message names the repo/file and the fix."""


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
    """sha256 and the git blob id of one file's bytes, fed as they are written or read.

    `git=False` leaves the blob id out: an LFS file is identified by its sha256 (its listed blob id is the
    pointer's), and not computing a second digest of hundreds of GiB halves the hashing."""

    def __init__(self, size: int, git: bool = True) -> None:
        self._size = size
        self._with_git = git
        self.reset()

    def reset(self) -> None:
        self.sha256 = hashlib.sha256()
        # git's blob id is sha1 by definition
        self.git = hashlib.sha1(b"blob %d\0" % self._size) if self._with_git else None  # noqa: S324

    def update(self, chunk: bytes) -> None:
        self.sha256.update(chunk)
        if self.git is not None:
            self.git.update(chunk)

    def mismatch(self, listed: HubFile) -> str | None:
        """What does not match the listing, or None."""
        if listed.sha256 and self.sha256.hexdigest() != listed.sha256:
            return f"sha256 {self.sha256.hexdigest()}, the hub lists {listed.sha256}"
        if not listed.sha256 and listed.blob_id:
            got = self.git.hexdigest() if self.git is not None else "(not computed)"
            if got != listed.blob_id:
                return f"git blob id {got}, the hub lists {listed.blob_id}"
        return None


def digests_for(listed: HubFile) -> _Digests:
    """The digests that identify `listed`: the git blob id only when the hub gives no sha256."""
    return _Digests(listed.size, git=listed.sha256 is None)


class DownloadStopped(Exception):
    """Raised from inside a download that another file's failure stopped (never reported as its own error)."""


class HashingWriter:
    """The file object the client's `http_get` writes to: every chunk is hashed on its way to disk.

    `http_get` appends when it resumes after a dropped connection (the hash goes on), and rewinds to the
    start when a server ignored its Range request (the hash starts over); any other seek is refused.
    `stop` set: the next chunk is neither hashed nor written, the download ends with DownloadStopped.
    `transfer` hears of every byte written, and of a restart, for the progress line."""

    def __init__(
        self,
        f: BinaryIO,
        digests: _Digests,
        stop: threading.Event | None = None,
        transfer: Transfer | None = None,
    ) -> None:
        self._f = f
        self.digests = digests
        self._stop = stop
        self._transfer = transfer

    def write(self, chunk: bytes) -> int:
        if self._stop is not None and self._stop.is_set():
            raise DownloadStopped("stopped: another file failed")
        self.digests.update(chunk)
        written = self._f.write(chunk)
        if self._transfer is not None:
            self._transfer.wrote(len(chunk))
        return written

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset != 0:
            raise OSError("a hashed download can only restart from its first byte")
        self.digests.reset()
        if self._transfer is not None:
            self._transfer.restart()
        return self._f.seek(0)

    def truncate(self, size: int | None = None) -> int:
        return self._f.truncate(size)

    def flush(self) -> None:
        self._f.flush()


def hash_into(digests: _Digests, path: Path) -> int:
    """Feed a file's bytes to `digests`; how many there were."""
    read = 0
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digests.update(chunk)
            read += len(chunk)
    return read


def hash_file(path: Path, listed: HubFile) -> _Digests:
    """Read a file once (only one present without a record: staged before records existed)."""
    digests = digests_for(listed)
    hash_into(digests, path)
    return digests


# --- progress -----------------------------------------------------------------------------------------


def progress_interval(elapsed_s: float) -> float:
    """Seconds to the next progress line, `elapsed_s` into the downloads."""
    return PROGRESS_EVERY_S if elapsed_s < PROGRESS_LATER_AFTER_S else PROGRESS_LATER_EVERY_S


def _unit(n: float) -> tuple[float, str]:
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB")):
        if n >= scale:
            return float(scale), name
    return 1024.0, "KiB"


def format_rate(bytes_per_s: float) -> str:
    scale, name = _unit(bytes_per_s)
    value = bytes_per_s / scale
    return f"{value:.0f} {name}/s" if value >= 100 else f"{value:.1f} {name}/s"


def format_duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_progress(
    *,
    done_bytes: int,
    total_bytes: int,
    rate: float,
    active: int,
    streams: int,
    files_done: int,
    files_total: int,
    elapsed_s: float | None = None,
) -> str:
    """The progress line (without the `stage_weights: ` prefix). Sizes in the total's unit; the ETA from `rate`.
    `elapsed_s` given: the run's last line, with the time taken (and the average rate) instead of an ETA."""
    scale, name = _unit(total_bytes)
    pct = 100.0 * done_bytes / total_bytes if total_bytes else 100.0
    left = max(total_bytes - done_bytes, 0)
    if elapsed_s is not None:
        when = f"took {format_duration(elapsed_s)}"
    elif left == 0:
        when = "ETA 0s"
    else:
        when = f"ETA {format_duration(left / rate)}" if rate > 0 else "ETA -"
    return (
        f"progress {done_bytes / scale:.1f}/{total_bytes / scale:.1f} {name} ({pct:.1f}%), {format_rate(rate)}, "
        f"{when}, {active}/{streams} streams, {files_done}/{files_total} files"
    )


@dataclass
class Progress:
    """The run's bytes and files: those present at the start, finished, and on disk so far of the ones in flight.

    `received` (bytes the hub sent in this run) makes the rate; a file already present or hashed in place counts
    as done but not towards the rate. Every method may be called from any download's thread."""

    total_bytes: int
    total_files: int
    streams: int
    clock: Callable[[], float] = time.monotonic
    done_bytes: int = 0
    received: int = 0
    files_done: int = 0
    active: int = 0
    began: float = field(init=False)
    _samples: deque[tuple[float, int]] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.began = self.clock()
        self._samples = deque([(self.began, 0)])

    def add(self, *, done: int = 0, received: int = 0, files: int = 0, active: int = 0) -> int:
        with self._lock:
            self.done_bytes += done
            self.received += received
            self.files_done += files
            self.active += active
            return self.files_done

    def present(self, size: int) -> int:
        """A file kept as it is; returns how many files are done."""
        return self.add(done=size, files=1)

    def start(self) -> Transfer:
        self.add(active=1)
        return Transfer(self)

    def rate(self, now: float) -> float:
        """Bytes per second received over the last RATE_WINDOW_S (since the start, before that)."""
        with self._lock:
            received = self.received
        self._samples.append((now, received))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, r0 = self._samples[0]
        return (received - r0) / (now - t0) if now > t0 else 0.0

    def line(self, *, final: bool = False) -> str:
        """The progress line now; `final`: the run's last, with its time and average rate."""
        now = self.clock()
        elapsed = now - self.began
        average = self.received / elapsed if elapsed > 0 else 0.0
        rate = average if final else self.rate(now)
        with self._lock:
            return format_progress(
                done_bytes=self.done_bytes,
                total_bytes=self.total_bytes,
                rate=rate,
                active=self.active,
                streams=self.streams,
                files_done=self.files_done,
                files_total=self.total_files,
                elapsed_s=elapsed if final else None,
            )


class Transfer:
    """One file's share of the progress: the bytes of it on disk so far, until it is done or abandoned."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._counted = 0

    def kept(self, n: int) -> None:
        """`n` bytes an earlier run downloaded (not received now)."""
        self._counted += n
        self._progress.add(done=n)

    def wrote(self, n: int) -> None:
        self._counted += n
        self._progress.add(done=n, received=n)

    def restart(self) -> None:
        self._progress.add(done=-self._counted)
        self._counted = 0

    def finish(self, size: int) -> int:
        """The file is in place: it counts whole. Returns how many files are done."""
        done = self._progress.add(done=size - self._counted, files=1, active=-1)
        self._counted = size
        return done

    def abandon(self) -> None:
        self._progress.add(done=-self._counted, active=-1)
        self._counted = 0


# --- the record ---------------------------------------------------------------------------------------


def load_records(manifest: Path) -> dict[str, dict[str, Any]]:
    """{relative path: record} of what an earlier run staged; nothing when there is no readable record."""
    try:
        raw = json.loads(manifest.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        say(f"{manifest} is unreadable ({exc}); files present are hashed once instead")
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


def partial_path(target: Path, listed: HubFile) -> Path:
    """Where `target` is downloaded before it is verified: named by the content id it must end as, so a later
    run resumes only a partial of the same content. A file identified by its size alone gets no id."""
    content_id = listed.sha256 or listed.blob_id
    tag = f".{content_id[:16]}" if content_id else ""
    return target.with_name(f".{target.name}{tag}{PARTIAL_SUFFIX}")


def drop_stale_partials(target: Path, keep: Path) -> None:
    """Partial downloads of `target` other than `keep`: of other content, or named as before content ids."""
    stale = re.compile(re.escape(f".{target.name}") + r"(\.[0-9a-f]{16})?" + re.escape(PARTIAL_SUFFIX))
    for path in target.parent.iterdir():
        if path != keep and stale.fullmatch(path.name):
            path.unlink(missing_ok=True)


def resume_from(partial: Path, listed: HubFile, digests: _Digests) -> int:
    """The bytes of an earlier run's partial download to keep, each hashed now from the first one (the check
    after the download covers them too); 0 (and the partial removed) when it cannot be resumed."""
    size = local_size(partial)
    if size is None:
        return 0
    if listed.verified_by == "size" or size > listed.size:
        partial.unlink()
        return 0
    return hash_into(digests, partial)


def download_verified(
    repo: str,
    commit: str,
    name: str,
    listed: HubFile,
    dest_dir: Path,
    endpoint: str | None,
    token: str | None,
    *,
    stop: threading.Event | None = None,
    transfer: Transfer | None = None,
) -> _Digests:
    """Download one file, hashing it as it is written; it replaces the target only once it matches the listing.

    A partial download an earlier run left is resumed (its bytes hashed first). One that stops early is kept
    for the next run: a dropped connection the client could not resume, a disk error, `stop` (another file
    failed); one refused by the check or answered 404 is removed."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]  # exported lazily

    EntryNotFoundError, _, _ = _hub_errors()

    target = dest_dir / name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(target, listed)
    drop_stale_partials(target, partial)
    digests = digests_for(listed)
    try:
        kept = resume_from(partial, listed, digests)
        if transfer is not None:
            transfer.kept(kept)
        if kept:
            say(f"{repo}/{name}: resuming after the {kept} bytes an earlier run downloaded (hashed again)")
        if kept < listed.size or not partial.exists():
            url = hf_hub_url(repo, name, revision=commit, endpoint=endpoint)
            headers = build_hf_headers(token=token)
            meta = get_hf_file_metadata(url, token=token)
            location = meta.location or url
            if _host(location) != _host(url):
                headers.pop("authorization", None)  # a signed CDN url: the token stays with the hub
            with partial.open("r+b" if kept else "wb") as f:
                f.seek(kept)
                # The size is checked below with the content, so the error names the file and the listing.
                # HashingWriter has every method http_get calls on its file (write, tell, seek, truncate).
                writer = HashingWriter(f, digests, stop=stop, transfer=transfer)
                http_get(location, cast(BinaryIO, writer), resume_size=kept, headers=headers)
    except DownloadStopped:
        if listed.verified_by == "size":
            partial.unlink(missing_ok=True)  # nothing could tell its bytes from another revision's
        raise
    except EntryNotFoundError as exc:
        partial.unlink(missing_ok=True)
        raise StageError(
            f"{repo}@{commit}: file {name} is listed but the hub returned 404 for it; check the revision or retry"
        ) from exc
    except Exception as exc:  # HTTP, transport (httpx) and disk errors alike: name the file, suggest a re-run
        if listed.verified_by == "size":
            partial.unlink(missing_ok=True)
        got = local_size(partial) or 0
        keep = f"the {got} bytes downloaded are kept: " if got else ""
        raise StageError(
            f"{repo}@{commit}: downloading {name} failed: {type(exc).__name__}: {exc}; {keep}re-run to resume"
        ) from exc
    got = partial.stat().st_size
    wrong = f"{got} bytes, the hub lists {listed.size}" if got != listed.size else digests.mismatch(listed)
    if wrong is not None:
        partial.unlink()  # never moved into place: the next run cannot mistake it for the file, nor resume it
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
    """One run's state: the record on disk, updated after every file (by whichever download finished it)."""

    dest_root: Path
    endpoint: str | None
    token: str | None
    api: Any
    records: dict[str, dict[str, Any]]
    repos: dict[str, Any]
    host_root: str = ""  # dest_root as the head sees it, for messages ("": dest_root itself)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def manifest(self) -> Path:
        return self.dest_root / MANIFEST_FILE

    def on_host(self, rel: str) -> str:
        """`rel` (below the root) as the operator finds it on the head."""
        return f"{self.host_root.rstrip('/')}/{rel}" if self.host_root else str(self.dest_root / rel)

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


@dataclass(frozen=True)
class Job:
    """One planned file that is not recorded as present: to hash in place, or to download."""

    repo: str
    commit: str
    dest: str
    dest_dir: Path
    name: str
    listed: HubFile
    hash_first: bool  # a copy nobody recorded, of the listed size: read it once, keep it if it matches

    @property
    def rel(self) -> str:
        return f"{self.dest}/{self.name}"


def _file_line(rel: str, listed: HubFile, how: str, done: int, total: int) -> str:
    return f"{rel} ({listed.size} bytes, {listed.verified_by}) {how} [{done}/{total}]"


def prepare_repo(plan: RepoPlan, revision: str, st: Staging, listing: Listed, progress: Progress) -> list[Job]:
    """What is here and not planned: ours (recorded) is removed, anyone else's is refused before any download.
    A planned file recorded with the listed content is kept; the others are returned, to fetch."""
    commit, files = listing.commit, listing.files
    dest_dir = st.dest_root / plan.dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    st.repos[plan.dest] = {"repo": plan.repo, "revision": revision, "commit": commit}

    present = local_files(dest_dir)
    foreign = [n for n in present if n not in files and f"{plan.dest}/{n}" not in st.records]
    check_no_foreign_files(plan.repo, dest_dir, foreign, st.manifest)
    for name in present:
        rel = f"{plan.dest}/{name}"
        if name not in files:
            old = st.records.pop(rel)
            (dest_dir / name).unlink()
            say(f"{rel} removed: staged for {old.get('repo')}@{old.get('revision')}, not in {plan.repo}@{commit}")
    for rel in [r for r in st.records if r.startswith(f"{plan.dest}/") and r[len(plan.dest) + 1 :] not in files]:
        del st.records[rel]  # recorded, gone from disk, no longer planned
    st.save()

    jobs: list[Job] = []
    for name, listed in files.items():
        rel, target = f"{plan.dest}/{name}", dest_dir / name
        record = st.records.get(rel)
        if record is not None and record_describes(record, target) and same_content(record, plan.repo, commit, listed):
            record.update(repo=plan.repo, revision=commit)  # the same content, now also of this commit
            done = progress.present(listed.size)
            say(_file_line(rel, listed, "present (recorded)", done, progress.total_files))
            continue
        hash_first = (
            not record_describes(record, target) and local_size(target) == listed.size and listed.verified_by != "size"
        )
        jobs.append(Job(plan.repo, commit, plan.dest, dest_dir, name, listed, hash_first))
    return jobs


def fetch_one(job: Job, st: Staging, progress: Progress, stop: threading.Event) -> None:
    """Hash or download one file, record it and save the record; on `stop`, end without starting."""
    if stop.is_set():
        return
    target = job.dest_dir / job.name
    transfer = progress.start()
    try:
        checked: _Digests | None = None
        how = "downloaded"
        if job.hash_first:
            local = hash_file(target, job.listed)
            if local.mismatch(job.listed) is None:
                checked, how = local, "present (hashed once: no record)"
        if checked is None:
            checked = download_verified(
                job.repo,
                job.commit,
                job.name,
                job.listed,
                job.dest_dir,
                st.endpoint,
                st.token,
                stop=stop,
                transfer=transfer,
            )
    except DownloadStopped:
        transfer.abandon()
        partial = partial_path(target, job.listed)
        kept = local_size(partial)
        if not kept:
            partial.unlink(missing_ok=True)
        say(
            f"{job.rel} stopped (another file failed)"
            + (f"; its {kept} bytes are kept for the next run to resume" if kept else "")
        )
        return
    except BaseException:
        stop.set()  # before this thread can take the next file
        transfer.abandon()
        raise
    with st.lock:  # one record, written whole: every finished file is in it before the next is added
        st.records[job.rel] = _record(job.repo, job.commit, job.listed, checked, target)
        st.save()
        done = transfer.finish(job.listed.size)
    say(_file_line(job.rel, job.listed, how, done, progress.total_files))


def _report_progress(progress: Progress, finished: threading.Event) -> None:
    while not finished.wait(progress_interval(progress.clock() - progress.began)):
        say(progress.line())


def fetch_all(jobs: list[Job], st: Staging, progress: Progress, *, last: bool = True) -> None:
    """Every job, `progress.streams` at once, largest first (the last to finish are small); a progress line
    every few seconds and, when these are the `last` jobs of the run, one at the end. The first failure sets
    `stop`: no job starts after it, the running downloads stop at their next chunk (their partial files kept),
    and it is raised once all have ended."""
    if not jobs:
        return
    stop = threading.Event()
    finished = threading.Event()
    reporter = threading.Thread(target=_report_progress, args=(progress, finished), daemon=True)
    reporter.start()
    first: BaseException | None = None
    try:
        with ThreadPoolExecutor(max_workers=min(progress.streams, len(jobs)), thread_name_prefix="stage") as pool:
            try:
                ordered = sorted(jobs, key=lambda j: -j.listed.size)
                futures: list[Future[None]] = [pool.submit(fetch_one, j, st, progress, stop) for j in ordered]
                for future in as_completed(futures):
                    exc = future.exception()
                    if exc is not None and first is None:
                        first = exc
                        stop.set()
            except BaseException:
                stop.set()  # interrupted: let the running downloads end at their next chunk
                raise
    finally:
        finished.set()
        reporter.join()
        if last or first is not None:
            say(progress.line(final=True))
    if first is not None:
        raise first


def finish_repo(plan: RepoPlan, st: Staging, listing: Listed) -> dict[str, str]:
    """The repo's rules on what is now on disk; returns {relative path: sha256} of its planned files."""
    dest_dir = st.dest_root / plan.dest
    files = listing.files
    on_disk = [p.name for p in dest_dir.iterdir() if p.is_file() and not p.name.endswith(PARTIAL_SUFFIX)]
    if plan.safetensors_count is not None:
        check_safetensors_count(plan.repo, str(dest_dir), on_disk, plan.safetensors_count)
    if plan.index_file is not None and plan.index_shard_total is not None:
        try:
            index = json.loads((dest_dir / plan.index_file).read_text())
        except (OSError, ValueError) as exc:
            raise StageError(f"{plan.repo}: cannot read {plan.index_file} in {dest_dir}: {exc}") from exc
        check_index(plan.repo, index, plan.index_shard_total)
    check_required_present(plan.repo, dest_dir, plan.required_shards, {n: f.size for n, f in files.items()})
    return {f"{plan.dest}/{name}": str(st.records[f"{plan.dest}/{name}"]["sha256"]) for name in files}


# --- the slim Engram directory ------------------------------------------------------------------------------
#
# vLLM's default loader loads every shard an index names: pointed at the base repo's native index (48 shards
# listed, 2 present) it would pull the whole tree. Every rank mounts a directory of its own instead, built here
# after each staging run from what was staged (as upstream's scripts/prepare_engram_src.py builds it): hardlinks of
# the Engram shards and config.json (no extra bytes) and an index whose weight_map lists only the Engram embed
# tables. The index's weight_map is what the loader goes by, so it is the authority checked here: each table it
# lists must be in an Engram shard's own header. Rebuilt on every run, so a new revision's files (downloaded to new
# inodes) are linked again and the index derived again; a refusal changes nothing on disk.

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


@dataclass(frozen=True)
class PageCacheDrop:
    """What `drop_page_cache` advised: files (hard links once), their bytes, and the files it could not."""

    files: int
    bytes: int
    failed: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"files": self.files, "bytes": self.bytes, "failed": len(self.failed)}


def drop_page_cache(root: Path) -> PageCacheDrop:
    """Flush, then drop from the page cache, every regular file below `root` (symlinks are not followed).

    `fdatasync` first: DONTNEED leaves dirty pages (just written, not yet on disk) in memory. A file that cannot be
    opened or advised is named and counted, never fatal: the ranks' own memory check before start is the guard.
    (copy_weights.py, shipped alone to a worker, keeps its own copy of these few lines.)"""
    seen: set[tuple[int, int]] = set()
    files = size = 0
    failed: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            try:
                # NOFOLLOW: a link is not ours to advise; NONBLOCK: a FIFO must not hang the open.
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as exc:
                if not path.is_symlink():
                    failed.append(f"{path}: {exc.strerror or exc}")
                continue
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) in seen or not stat.S_ISREG(st.st_mode):
                    continue  # a hard link of a file already advised (the same pages), or not a file
                seen.add((st.st_dev, st.st_ino))
                try:
                    os.fdatasync(fd)
                except OSError as exc:  # a filesystem that cannot sync this descriptor still takes the advice
                    if exc.errno != errno.EINVAL:
                        raise
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                files += 1
                size += st.st_size
            except OSError as exc:
                failed.append(f"{path}: {exc.strerror or exc}")
            finally:
                os.close(fd)
    return PageCacheDrop(files=files, bytes=size, failed=tuple(failed))


def report_page_cache(drop: PageCacheDrop, root: Path) -> None:
    say(f"page cache: dropped the pages of {drop.files} files ({drop.bytes / 2**30:.2f} GiB) under {root}")
    if drop.failed:
        more = f" and {len(drop.failed) - 3} more" if len(drop.failed) > 3 else ""
        say(
            f"page cache: {len(drop.failed)} files not dropped ({'; '.join(drop.failed[:3])}{more}); their pages "
            "stay in memory until the kernel reclaims them (the ranks check MemAvailable before they start)"
        )


def plan_streams(raw: Mapping[str, Any]) -> int:
    """Files to download at once, as the plan says (weights.downloadStreams)."""
    streams = raw.get("download_streams", UNPLANNED_STREAMS)
    if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
        raise StageError(
            f"the staging plan's download_streams={streams!r} is not a whole number from 1 to {MAX_STREAMS}; "
            "set weights.downloadStreams within it"
        )
    return streams


def read_token(stream: Any) -> str | None:
    """The token: the first line of `stream` (stdin); an empty line or no input means anonymous."""
    line = stream.readline() if stream is not None else ""
    return line.rstrip("\r\n") or None


def run(plan_json: str, dest_root: Path, host_root: str) -> dict[str, Any]:
    from huggingface_hub import HfApi

    raw = json.loads(plan_json)
    revision = str(raw["revision"])
    streams = plan_streams(raw)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    os.environ.pop("HF_TOKEN", None)  # the client would fall back to it
    token = read_token(sys.stdin)
    st = Staging(
        dest_root=dest_root,
        host_root=host_root,
        endpoint=endpoint,
        token=token,
        api=HfApi(endpoint=endpoint, token=token),
        records=load_records(dest_root / MANIFEST_FILE),
        repos=load_repos(dest_root / MANIFEST_FILE),
    )
    plans = [RepoPlan.from_json(repo_raw) for repo_raw in raw["repos"]]
    listed = [(plan, list_repo(plan, revision, st)) for plan in plans]
    progress = Progress(
        total_bytes=sum(f.size for _, listing in listed for f in listing.files.values()),
        total_files=sum(len(listing.files) for _, listing in listed),
        streams=streams,
    )
    jobs = [job for plan, listing in listed for job in prepare_repo(plan, revision, st, listing, progress)]
    # The files the slim Engram directory is derived from first (an index and a config, a few KiB): a base repo
    # without Engram embed tables is refused in seconds, before hours of shard downloads.
    first = {
        (plan.repo, name)
        for plan, _ in listed
        if plan.engram_vllm is not None
        for name in (plan.index_file, plan.engram_vllm.config)
        if name is not None
    }
    fetch_all([j for j in jobs if (j.repo, j.name) in first], st, progress, last=False)
    for plan, _ in listed:
        if plan.engram_vllm is not None:
            engram_sources(plan, plan.engram_vllm, revision, st)
    fetch_all([j for j in jobs if (j.repo, j.name) not in first], st, progress)
    st.save()
    digests: dict[str, str] = {}
    for plan, listing in listed:
        digests.update(finish_repo(plan, st, listing))
    files = {rel: int(st.records[rel]["size"]) for rel in digests}
    for plan, _ in listed:
        if plan.engram_vllm is not None:
            for rel, (size, sha256) in build_engram_vllm(plan, plan.engram_vllm, revision, st).items():
                files[rel], digests[rel] = size, sha256
    # Checked: now out of the head's memory, before the ranks start and the GB10 driver allocates from it.
    dropped = drop_page_cache(dest_root)
    report_page_cache(dropped, Path(host_root))
    return {
        "root": host_root,
        "files": files,
        "sha256": digests,
        "manifest_file": f"{host_root.rstrip('/')}/{MANIFEST_FILE}",
        "page_cache": dropped.to_json(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stage the dsv41-exl3 checkpoint (the plan's streams at once).")
    parser.add_argument("--plan", required=True, help="staging plan JSON (from weights_manifest.staging_plan)")
    parser.add_argument("--dest-root", required=True, help="where <root> is mounted in this container")
    parser.add_argument("--host-root", required=True, help="<root> as the host sees it (reported back)")
    ns = parser.parse_args(argv)
    try:
        result = run(ns.plan, Path(ns.dest_root), ns.host_root)
    except StageError as exc:
        say(f"error: {exc}")
        return 1
    print(f"{MANIFEST_MARKER} {json.dumps(result, sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
