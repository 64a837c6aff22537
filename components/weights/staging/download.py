"""One file downloaded, hashed as it is written, resumed from an earlier run's partial, checked, moved into place.

Part of the staging program (components/weights/staging/main.py), which runs on the head node.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import BinaryIO, cast

from components.weights.staging.digests import DownloadStopped, HashingWriter, _Digests, digests_for, hash_into
from components.weights.staging.hub import _hub_errors
from components.weights.staging.messages import StageError, say
from components.weights.staging.plan import HubFile
from components.weights.staging.progress import Transfer
from components.weights.staging.record import PARTIAL_SUFFIX, local_size


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
