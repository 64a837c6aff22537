"""Hugging Face hub stand-in on a loopback address: the part of the hub API that `huggingface_hub` uses to
list and download a model repo, serving the small checkpoint of `sim/checkpoint.py` from memory.

Routes (revision is `main` or the repo's commit id):
  GET       /api/models/{org}/{name}/tree/{rev}[/{dir}]   JSON list of {type, path, size, oid[, lfs]}
  GET       /api/models/{org}/{name}[/revision/{rev}]     model info (id, sha, siblings; with ?blobs=true each
                                                          sibling has size, blobId[, lfs])
  HEAD|GET  /{org}/{name}/resolve/{rev}/{path}            the file, with X-Repo-Commit, ETag, Content-Length
                                                          (and Range support, which the client uses to resume)

Content ids as the real hub gives them: *.safetensors are LFS files, listed with `lfs: {oid: <sha256>, size,
pointerSize}` in the tree (`lfs: {sha256, size, pointerSize}` in model info), their `oid` / `blobId` the git
blob id of the LFS pointer and their ETag the sha256; other files' `oid` and ETag are their own git blob id.
huggingface_hub reads these into `RepoFile.lfs.sha256` / `RepoSibling.lfs.sha256` and `.blob_id`.
  GET       /api/sim/health                               {"ok": true, "repos": {repo: commit}}
Anything else is a 404 (the client's `GET /api/agent-harnesses` probe among them; it ignores that).

Fault switch for tests: a file is MISSING when it is named (as `{org}/{name}/{path}`) in the env var
SIM_HUB_MISSING (comma-separated, read at start) or on a line of the --faults file (re-read on every request,
so a test can flip it while the hub runs). A missing file is absent from listings and 404s with
`X-Error-Code: EntryNotFound`. A line `listed:{org}/{name}/{path}` keeps the file in listings but 404s on
download (a stale listing). One line per request is logged to stderr: `METHOD path status`.

Throttle, for the staging bench: every file body (`resolve`) is sent at most at N bytes per second per
connection (each download its own cap, as a CDN caps one stream), N from `--rate-per-connection`, else the env
var SIM_HUB_RATE_PER_CONNECTION (read at start), overridden while the --faults file holds a line `rate:N`
(`rate:0`: no cap). Listings and model info are never throttled.

A line `revoked:TOKEN` makes every request carrying that bearer token a 401 (`Invalid credentials in Authorization
header`), as the real hub answers a revoked or mistyped token even on a public repo.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import ipaddress
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from sim import checkpoint

DEFAULT_PORT = 5080


@dataclass(frozen=True)
class Faults:
    hidden: frozenset[str] = frozenset()  # absent everywhere
    unresolvable: frozenset[str] = frozenset()  # listed, but 404 on resolve
    rate: int | None = None  # `rate:N`: bytes per second per connection (0: no cap); None: the hub's own
    revoked: frozenset[str] = frozenset()  # `revoked:TOKEN`: a token the hub refuses (401), as a revoked one

    @staticmethod
    def parse(entries: Iterable[str]) -> Faults:
        hidden: set[str] = set()
        unresolvable: set[str] = set()
        rate: int | None = None
        revoked: set[str] = set()
        for raw in entries:
            entry = raw.strip()
            if not entry or entry.startswith("#"):
                continue
            if entry.startswith("listed:"):
                unresolvable.add(entry[len("listed:") :].strip().strip("/"))
            elif entry.startswith("rate:"):
                rate = parse_rate(entry[len("rate:") :], "the faults file's rate: line")
            elif entry.startswith("revoked:"):
                revoked.add(entry[len("revoked:") :].strip())
            else:
                hidden.add(entry.strip("/"))
        return Faults(frozenset(hidden), frozenset(unresolvable), rate, frozenset(revoked))


def parse_rate(text: str, where: str) -> int:
    """A per-connection cap in bytes per second: a whole number, 0 for none."""
    try:
        rate = int(text.strip())
    except ValueError:
        raise ValueError(f"{where} is {text.strip()!r}: give bytes per second per connection, e.g. 4194304") from None
    if rate < 0:
        raise ValueError(f"{where} is {rate}: give bytes per second per connection (0: no cap)")
    return rate


@dataclass
class Hub:
    repos: dict[str, dict[str, bytes]]
    env_missing: tuple[str, ...] = ()
    faults_file: Path | None = None
    rate_per_connection: int = 0  # bytes per second each file body is sent at, at most; 0: no cap
    commits: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.commits = {repo: checkpoint.repo_commit(files) for repo, files in self.repos.items()}

    def faults(self) -> Faults:
        entries = list(self.env_missing)
        if self.faults_file is not None:
            with contextlib.suppress(FileNotFoundError):
                entries += self.faults_file.read_text().splitlines()
        return Faults.parse(entries)

    def visible(self, repo: str) -> dict[str, bytes]:
        hidden = self.faults().hidden
        return {p: d for p, d in self.repos[repo].items() if f"{repo}/{p}" not in hidden}

    def resolvable(self, repo: str, path: str) -> bytes | None:
        faults = self.faults()
        key = f"{repo}/{path}"
        if key in faults.hidden or key in faults.unresolvable:
            return None
        return self.repos[repo].get(path)

    def rate(self) -> int:
        """The cap for a body starting now: the faults file's `rate:` line while it has one, else the hub's."""
        live = self.faults().rate
        return self.rate_per_connection if live is None else live

    def known_revision(self, repo: str, rev: str) -> bool:
        return rev in ("main", self.commits[repo])


def tree_entry(path: str, data: bytes) -> dict[str, Any]:
    """One file of a tree listing, in the hub API's shape."""
    if not checkpoint.is_lfs(path):
        return {"type": "file", "path": path, "size": len(data), "oid": checkpoint.blob_oid(data)}
    pointer = checkpoint.lfs_pointer(data)
    return {
        "type": "file",
        "path": path,
        "size": len(data),
        "oid": checkpoint.blob_oid(pointer),
        "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)},
    }


def sibling(path: str, data: bytes, blobs: bool) -> dict[str, Any]:
    """One file of model info's `siblings`; sizes and content ids only with `?blobs=true`, as the hub does."""
    if not blobs:
        return {"rfilename": path}
    entry = tree_entry(path, data)
    out: dict[str, Any] = {"rfilename": path, "size": len(data), "blobId": entry["oid"]}
    if "lfs" in entry:
        lfs = entry["lfs"]
        out["lfs"] = {"sha256": lfs["oid"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
    return out


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a single `bytes=a-b` / `bytes=a-` / `bytes=-n` range, or None for the whole file."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[len("bytes=") :].strip().partition("-")
    try:
        if first == "":
            n = int(last)
            return (max(size - n, 0), size - 1) if n > 0 else None
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    return (start, min(end, size - 1)) if start <= end else None


def make_handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "dsv41-sim-hub"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            pass

        def _send(
            self, code: int, body: bytes = b"", headers: dict[str, str] | None = None, *, paced: bool = False
        ) -> None:
            self.send_response(code)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                rate = hub.rate() if paced else 0
                if rate:
                    write_paced(self.wfile, body, rate)
                else:
                    self.wfile.write(body)
            print(f"{self.command} {self.path} {code}", file=sys.stderr, flush=True)

        def _error(self, code: int, error_code: str, message: str) -> None:
            self._send(
                code,
                _json_bytes({"error": message}),
                {"X-Error-Code": error_code, "X-Error-Message": message, "Content-Type": "application/json"},
            )

        def _repo(self, org: str, name: str, rev: str | None) -> str | None:
            repo = f"{org}/{name}"
            if repo not in hub.repos:
                self._error(404, "RepoNotFound", f"Repository {repo} not found")
                return None
            if rev is not None and not hub.known_revision(repo, rev):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return repo

        def _tree(self, org: str, name: str, rev: str, sub: str) -> None:
            repo = self._repo(org, name, rev)
            if repo is None:
                return
            prefix = f"{sub.strip('/')}/" if sub.strip("/") else ""
            files = {p: d for p, d in hub.visible(repo).items() if p.startswith(prefix)}
            dirs = sorted({p[:i] for p in files for i in range(len(p)) if p[i] == "/" and i > len(prefix)})
            entries: list[dict[str, Any]] = [{"type": "directory", "path": d, "oid": "0" * 40, "size": 0} for d in dirs]
            entries += [tree_entry(p, d) for p, d in sorted(files.items())]
            self._send(200, _json_bytes(entries), {"Content-Type": "application/json"})

        def _info(self, org: str, name: str, rev: str) -> None:
            repo = self._repo(org, name, rev)
            if repo is None:
                return
            blobs = parse_qs(urlsplit(self.path).query).get("blobs", ["false"])[-1].lower() == "true"
            siblings = [sibling(p, d, blobs) for p, d in sorted(hub.visible(repo).items())]
            self._send(
                200,
                _json_bytes(
                    {
                        "id": repo,
                        "modelId": repo,
                        "sha": hub.commits[repo],
                        "private": False,
                        "gated": False,
                        "disabled": False,
                        "tags": [],
                        "siblings": siblings,
                    }
                ),
                {"Content-Type": "application/json"},
            )

        def _resolve(self, org: str, name: str, rev: str, path: str) -> None:
            repo = self._repo(org, name, rev)
            if repo is None:
                return
            data = hub.resolvable(repo, path)
            if data is None:
                self._error(404, "EntryNotFound", f"{path} does not exist on {rev} of {repo}")
                return
            etag = hashlib.sha256(data).hexdigest() if checkpoint.is_lfs(path) else checkpoint.blob_oid(data)
            headers = {
                "X-Repo-Commit": hub.commits[repo],
                "ETag": f'"{etag}"',
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            span = _parse_range(self.headers.get("Range"), len(data))
            if span is None:
                self._send(200, data, headers, paced=True)
                return
            start, end = span
            if start >= len(data):
                self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                return
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            self._send(206, data[start : end + 1], headers, paced=True)

        def _route(self) -> None:
            raw = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
            if token and token in hub.faults().revoked:
                # The real hub refuses a bad token on every route, public repos included.
                self._error(401, "Unauthorized", "Invalid credentials in Authorization header")
                return
            if raw[:3] == ["api", "sim", "health"]:
                self._send(200, _json_bytes({"ok": True, "repos": hub.commits}), {"Content-Type": "application/json"})
            elif raw[:2] == ["api", "models"] and len(raw) >= 6 and raw[4] == "tree":
                self._tree(raw[2], raw[3], raw[5], "/".join(raw[6:]))
            elif raw[:2] == ["api", "models"] and len(raw) == 4:
                self._info(raw[2], raw[3], "main")
            elif raw[:2] == ["api", "models"] and len(raw) == 6 and raw[4] == "revision":
                self._info(raw[2], raw[3], raw[5])
            elif len(raw) >= 5 and raw[2] == "resolve" and raw[0] != "api":
                self._resolve(raw[0], raw[1], raw[3], "/".join(raw[4:]))
            else:
                self._error(404, "NotFound", f"no such route in the hub stand-in: {self.path}")

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._route()

        def do_HEAD(self) -> None:  # noqa: N802
            self._route()

    return Handler


def write_paced(
    out: io.BufferedIOBase,
    body: bytes,
    rate: int,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Write `body` at `rate` bytes per second at most: in pieces of 1/50 s (1 KiB to 256 KiB), each sent no
    earlier than its share of the time allows."""
    step = min(max(rate // 50, 1 << 10), 256 << 10)
    began = clock()
    for sent in range(0, len(body), step):
        out.write(body[sent : sent + step])
        ahead = (sent + step) / rate - (clock() - began)
        if ahead > 0:
            sleep(ahead)


def serve(host: str, port: int, hub: Hub) -> ThreadingHTTPServer:
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"hub host={host!r} is not a loopback address; the stand-in only listens on 127.0.0.0/8")
    server = ThreadingHTTPServer((host, port), make_handler(hub))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Hugging Face hub stand-in serving the simulated checkpoint.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--faults", type=Path, help="file naming missing files, re-read on every request")
    parser.add_argument("--pidfile", type=Path)
    parser.add_argument(
        "--rate-per-connection",
        type=lambda v: parse_rate(v, "--rate-per-connection"),
        default=None,
        help="bytes per second each download is sent at, at most (default: SIM_HUB_RATE_PER_CONNECTION, else none)",
    )
    ns = parser.parse_args(argv)
    env_missing = tuple(e for e in os.environ.get("SIM_HUB_MISSING", "").split(",") if e.strip())
    rate = ns.rate_per_connection
    if rate is None:
        rate = parse_rate(os.environ.get("SIM_HUB_RATE_PER_CONNECTION") or "0", "SIM_HUB_RATE_PER_CONNECTION")
    hub = Hub(repos=checkpoint.build(), env_missing=env_missing, faults_file=ns.faults, rate_per_connection=rate)
    server = serve(ns.host, ns.port, hub)
    if ns.pidfile:
        ns.pidfile.write_text(f"{os.getpid()}\n")
    capped = f", each download capped at {rate} B/s" if rate else ""
    print(f"hub stand-in on http://{ns.host}:{server.server_address[1]}{capped}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
