"""The record of what was staged, at the weights root on the head, and what is on disk beside it.

Part of the staging program (components/weights/staging/main.py), which runs on the head node.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.weights.staging.digests import _Digests
from components.weights.staging.messages import say
from components.weights.staging.plan import HubFile

# The staging step's record, at the weights root on the head (JSON, readable by any later step).
MANIFEST_FILE = "dsv41-weights-manifest.json"
MANIFEST_FORMAT = 1
# Where a download is written (hashed) before it is verified and moved into place.
PARTIAL_SUFFIX = ".dsv41-partial"
# huggingface_hub's own local_dir metadata (left by earlier versions of this program): not weights.
_CLIENT_METADATA_DIR = ".cache"


def local_size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


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
        # The name the program had as one file: the same text, so an unchanged record is not rewritten.
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
