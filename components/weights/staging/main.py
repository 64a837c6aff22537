"""Stage the checkpoint into <root>: runs ON THE HEAD NODE, inside a throwaway container of the staging image.

Self-contained on purpose (stdlib + huggingface_hub only): the program ships this package's files to the node
as one zip application (`manifest.stage_program_text`: the files `shipped.module_files` finds from this module's
imports, and a __main__.py calling `main`) and runs it with the image's python3. The plan (which repos, which
files, which count rules) comes as JSON from `components/weights/manifest.py`; this program only enforces it.
The modules beside this one hold it by idea: plan.py (the plan, its rules), hub.py (listing), digests.py
(content ids), download.py, record.py, progress.py, repo.py (a repo's staging run), engram.py (the slim Engram
directory), page_cache.py, messages.py (stderr lines).

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
import json
import os
import sys
from pathlib import Path
from typing import Any

from components.weights.staging.engram import build_engram_vllm, engram_sources
from components.weights.staging.messages import StageError, say
from components.weights.staging.page_cache import drop_page_cache, report_page_cache
from components.weights.staging.plan import MANIFEST_MARKER, RepoPlan, plan_streams
from components.weights.staging.progress import Progress
from components.weights.staging.record import MANIFEST_FILE, Staging, load_records, load_repos
from components.weights.staging.repo import fetch_all, finish_repo, list_repo, prepare_repo


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
