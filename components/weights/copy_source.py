"""Serve the head's staged weights to one worker's copier: runs ON THE HEAD, in a throwaway container.

Self-contained (stdlib only): `source.sh` writes this file's text into a temporary directory and runs it with
the serving image's python3, the weights root mounted read-only at --root. It listens on the head's fabric
address (port chosen by the kernel, printed on stdout), answers only the worker's fabric address and only a
request carrying this run's token, and serves only files under the staged directories. It lives exactly as
long as its stdin: the deploying process holds that open over ssh, so when the copy ends, or the deployer or
its ssh dies, the server exits and docker removes the container. No daemon is left on the head.

stdin, first line (JSON): {"token": "...", "allow": ["<worker fabric ip>"], "dirs": ["model", "engram-src"],
"max_lifetime_s": N}.
stdout: `DSV41_COPY_SOURCE_LISTENING <port>` once listening (source.sh prints the root's identity before).

GET /files/<relative path> with `Range: bytes=<start>-` resumes a partial copy; the reply is sent with
sendfile, so the head's CPU is not the bottleneck of a fabric copy.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

LISTENING_MARKER = "DSV41_COPY_SOURCE_LISTENING"


class Source:
    """What the handler may serve, and to whom."""

    def __init__(self, root: Path, dirs: list[str], allow: list[str], token: str) -> None:
        self.root = root.resolve()
        self.dirs = set(dirs)
        self.allow = set(allow)
        self.token = token

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


def make_handler(source: Source) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
            """Quiet: the copier reports progress; an error reply says what was refused."""

        def _refuse(self, code: int, why: str) -> None:
            body = (why + "\n").encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.client_address[0] not in source.allow:
                self._refuse(403, f"{self.client_address[0]} is not a worker of this deployment")
                return
            given = self.headers.get("Authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), source.token.encode()):
                self._refuse(401, "wrong or missing copy token")
                return
            url = urllib.parse.urlsplit(self.path)
            if not url.path.startswith("/files/"):
                self._refuse(404, "only /files/<path> is served")
                return
            rel = urllib.parse.unquote(url.path[len("/files/"):])
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
                        start = int(ranged[len("bytes="):-1])
                    except ValueError:
                        start = -1
                    if not 0 <= start <= size:
                        self._refuse(416, f"range start {ranged} outside 0..{size}")
                        return
                self.send_response(206 if start else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size - start))
                self.send_header("X-File-Size", str(size))
                self.end_headers()
                self.wfile.flush()
                if size > start:
                    self.connection.sendfile(f, start, size - start)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the weights root as mounted in this container")
    parser.add_argument("--bind", required=True, help="the head's fabric address")
    args = parser.parse_args(argv)
    config = json.loads(sys.stdin.readline() or "{}")
    if not config.get("token") or not config.get("allow"):
        print("copy_source: error: stdin's first line must carry the token and the workers' addresses", file=sys.stderr)
        return 2
    source = Source(Path(args.root), list(config.get("dirs") or []), list(config["allow"]), str(config["token"]))
    server = ThreadingHTTPServer((args.bind, 0), make_handler(source))
    server.daemon_threads = True

    def lifeline() -> None:
        # EOF on stdin: the deployer closed it (copy done) or its ssh went away. Either way: stop.
        while sys.stdin.buffer.read(4096):
            pass
        server.shutdown()

    threading.Thread(target=lifeline, daemon=True).start()
    limit = threading.Timer(float(config.get("max_lifetime_s") or 86400), server.shutdown)
    limit.daemon = True
    limit.start()
    print(f"{LISTENING_MARKER} {server.server_address[1]}", flush=True)
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
