"""A fake `ssh` on PATH that records its argv and answers from canned files, and a loopback /v1/models."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

FAKE_SSH = r"""#!/bin/sh
# Records its argv, answers from canned files chosen by the remote command (the last argument). The gates'
# stream script (components/gates/rank_stream.sh) is run here with `sh`, against the fake `docker` of
# FAKE_DOCKER_BIN, as sshd would run it: until its stdin closes. Files in the answers directory steer it:
# `refuse` (a count: that many connections fail with 255), `drop` (the running session is cut, 255),
# `nostream` (the script answers that it cannot stream).
d="$FAKE_SSH_DIR"
for a in "$@"; do printf '%s\n' "$a"; done >> "$d/argv.log"
printf '%s\n' '---' >> "$d/argv.log"
for last in "$@"; do :; done
printf '%s\n' "$last" | head -n 1 >> "$d/remote.log"
case "$last" in
  *"components/gates/rank_stream.sh"*) kind=stream ;;
  *"components/gates/head_request.sh"*) kind=head ;;
  *"docker inspect"*) kind=inspect ;;
  *"docker logs"*) kind=logs ;;
  *"docker stats"*) kind=stats ;;
  *) kind=other ;;
esac
n=$(cat "$d/$kind.n" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "$d/$kind.n"
if [ "$kind" = stream ]; then
  if [ -f "$d/nostream" ]; then
    echo "F awk is not installed on the node"
    exit 0
  fi
  left=$(cat "$d/refuse" 2>/dev/null || echo 0)
  if [ "$left" -gt 0 ]; then
    echo $((left - 1)) > "$d/refuse"
    echo "ssh: connect to host 127.0.0.3 port 2222: Connection refused" >&2
    exit 255
  fi
  exec 3<&0  # the session's stdin: a background job's would be /dev/null
  PATH="$FAKE_DOCKER_BIN:$PATH" FAKE_DOCKER_DIR="$d" sh -c "$last" <&3 3<&- &
  child=$!
  trap 'kill -TERM "$child" 2>/dev/null; exit 143' TERM INT
  while kill -0 "$child" 2>/dev/null; do
    if [ -f "$d/drop" ]; then
      rm -f "$d/drop"
      kill -TERM "$child" 2>/dev/null
      wait "$child"
      echo "Connection to 127.0.0.3 closed by remote host." >&2
      exit 255
    fi
    sleep 0.02
  done
  wait "$child"
  exit $?
fi
if [ "$kind" = head ]; then  # LiveRanks' probe from the head: run as sshd would, against the fake docker
  PATH="$FAKE_DOCKER_BIN:$PATH" FAKE_DOCKER_DIR="$d" exec sh -c "$last"
fi
f="$d/$kind.$n"; [ -f "$f.rc" ] || f="$d/$kind"
cat "$f.out" 2>/dev/null
cat "$f.err" >&2 2>/dev/null
exit "$(cat "$f.rc" 2>/dev/null || echo 0)"
"""

# The fake `docker` the stream script meets: `inspect`, `logs -f`, `events`, from FAKE_DOCKER_DIR. Live files
# when present (`state`: one `<status> <exit> <started> <oom>` line; `log`: `<timestamp> <text>` lines, followed
# as they are appended, `--since` honoured, ending when `state` is no longer running; `events`: JSON lines
# appended after the stream started; `logs.end`: the log ends while the container runs), else the canned
# answers of `canned` (inspect.N / inspect, logs.N / logs), a canned log stream staying open while the canned
# state runs. `stats` prints the `stats` file (else fails with `stats.fail`). `exec -i C python3 -c PROG` runs
# PROG with this python (`exec.fail`: docker's refusal instead). Every call is logged to docker.log.
FAKE_DOCKER = r"""#!{python}
import os, re, sys, time
from pathlib import Path

d = Path(os.environ["FAKE_DOCKER_DIR"])
args = sys.argv[1:]
with open(d / "docker.log", "a") as f:
    f.write(" ".join(args) + "\n")
with open(d / "docker.pids", "a") as f:
    f.write(f"{{os.getpid()}}\n")


def canned(kind):
    n_file = d / f"{{kind}}.n"
    n = int(n_file.read_text()) + 1 if n_file.exists() else 1
    n_file.write_text(str(n))
    base = d / f"{{kind}}.{{n}}"
    if not (base.parent / (base.name + ".rc")).exists():
        base = d / kind
    def read(ext):
        path = base.parent / (base.name + ext)
        return path.read_text() if path.exists() else ""
    return read(".out"), read(".err"), int(read(".rc") or 0)


def state():
    # the live state, else the default canned inspect answer (without counting a call)
    for name in ("state", "inspect.out"):
        if (d / name).exists():
            return (d / name).read_text().strip()
    return ""


def key(stamp):
    m = re.match(r"^(\S+?)(?:\.(\d+))?Z$", stamp)
    return (m.group(1), int((m.group(2) or "0")[:9].ljust(9, "0"))) if m else (stamp, 0)


def forever():
    while True:
        time.sleep(3600)


if args[0] == "inspect":
    if (d / "state").exists():
        print((d / "state").read_text().strip())
        sys.exit(0)
    out, err, rc = canned("inspect")
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.exit(rc)
if args[0] == "events":
    path = d / "events"
    if not path.exists():
        forever()
    with open(path) as f:
        f.seek(0, 2)
        (d / "events.ready").touch()  # subscribed: what is appended from now on is seen
        while True:
            line = f.readline()
            if line.endswith("\n"):
                sys.stdout.write(line)
                sys.stdout.flush()
                continue
            if line:  # a line being written: read it again whole
                f.seek(f.tell() - len(line))
            time.sleep(0.01)
if args[0] == "logs":
    name = args[-1]
    since = args[args.index("--since") + 1] if "--since" in args else ""
    path = d / "log"
    if not path.exists():
        out, err, rc = canned("logs")
        sys.stdout.write(out)
        sys.stdout.flush()
        if rc == 0 and state().split()[:1] == ["running"]:
            forever()
        sys.exit(rc)
    with open(path) as f:
        while True:
            line = f.readline()
            if line.endswith("\n"):
                if not since or key(line.split(" ", 1)[0]) >= key(since):
                    sys.stdout.write(line)
                    sys.stdout.flush()
                continue
            if line:
                f.seek(f.tell() - len(line))
            if not state().startswith("running") or (d / "logs.end").exists():
                sys.exit(0)
            time.sleep(0.01)
if args[0] == "stats":  # `stats --no-stream --format '{{{{json .}}}}' C...`: the `stats` file, else `stats.fail`
    if (d / "stats").exists():
        sys.stdout.write((d / "stats").read_text())
        sys.exit(0)
    sys.exit((d / "stats.fail").read_text().strip() if (d / "stats.fail").exists() else "fake docker: no stats")
if args[0] == "exec":  # `exec -i <container> python3 -c <program>`: the program runs here, on this loopback
    if (d / "exec.fail").exists():
        sys.exit((d / "exec.fail").read_text().strip())
    program = args[args.index("-c") + 1]
    os.execv(sys.executable, [sys.executable, "-c", program])
sys.exit(f"fake docker: {{args}} not faked")
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
    docker_bin = tmp_path / "docker-bin"
    docker_bin.mkdir()
    docker = docker_bin / "docker"
    docker.write_text(FAKE_DOCKER.format(python=sys.executable))
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_DIR", str(data))
    monkeypatch.setenv("FAKE_DOCKER_BIN", str(docker_bin))
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
