"""Content ids, computed while the bytes go by: sha256 and the git blob id, fed as a download is written.

Part of the staging program (components/weights/staging/main.py), which runs on the head node.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import BinaryIO

from components.weights.staging.plan import HubFile
from components.weights.staging.progress import Transfer

_HASH_CHUNK = 8 << 20


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
