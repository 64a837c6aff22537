"""Fill one worker's local copy of the weights from the head: runs ON THE WORKER, in a throwaway container.

Stdlib only, shipped as one zip application of this module and the files its imports name (copy_config.py, the
contract: `local_copy.copier_program_text`, from `shipped.module_files`); `copy.sh` decodes it and runs it with the
serving image's python3, the worker's copy root mounted at --dest. The expected files come from the deployer (what
the head's staging verified against the hub: size and sha256 per file), never from the head's say-so.

Per file, largest first, in --streams parallel streams:
- kept without reading when the record (`dsv41-weights-copy.tsv` at the copy root) says it was verified
  with this sha256 and size, and its size and mtime are still the recorded ones;
- otherwise a file of the right size is hashed once: kept (and recorded) when it matches;
- otherwise fetched from the head's source into `<name>.dsv41-partial` (a partial file left by an
  interrupted run is hashed and resumed with a Range request, not fetched again), hashed as it is written,
  checked, fsynced and only then renamed into place: a rank never sees a half-written file. A source at its
  connection cap (503, or a connection reset before any reply) is asked again for up to BUSY_RETRY_S;
- but first, when another file of the copy is recorded as verified with the same sha256 and size (and its size
  and mtime are still the recorded ones), hardlinked from it instead: an upgrade that moved files between
  directories (the Engram shards, from `engram-src/` to the slim `engram-vllm/`) copies none of them again.
The record is rewritten (temporary name, rename) after every file, so an interrupted copy resumes without
copying a finished file again. A file the record names that is no longer expected (an older revision this
program copied) is removed; a file nobody recorded is left alone.
Then every expected file's pages (copied now or kept) are dropped from the worker's page cache (`fdatasync`,
then `POSIX_FADV_DONTNEED`; no root needed, only these files): the GB10 driver allocates the rank's memory from
free memory and does not reclaim page cache, and the rank starts right after the copy.

stdin, first line: the copier's config (copy_config.CopierConfig, one line of JSON: the token and the expected
files). Progress and errors on stderr (an error is one line starting with
"copy_weights: error:"); success prints `DSV41_COPY_REPORT {...}` on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import http.client
import json
import os
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import BinaryIO

from components.contract import ContractError
from components.weights.copy_config import CopierConfig, ExpectedFile

REPORT_MARKER = "DSV41_COPY_REPORT"
RECORD_FILE = "dsv41-weights-copy.tsv"
PARTIAL_SUFFIX = ".dsv41-partial"
_CHUNK = 4 << 20
# A stream that receives nothing for this long is a dead link, not a slow one: fail instead of hanging.
STALL_S = 120.0
# A source at its connection cap answers 503, or resets a connection it could not take: wait, then ask again.
BUSY_RETRY_S = 120.0
_BUSY_PAUSE_S = 0.5


class CopyError(Exception):
    """A failure the operator can act on; the message names the node, the file and the fix."""


def mtime_text(st: os.stat_result) -> str:
    """The mtime as GNU `stat -c %.9Y` prints it: copy_check.sh compares the two texts."""
    return f"{st.st_mtime_ns // 1_000_000_000}.{st.st_mtime_ns % 1_000_000_000:09d}"


def read_record(dest: Path) -> dict[str, tuple[str, int, str]]:
    """{path: (sha256, size, mtime)} from the record; a malformed line is ignored (that file is re-checked)."""
    out: dict[str, tuple[str, int, str]] = {}
    try:
        text = (dest / RECORD_FILE).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) == 4 and parts[1].isdigit():
            out[parts[3]] = (parts[0], int(parts[1]), parts[2])
    return out


class Record:
    """The record, rewritten atomically after every file (several streams finish files concurrently)."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.rows = read_record(dest)
        self.lock = threading.Lock()

    def set(self, path: str, sha: str, st: os.stat_result) -> None:
        with self.lock:
            self.rows[path] = (sha, st.st_size, mtime_text(st))
            self._write()

    def drop(self, path: str) -> None:
        with self.lock:
            if self.rows.pop(path, None) is not None:
                self._write()

    def _write(self) -> None:
        text = "".join(f"{sha}\t{size}\t{mtime}\t{path}\n" for path, (sha, size, mtime) in sorted(self.rows.items()))
        tmp = self.dest / f".{RECORD_FILE}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.dest / RECORD_FILE)


def _hash_into(h: hashlib._Hash, f: BinaryIO) -> int:
    n = 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        n += len(chunk)
    return n


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        _hash_into(h, f)
    return h.hexdigest()


class Copier:
    def __init__(self, *, node: str, source: str, bind: str, token: str, dest: Path, host_dest: str) -> None:
        self.node = node
        self.url = urllib.parse.urlsplit(source)
        self.bind = bind
        self.token = token
        self.dest = dest
        self.host_dest = host_dest
        self.record = Record(dest)
        self.bytes_copied = 0
        self.lock = threading.Lock()

    def _where(self, rel: str) -> str:
        return f"{self.host_dest}/{rel} on {self.node}"

    def current(self, e: ExpectedFile) -> bool:
        """True when the file in place is the expected one (by the record, else by hashing it once)."""
        path = self.dest / e.path
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        if st.st_size != e.size:
            return False
        row = self.record.rows.get(e.path)
        if row == (e.sha256, e.size, mtime_text(st)):
            return True
        if file_sha256(path) == e.sha256:
            self.record.set(e.path, e.sha256, path.stat())
            return True
        print(
            f"copy_weights: {self._where(e.path)} has the right size but other content: copying it again",
            file=sys.stderr,
        )
        return False

    def _get(self, rel: str, headers: dict[str, str]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """The source's reply to GET /files/<rel>; a busy source is asked again for up to BUSY_RETRY_S."""
        deadline = time.monotonic() + BUSY_RETRY_S
        while True:
            conn = http.client.HTTPConnection(
                self.url.hostname or "", self.url.port, timeout=STALL_S, source_address=(self.bind, 0)
            )
            try:
                conn.request("GET", "/files/" + urllib.parse.quote(rel), headers=headers)
                reply = conn.getresponse()
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                conn.close()
                if time.monotonic() >= deadline:
                    raise
            except BaseException:
                conn.close()
                raise
            else:
                if reply.status != 503 or time.monotonic() >= deadline:
                    return conn, reply
                conn.close()
            time.sleep(_BUSY_PAUSE_S)

    def fetch(self, e: ExpectedFile) -> int:
        """Copy one file from the head; returns the bytes received."""
        path = self.dest / e.path
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        start = 0
        if partial.exists():
            with partial.open("rb") as f:
                start = _hash_into(h, f)
            if start > e.size:
                partial.unlink()
                h, start = hashlib.sha256(), 0
        received = 0
        conn: http.client.HTTPConnection | None = None
        try:
            headers = {"Authorization": f"Bearer {self.token}"}
            if start:
                headers["Range"] = f"bytes={start}-"
            conn, reply = self._get(e.path, headers)
            if reply.status not in (200, 206) or (start and reply.status != 206):
                why = reply.read(500).decode(errors="replace").strip()
                raise CopyError(f"the head's source answered {reply.status} for {e.path}: {why}")
            with partial.open("ab" if start else "wb") as out:
                if not start:
                    out.truncate(0)
                while chunk := reply.read(_CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    received += len(chunk)
                out.flush()
                os.fsync(out.fileno())
        except (OSError, http.client.HTTPException) as err:
            raise CopyError(
                f"copying {e.path} from the head to {self.node} failed after {start + received} of "
                f"{e.size} bytes ({err}); run `pulumi up` again: it resumes this file"
            ) from None
        finally:
            if conn is not None:
                conn.close()
        size = partial.stat().st_size
        if size != e.size or h.hexdigest() != e.sha256:
            partial.unlink()
            raise CopyError(
                f"{e.path} as read from the head ({size} bytes, sha256 {h.hexdigest()[:12]}...) is not what staging "
                f"verified ({e.size} bytes, sha256 {e.sha256[:12]}...): the head's copy changed since staging; "
                "re-stage it (`pulumi up --replace` on the weights stage step) and run again"
            )
        os.replace(partial, path)
        self.record.set(e.path, e.sha256, path.stat())
        return received

    def link_verified(self, todo: list[ExpectedFile]) -> list[str]:
        """The files of `todo` another verified file of this copy holds: hardlinked from it (renamed into place,
        recorded), not fetched. Returns their paths; a link that cannot be made is left to the fetch."""
        donors: dict[tuple[str, int], Path] = {}
        for rel, (sha, size, mtime) in sorted(self.record.rows.items()):
            with contextlib.suppress(OSError):
                st = (self.dest / rel).stat()
                if st.st_size == size and mtime_text(st) == mtime:
                    donors.setdefault((sha, size), self.dest / rel)
        linked: list[str] = []
        for e in todo:
            donor = donors.get((e.sha256, e.size))
            path = self.dest / e.path
            if donor is None or donor == path:
                continue
            tmp = path.with_name(f".{path.name}.dsv41-link")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.unlink(missing_ok=True)
                os.link(donor, tmp)
                os.replace(tmp, path)
            except OSError:
                continue
            self.record.set(e.path, e.sha256, path.stat())
            linked.append(e.path)
            print(
                f"copy_weights: {self.node}: {e.path} linked to {donor.relative_to(self.dest).as_posix()} "
                "(verified, the same sha256): nothing copied",
                file=sys.stderr,
            )
        return linked

    def run(self, expected: list[ExpectedFile], streams: int) -> dict[str, object]:
        began = time.monotonic()
        wanted = {e.path for e in expected}
        todo = [e for e in sorted(expected, key=lambda e: -e.size) if not self.current(e)]
        # Before anything is removed: a verified file no longer expected where it is may be expected elsewhere.
        linked = self.link_verified(todo)
        todo = [e for e in todo if e.path not in linked]
        removed = []
        for rel in sorted(set(self.record.rows) - wanted):
            # An older revision's file that this program copied: it would sit beside the new shards.
            with contextlib.suppress(FileNotFoundError):
                (self.dest / rel).unlink()
            self.record.drop(rel)
            removed.append(rel)
        total = sum(e.size for e in todo)
        if todo:
            print(
                f"copy_weights: {self.node}: copying {len(todo)} of {len(expected)} files "
                f"({total / 2**30:.2f} GiB) in {min(streams, len(todo))} streams",
                file=sys.stderr,
            )
        copied: list[str] = []
        with ThreadPoolExecutor(max_workers=max(1, streams)) as pool:
            futures = {pool.submit(self.fetch, e): e for e in todo}
            for done in as_completed(futures):
                e = futures[done]
                received = done.result()  # the first failure ends the run with its message
                with self.lock:
                    self.bytes_copied += received
                    copied.append(e.path)
                    print(
                        f"copy_weights: {self.node}: {e.path} ({e.size / 2**20:.1f} MiB) [{len(copied)}/{len(todo)}]",
                        file=sys.stderr,
                    )
        seconds = time.monotonic() - began
        # Verified: now out of the worker's memory, before its rank starts and the GB10 driver allocates from it.
        dropped, failed = drop_page_cache([self.dest / e.path for e in expected])
        not_dropped = f"; not dropped: {'; '.join(failed[:3])}" if failed else ""
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        print(
            f"copy_weights: {self.node}: page cache: dropped the pages of {dropped['files']} files "
            f"({dropped['bytes'] / 2**30:.2f} GiB){not_dropped}{more}",
            file=sys.stderr,
        )
        return {
            "copied": sorted(copied),
            "bytes": self.bytes_copied,
            "seconds": round(seconds, 3),
            "files": len(expected),
            "removed": removed,
            "linked": sorted(linked),
            "root": self.host_dest,
            "page_cache": dropped,
        }


def drop_page_cache(paths: list[Path]) -> tuple[dict[str, int], list[str]]:
    """Flush, then drop from the page cache, each file (a hard link once); ({files, bytes, failed}, why each failed).

    The staging program's drop_page_cache (staging/page_cache.py) does the same on the head (each program is
    shipped alone, so each keeps these lines). `fdatasync` first: DONTNEED leaves dirty pages. A failure is named,
    never fatal: the rank's own memory check before start is the guard."""
    seen: set[tuple[int, int]] = set()
    files = size = 0
    failed: list[str] = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            failed.append(f"{path}: {exc.strerror or exc}")
            continue
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:
                continue
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
    return {"files": files, "bytes": size, "failed": len(failed)}, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True)
    parser.add_argument("--source", required=True, help="http://<head fabric ip>:<port>")
    parser.add_argument("--bind", required=True, help="this worker's fabric address (the copy uses the fabric)")
    parser.add_argument("--dest", required=True, help="the copy root as mounted in this container")
    parser.add_argument("--host-dest", required=True, help="the copy root on the worker, for messages")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--dest-ident", default="", help="machine-id:dev:inode of the copy root on the worker")
    parser.add_argument("--source-ident", default="", help="the same of the weights root on the head")
    args = parser.parse_args(argv)
    try:
        if args.dest_ident and args.dest_ident == args.source_ident:
            raise CopyError(
                f"the copy root {args.host_dest} on {args.node} is the head's weights root itself (one "
                "filesystem): set weights.copyRoot to a directory of its own on each worker, e.g. "
                "`/var/lib/dsv41-exl3/{node}`"
            )
        try:
            config = CopierConfig.from_json(sys.stdin.readline())
        except ContractError as err:
            raise CopyError(
                f"stdin's first line is not the copier's config (the token, the expected files): {err}"
            ) from None
        copier = Copier(
            node=args.node,
            source=args.source,
            bind=args.bind,
            token=config.token,
            dest=Path(args.dest),
            host_dest=args.host_dest,
        )
        report = copier.run(list(config.expected), args.streams)
    except CopyError as err:
        print(f"copy_weights: error: {err}", file=sys.stderr)
        return 1
    print(f"{REPORT_MARKER} {json.dumps(report, sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
