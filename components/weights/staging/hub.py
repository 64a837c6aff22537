"""The hub: revisions resolved to commits, repo trees listed with their content ids, every listed path checked.

Part of the staging program (components/weights/staging/main.py), which runs on the head node.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from components.weights.staging.messages import StageError
from components.weights.staging.plan import HubFile

DEFAULT_ENDPOINT = "https://huggingface.co"


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
