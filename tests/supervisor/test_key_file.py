"""The leader reads the endpoint's API key from the head rank's key file (docker's archive API), never from a
configured env that `docker inspect` shows; a head container from before the key moved still has it there."""

from __future__ import annotations

import io
import socketserver
import tarfile
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from components.labels import KEY_FILE
from components.supervisor import agent
from components.supervisor.node_docker import Docker


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def tar_of(name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[str, dict[tuple[str, str], bytes], dict[str, list[str]]]]:
    """A docker daemon on a unix socket answering what the leader asks: a file from a container (archive, as
    `docker cp` gets it), a container's inspect."""
    files: dict[tuple[str, str], bytes] = {}
    envs: dict[str, list[str]] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def address_string(self) -> str:
            return "unix"

        def do_GET(self) -> None:  # noqa: N802
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.split("/")  # ['', 'containers', name, what]
            name, what = urllib.parse.unquote(parts[2]), parts[3]
            if what == "archive":
                path = urllib.parse.parse_qs(url.query)["path"][0]
                body = tar_of(Path(path).name, files[(name, path)]) if (name, path) in files else b"{}"
                status = 200 if (name, path) in files else 404
            elif what == "json" and name in envs:
                body, status = (b'{"Config": {"Env": %s}}' % str(envs[name]).replace("'", '"').encode()), 200
            else:
                body, status = b"{}", 404
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    sock = str(tmp_path / "docker.sock")
    server = UnixHTTPServer(sock, Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield sock, files, envs
    finally:
        server.shutdown()
        server.server_close()


def leader_key(sock: str, container: str) -> str | None:
    leader = SimpleNamespace(docker=Docker(sock), lead=SimpleNamespace(nodes=[SimpleNamespace(container=container)]))
    return agent.Leader.api_key(leader)  # type: ignore[arg-type]


def test_the_key_comes_from_the_head_ranks_key_file(daemon: Any) -> None:
    sock, files, envs = daemon
    files[("rank-head", KEY_FILE)] = b"sk-in-the-file-0123456789abcdef0\n"
    envs["rank-head"] = ["PATH=/usr/bin"]
    assert Docker(sock).read_file("rank-head", KEY_FILE) == b"sk-in-the-file-0123456789abcdef0\n"
    assert leader_key(sock, "rank-head") == "sk-in-the-file-0123456789abcdef0"


def test_an_older_head_with_the_key_in_its_env_still_works_and_no_key_is_none(daemon: Any) -> None:
    sock, _files, envs = daemon
    envs["old-head"] = ["PATH=/usr/bin", "VLLM_API_KEY=sk-from-env-0123456789abcdef0123"]
    assert Docker(sock).read_file("old-head", KEY_FILE) is None
    assert leader_key(sock, "old-head") == "sk-from-env-0123456789abcdef0123"
    envs["open-head"] = ["PATH=/usr/bin"]
    assert leader_key(sock, "open-head") is None
    assert leader_key(sock, "no-such-container") is None
