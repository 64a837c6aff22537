"""A local Hugging Face hub stand-in and the staging program run against it, and the staging
command run with a logging fake docker, for the weight store's tests.

The staging program runs for real with the venv's python (standing in for the container's python3) and the
real huggingface_hub client against an http.server on 127.0.0.1.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from components.weights import manifest as wm
from sim import checkpoint

PYTHON = sys.executable  # the venv's python: stands for the staging container's python3
MODEL_REPO = "Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw"
ENGRAM_REPO = "deepseek-ai/DeepSeek-V4.1-Flash"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_SECRETtokenVALUE123"
PREFIX = "dsv41-exl3-dev"


# --- a local hub stand-in --------------------------------------------------------------------------


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
        f"size {len(data)}\n".encode()
    )


@dataclass
class FakeHub:
    """The hub's API shape: tree entries carry `oid` (git blob id; of the pointer for LFS files) and, for
    LFS files (*.safetensors here), `lfs: {oid: sha256, size, pointerSize}`; model info names the commit."""

    repos: dict[str, dict[str, bytes]]
    listed_size: dict[tuple[str, str], int] = field(default_factory=dict)  # tree lies about a size
    listed_sha256: dict[tuple[str, str], str] = field(default_factory=dict)  # tree lies about a content id
    unresolvable: set[tuple[str, str]] = field(default_factory=set)  # listed, but resolve says 404
    commit: str = COMMIT  # what every revision resolves to; a test moves it to make a new revision
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, auth)
    url: str = ""
    # Downloads (GET .../resolve/...), for the streams tests:
    ranges: dict[str, list[str | None]] = field(default_factory=dict)  # file name: each GET's Range header
    corrupt: set[tuple[str, str]] = field(default_factory=set)  # served with one byte flipped (same size)
    delay_s: dict[tuple[str, str], float] = field(default_factory=dict)  # answered (HEAD and GET) this late
    pace: dict[tuple[str, str], float] = field(default_factory=dict)  # body sent at this many bytes/s
    # The first shard downloads wait until this many are being served at once, 10 s at most (then none waits
    # again): only downloads that really overlap get past it early. 0: no waiting. Only shards are held: staging
    # fetches the Engram index and config on their own first.
    hold_until: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    _gauge: threading.Lock = field(default_factory=threading.Lock)
    _all_in: threading.Event = field(default_factory=threading.Event)

    def gets_of(self, suffix: str) -> list[str]:
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p and p.endswith(suffix)]

    def enter_download(self, name: str) -> None:
        with self._gauge:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if self.in_flight >= self.hold_until:
                self._all_in.set()
        if self.hold_until and name.endswith(".safetensors") and not self._all_in.wait(timeout=10):
            self._all_in.set()

    def leave_download(self) -> None:
        with self._gauge:
            self.in_flight -= 1

    def entry(self, repo: str, name: str, data: bytes) -> dict[str, Any]:
        size = self.listed_size.get((repo, name), len(data))
        if not name.endswith(".safetensors"):
            return {"type": "file", "path": name, "oid": git_blob_id(data), "size": size}
        sha = self.listed_sha256.get((repo, name), hashlib.sha256(data).hexdigest())
        pointer = lfs_pointer(data)
        return {
            "type": "file",
            "path": name,
            "oid": git_blob_id(pointer),
            "size": size,
            "lfs": {"oid": sha, "size": size, "pointerSize": len(pointer)},
        }


def hub_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def _send(
            self, code: int, body: bytes = b"", headers: dict[str, str] | None = None, send_body: bool = True
        ) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def _route(self, send_body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Authorization")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                repo = f"{parts[2]}/{parts[3]}"
                if repo not in hub.repos:
                    self._send(
                        404,
                        b'{"error":"Repository not found"}',
                        {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"},
                    )
                    return
                tree = [hub.entry(repo, name, data) for name, data in sorted(hub.repos[repo].items())]
                self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
                return
            if parts[:2] == ["api", "models"] and len(parts) in (4, 6):
                repo = f"{parts[2]}/{parts[3]}"
                if repo not in hub.repos:
                    self._send(
                        404,
                        b'{"error":"Repository not found"}',
                        {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"},
                    )
                    return
                info = {
                    "id": repo,
                    "modelId": repo,
                    "sha": hub.commit,
                    "private": False,
                    "siblings": [{"rfilename": n} for n in sorted(hub.repos[repo])],
                }
                self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
                return
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, name = f"{parts[0]}/{parts[1]}", "/".join(parts[4:])
                time.sleep(hub.delay_s.get((repo, name), 0.0))
                data = hub.repos.get(repo, {}).get(name)
                if data is None or (repo, name) in hub.unresolvable:
                    self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"}, send_body)
                    return
                etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else git_blob_id(data)
                headers = {"X-Repo-Commit": hub.commit, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
                if not send_body:
                    self._send(200, data, headers, send_body=False)
                    return
                self._download(repo, name, data, headers)
                return
            self._send(404, b"not found", {}, send_body)

        def _download(self, repo: str, name: str, data: bytes, headers: dict[str, str]) -> None:
            """A file's body: the whole file, or from `Range: bytes=N-` on (206), as the hub answers."""
            if (repo, name) in hub.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            asked = self.headers.get("Range")
            hub.ranges.setdefault(name, []).append(asked)
            code, start = 200, 0
            if asked and asked.startswith("bytes=") and asked.endswith("-"):
                code, start = 206, int(asked[len("bytes=") : -1])
                headers = {**headers, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
            body = data[start:]
            hub.enter_download(name)
            try:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                rate = hub.pace.get((repo, name))
                step = max(1, int(rate / 20)) if rate else len(body) or 1
                began = time.monotonic()
                for sent in range(0, len(body), step):
                    self.wfile.write(body[sent : sent + step])
                    if rate:
                        time.sleep(max(0.0, (sent + step) / rate - (time.monotonic() - began)))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading (a stopped download)
            finally:
                hub.leave_download()

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._route(send_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._route(send_body=False)

    return Handler


# The Engram embed tables of the base repo, by shard (as the real repo: layers 1 and 14, in shards 47 and 48).
ENGRAM_TABLES = {
    wm.engram_shard_name(47): ["model.layers.1.engram.embed.weight", "model.layers.1.engram.embed.scale"],
    wm.engram_shard_name(48): ["model.layers.14.engram.embed.weight", "model.layers.14.engram.embed.scale"],
}


def engram_shard(i: int, tables: list[str]) -> bytes:
    """A base shard in the safetensors layout: its layer tensor and `tables`."""
    return checkpoint.safetensors_tensors(
        {f"layer.{i}.w": f"base shard {i}".encode() * 3, **{t: t.encode() * 2 for t in tables}}, {"format": "pt"}
    )


def small_checkpoint() -> dict[str, dict[str, bytes]]:
    """39 tiny EXL3 shards + side files; the base repo has all 48 shards and an index naming them, shards 47 and
    48 (real safetensors headers) holding the Engram embed tables beside their layer tensor."""
    model = {f"model-{i:05d}-of-00039.safetensors": f"exl3 shard {i}".encode() * (i % 5 + 1) for i in range(1, 40)}
    model.update(
        {
            "config.json": b'{"model_type":"deepseek_v41"}',
            "tokenizer.json": b'{"t":1}',
            "quantization_config.json": b'{"bits":2.9}',
        }
    )
    weight_map = {f"layer.{i}.w": wm.engram_shard_name(i) for i in range(1, 49)}
    weight_map.update({t: shard for shard, tables in ENGRAM_TABLES.items() for t in tables})
    index = {"metadata": {}, "weight_map": weight_map}
    engram = {wm.engram_shard_name(i): f"base shard {i}".encode() * 3 for i in range(1, 47)}
    engram.update({shard: engram_shard(int(shard[6:11]), tables) for shard, tables in ENGRAM_TABLES.items()})
    engram.update(
        {wm.ENGRAM_INDEX: json.dumps(index).encode(), "config.json": b'{"model_type":"base"}', "README.md": b"# base"}
    )
    return {MODEL_REPO: model, ENGRAM_REPO: engram}


def hub_env(hub: FakeHub, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k != "HF_TOKEN"}
    env.update(
        {
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(home),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "NO_PROXY": "*",
            "HF_HUB_ETAG_TIMEOUT": "5",
            "HF_HUB_DOWNLOAD_TIMEOUT": "10",
        }
    )
    return env


def stage_program(where: Path) -> Path:
    """The staging program as stage.sh writes it on the head (`base64 -d` of what the command reads after the
    token line): `where`/stage_weights.pyz."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / "stage_weights.pyz"
    path.write_bytes(base64.b64decode(wm.stage_program_text()))
    return path


def run_stage(
    hub: FakeHub,
    root: Path,
    token: str | None = None,
    env: dict[str, str] | None = None,
    streams: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """The staging program as the container runs it (the zip application stage.sh writes, beside `root`): the
    token line (empty: anonymous) on stdin; `streams`: the plan's download_streams (None: left out of the plan)."""
    program = stage_program(root.parent)
    plan = wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="main", download_streams=streams)
    return subprocess.run(
        [PYTHON, str(program), "--plan", json.dumps(plan), "--dest-root", str(root), "--host-root", "/host/root"],
        env={**hub_env(hub, root.parent / "hf-home"), **(env or {})},
        input=f"{token or ''}\n",
        capture_output=True,
        text=True,
        timeout=120,
    )


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stage_weights: error:")]
    assert lines, f"expected a one-line error, stderr was:\n{proc.stderr[-3000:]}"
    return lines[-1]


# --- the staging script, for real ------------------------------------------------------------------


def stage_command(**kw: Any) -> str:
    args: dict[str, Any] = {
        "root": "~/dsv41-exl3",
        "image": "img:tag",
        "hf_endpoint": "http://127.0.0.1:9",
        "with_token": True,
        "timeout_s": 7200,
        "stack_prefix": PREFIX,
        "plan": wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="main"),
    }
    args.update(kw)
    return wm.render_stage_command(**args)


@dataclass
class Logged:
    """What a rendered script ran, with docker and timeout stand-ins on PATH: one `timeout ...` / `docker ...`
    line per call (argv joined by spaces), HF_TOKEN as each `docker run` saw it, the whole environment of
    each `docker run`, and what it read on stdin."""

    proc: subprocess.CompletedProcess[str]
    argv: list[str]
    docker_env: list[str]
    docker_stdin: str
    docker_environ: str

    def line(self, start: str) -> str:
        found = [ln for ln in self.argv if ln.startswith(start)]
        assert len(found) == 1, f"expected one call starting {start!r}, got {self.argv}"
        return found[0]


def run_logged(cmd: str, tmp_path: Path, stdin: str = "", home: Path | None = None) -> Logged:
    bin_dir, log, env_log, stdin_log = tmp_path / "log-bin", tmp_path / "argv", tmp_path / "env", tmp_path / "stdin"
    environ_log = tmp_path / "environ"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (
        (
            "docker",
            f'echo "docker $*" >> {log}\n[ "$1" = run ] || exit 0\n'
            f'echo "HF_TOKEN=${{HF_TOKEN-unset}}" >> {env_log}\nenv >> {environ_log}\n'
            f"cat > {stdin_log}\n",
        ),
        (
            "timeout",
            f'echo "timeout $*" >> {log}\nwhile case "$1" in -*) true;; *) false;; esac; do shift; done\n'
            'shift\nexec "$@"\n',
        ),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / name).chmod(0o755)
    if home is None:
        home = tmp_path / "log-home"
        home.mkdir(exist_ok=True)
    proc = subprocess.run(
        ["sh", "-c", cmd],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home)},
    )
    assert proc.returncode == 0, proc.stderr
    read = lambda p: p.read_text() if p.exists() else ""  # noqa: E731
    return Logged(proc, read(log).splitlines(), read(env_log).splitlines(), read(stdin_log), read(environ_log))


def fresh_dir(path: Path) -> Path:
    path.mkdir()
    return path
