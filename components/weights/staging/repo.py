"""The staging of a repo: listed and checked, what is present kept, the rest fetched at once, its rules on disk.

Part of the staging program (components/weights/staging/main.py), which runs on the head node.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from components.weights.staging.digests import DownloadStopped, _Digests, hash_file
from components.weights.staging.download import download_verified, partial_path
from components.weights.staging.hub import list_tree, resolve_commit
from components.weights.staging.messages import StageError, say
from components.weights.staging.plan import (
    HubFile,
    RepoPlan,
    check_index,
    check_required_present,
    check_safetensors_count,
    select_files,
)
from components.weights.staging.progress import Progress, progress_interval
from components.weights.staging.record import (
    PARTIAL_SUFFIX,
    Staging,
    _record,
    local_files,
    local_size,
    record_describes,
    same_content,
)


def check_no_foreign_files(repo: str, dest_dir: Path, foreign: list[str], manifest: Path) -> None:
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise StageError(
            f"{repo}: {dest_dir} holds {shown}, which the hub listing does not name and this program did not "
            f"stage (not in {manifest}); it is not deleted. Remove or move it by hand, or use another weights.root"
        )


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
