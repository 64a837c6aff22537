"""Serve the head's staged weights to one worker's copier: runs ON THE HEAD, in a throwaway container.

Stdlib only, shipped as one zip application of this module and the files its imports name (copy_config.py, the
contract: `local_copy.source_program_text`, from `shipped.module_files`); `source.sh` decodes it into a temporary
directory and runs it with the serving image's python3, the weights root mounted read-only at --root. It listens
on the head's fabric address (port chosen by the kernel, printed on stdout) and serves only files under the
staged directories.

What it bounds, since anything on the fabric can connect:
- the client's address is checked when the connection is accepted, before a thread starts or a byte is read:
  anyone but the worker gets a 403 line and the connection is closed;
- at most `max_connections` connections from the worker at once; one more gets a 503 (the copier retries);
- a request's line and headers must arrive within `request_timeout_s` of the connection (a slow-loris client
  is dropped), and every send or receive on a connection within `io_timeout_s` (a stalled reader is dropped);
- one request per connection, which must carry `Authorization: Bearer <this run's token>`.

It lives exactly as long as the deployer's session: the deployer holds its stdin open over ssh and writes a
heartbeat line every HEARTBEAT_S. EOF (the copy is done, or the deployer or its ssh died) or `silence_s`
without a byte (the deployer's machine or its network vanished, which the head's sshd may not notice for hours)
stops the server, and docker removes the container. No daemon is left on the head.

stdin, first line: the source's config (copy_config.SourceConfig, one line of JSON: the token, the worker's
address, the directories served, the lifetime and the limits). Then heartbeats. stdout:
`DSV41_COPY_SOURCE_LISTENING <port>` once listening (source.sh prints the root's identity before).

GET /files/<relative path> with `Range: bytes=<start>-` resumes a partial copy; the reply is sent with
sendfile, so the head's CPU is not the bottleneck of a fabric copy. When the source stops, every file it sent is
dropped from the head's page cache (`POSIX_FADV_DONTNEED`; not after each send: pages a socket still holds are not
dropped): the copy runs after staging dropped them, and the head's rank starts after it.
"""

from __future__ import annotations

import argparse
import hmac
import io
import os
import select
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from components.contract import ContractError
from components.weights.copy_config import Limits, SourceConfig

LISTENING_MARKER = "DSV41_COPY_SOURCE_LISTENING"
# The deployer writes one heartbeat line this often while it holds the source's stdin (worker_copy.py).
HEARTBEAT_S = 5.0


class Source:
    """What the handler may serve, and to whom."""

    def __init__(self, root: Path, dirs: Sequence[str], allow: Sequence[str], token: str) -> None:
        self.root = root.resolve()
        self.dirs = set(dirs)
        self.allow = set(allow)
        self.token = token
        self._sent: set[Path] = set()
        self._sent_lock = threading.Lock()

    def sent(self, path: Path) -> None:
        with self._sent_lock:
            self._sent.add(path)

    def drop_sent(self) -> tuple[int, int]:
        """Drop every file sent from the page cache; (files, bytes). The GB10 driver does not reclaim page cache,
        and the head's rank starts after the copy. Clean pages only (a read-only mount): no flush first."""
        files = size = 0
        with self._sent_lock:
            sent = sorted(self._sent)
        for path in sent:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                files += 1
                size += os.fstat(fd).st_size
            except OSError:
                pass  # best effort: the ranks check MemAvailable before they start
            finally:
                os.close(fd)
        return files, size

    def resolve(self, rel: str) -> Path | None:
        """The staged file `rel` names, or None: never a path outside the staged directories (no `..`, no
        symlink out of the root, not the record or anything else at the root)."""
        parts = rel.split("/")
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] not in self.dirs:
            return None
        path = (self.root / rel).resolve()
        if not path.is_relative_to(self.root / parts[0]) or not path.is_file():
            return None
        return path

    def authorized(self, header: str) -> bool:
        """`Authorization: Bearer <token>` (the scheme in any case, RFC 9110); the token alone is refused."""
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())


class _HeaderDeadline(io.RawIOBase):
    """The connection's reads, all due by one deadline: a request line and headers dribbled in byte by byte
    time out like silent ones. (Only the request is read: a GET has no body.)"""

    def __init__(self, sock: socket.socket, seconds: float, io_timeout_s: float) -> None:
        self._sock = sock
        self._deadline = time.monotonic() + seconds
        self._io_timeout_s = io_timeout_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the request's headers did not arrive in time")  # noqa: UP041 - py3.9's name
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._io_timeout_s)


def _answer_unread(sock: socket.socket, code: int, why: str) -> None:
    """A short refusal written without reading anything (a fresh connection's send buffer takes it at once)."""
    body = (why + "\n").encode()
    phrase = {403: "Forbidden", 503: "Service Unavailable"}.get(code, "Error")
    head = (
        f"HTTP/1.1 {code} {phrase}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    try:
        sock.setblocking(False)
        sock.send(head + body)
    except OSError:
        pass


def make_handler(source: Source, limits: Limits) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = limits.io_timeout_s  # every send and receive (StreamRequestHandler sets it on the socket)

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # an open makefile() would keep the socket open past the server's close
            self.rfile = io.BufferedReader(
                _HeaderDeadline(self.connection, limits.request_timeout_s, limits.io_timeout_s)
            )

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
            """Quiet: the copier reports progress; an error reply says what was refused."""

        def _refuse(self, code: int, why: str) -> None:
            body = (why + "\n").encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            # The address was checked before the request was read (CopySourceServer.verify_request).
            if not source.authorized(self.headers.get("Authorization", "")):
                self._refuse(401, "wrong or missing copy token: send `Authorization: Bearer <token>`")
                return
            url = urllib.parse.urlsplit(self.path)
            if not url.path.startswith("/files/"):
                self._refuse(404, "only /files/<path> is served")
                return
            rel = urllib.parse.unquote(url.path[len("/files/") :])
            path = source.resolve(rel)
            if path is None:
                self._refuse(404, f"{rel} is not a staged file")
                return
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                start = 0
                ranged = self.headers.get("Range", "")
                if ranged.startswith("bytes=") and ranged.endswith("-"):
                    try:
                        start = int(ranged[len("bytes=") : -1])
                    except ValueError:
                        start = -1
                    if not 0 <= start <= size:
                        self._refuse(416, f"range start {ranged} outside 0..{size}")
                        return
                self.send_response(206 if start else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size - start))
                self.send_header("X-File-Size", str(size))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.flush()
                if size > start:
                    self.connection.sendfile(f, start, size - start)
                source.sent(path)

    return Handler


class CopySourceServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that decides at accept time: the worker's address only, `max_connections` at most."""

    daemon_threads = True
    request_queue_size = 128  # a burst of connections waits in the kernel for the accept-time check

    def __init__(self, address: tuple[str, int], source: Source, limits: Limits) -> None:
        self.source = source
        self.limits = limits
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(address, make_handler(source, limits))

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if client_address[0] not in self.source.allow:
            _answer_unread(request, 403, f"{client_address[0]} is not a worker of this deployment")
            return False
        if not self.slots.acquire(blocking=False):
            _answer_unread(request, 503, f"{self.limits.max_connections} connections are open already; retry")
            return False
        return True

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread started: it cannot release its slot
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        print(
            f"copy_source: connection from {client_address[0]} ended: {type(err).__name__}: {err}",
            file=sys.stderr,
            flush=True,
        )


def read_line(fd: int) -> str:
    """stdin's first line, read unbuffered: every later byte is a heartbeat the lifeline must see."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return line.decode()


def lifeline(fd: int, silence_s: float, stop: Callable[[], None]) -> None:
    """Stop when the deployer's session is gone: EOF on stdin, or `silence_s` without a heartbeat."""
    while True:
        ready, _, _ = select.select([fd], [], [], silence_s)
        if not ready:
            print(
                f"copy_source: no heartbeat from the deployer for {silence_s:g} s: its session is gone; stopping",
                file=sys.stderr,
                flush=True,
            )
            break
        if not os.read(fd, 4096):  # EOF: the deployer closed it (copy done) or its ssh went away
            break
    stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the weights root as mounted in this container")
    parser.add_argument("--bind", required=True, help="the head's fabric address")
    args = parser.parse_args(argv)
    stdin = sys.stdin.fileno()
    try:
        config = SourceConfig.from_json(read_line(stdin))
    except ContractError as err:
        print(
            f"copy_source: error: stdin's first line must carry the token and the workers' addresses ({err})",
            file=sys.stderr,
        )
        return 2
    source = Source(Path(args.root), config.dirs, config.allow, config.token)
    limits = config.limits
    server = CopySourceServer((args.bind, 0), source, limits)
    threading.Thread(target=lifeline, args=(stdin, limits.silence_s, server.shutdown), daemon=True).start()
    limit = threading.Timer(config.max_lifetime_s, server.shutdown)
    limit.daemon = True
    limit.start()
    print(f"{LISTENING_MARKER} {server.server_address[1]}", flush=True)
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    files, size = source.drop_sent()
    print(
        f"copy_source: page cache: dropped the pages of the {files} files sent ({size / 2**30:.2f} GiB)",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
