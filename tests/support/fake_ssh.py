"""A fake `ssh` on PATH that records its argv and answers from canned files, and a loopback /v1/models."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

FAKE_SSH = r"""#!/bin/sh
# Records its argv, answers from canned files chosen by the remote command (the last argument).
d="$FAKE_SSH_DIR"
for a in "$@"; do printf '%s\n' "$a"; done >> "$d/argv.log"
printf '%s\n' '---' >> "$d/argv.log"
for last in "$@"; do :; done
printf '%s\n' "$last" >> "$d/remote.log"
case "$last" in
  *"docker inspect"*) kind=inspect ;;
  *"docker logs"*) kind=logs ;;
  *) kind=other ;;
esac
n=$(cat "$d/$kind.n" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "$d/$kind.n"
f="$d/$kind.$n"; [ -f "$f.rc" ] || f="$d/$kind"
cat "$f.out" 2>/dev/null
cat "$f.err" >&2 2>/dev/null
exit "$(cat "$f.rc" 2>/dev/null || echo 0)"
"""

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nSECRETKEYMATERIAL0123456789\n-----END OPENSSH PRIVATE KEY-----\n"


def install_fake_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put the canned `ssh` first on PATH; return the directory of its canned answers and logs."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    data = tmp_path / "ssh-data"
    data.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_DIR", str(data))
    return data  # key files go to the session's private XDG_RUNTIME_DIR (tests/conftest.py)


def canned(d: Path, name: str, out: str = "", rc: int = 0, err: str = "") -> None:
    (d / f"{name}.out").write_text(out)
    (d / f"{name}.rc").write_text(str(rc))
    (d / f"{name}.err").write_text(err)


@dataclass
class ModelsServer:
    base: str
    seen: list[dict[str, str]]
    plan: dict[str, object]


@contextmanager
def serve_models(ids: list[str], api_key: str | None = None) -> Iterator[ModelsServer]:
    """A loopback stand-in for vLLM's /v1/models; answers 401 when api_key is set and not presented."""
    seen: list[dict[str, str]] = []
    plan: dict[str, object] = {"status": 200, "ids": ids}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append({"path": self.path, "auth": self.headers.get("Authorization", "")})
            ids = plan["ids"]
            assert isinstance(ids, list)
            body = json.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in ids]})
            status = int(str(plan["status"]))
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                status = 401
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ModelsServer(f"http://127.0.0.1:{server.server_address[1]}", seen, plan)
    finally:
        server.shutdown()
        server.server_close()
