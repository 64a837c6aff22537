"""The staged files' pages dropped from the head's page cache, once every file is checked.

Part of the staging program (components/weights/staging/main.py), which runs on the head node.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.weights.staging.messages import say


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
