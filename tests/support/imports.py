"""What importing a module does besides defining names: a fresh interpreter imports it under an audit hook.

Providers are unpickled by the Pulumi engine's Python host on every preview; a module that starts a thread,
opens a connection, runs a process or writes a file at import would do it there, on every run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, os, sys, threading
seen = []
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def hook(event, args):
    if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.spawn",
                 "socket.connect", "socket.bind", "os.remove", "os.rename", "os.mkdir", "shutil.rmtree"):
        seen.append(f"{event} {str(args[:2])[:120]}")
    elif event == "open" and len(args) >= 3:
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & WRITE):
            seen.append(f"open for writing {str(args[0])[:120]}")

# The dependencies first, unobserved: what they do at import (urllib3 probes for IPv6 with a bind, ...) is
# theirs. What this project's modules do is looked at.
for name in ("pulumi", "pulumi_command", "pulumi_docker", "pydantic", "requests", "dill", "yaml"):
    __import__(name)
sys.addaudithook(hook)
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps({"threads": threading.active_count(), "events": seen}))
"""


def import_side_effects(*modules: str, path: Path | None = None) -> list[str]:
    """Everything importing `modules` did that is not defining names: threads left running, processes,
    sockets, files written. Empty when the import is clean. `path`: one more directory to import from."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules], cwd=REPO, capture_output=True, text=True, timeout=60, env=env
    )
    if done.returncode != 0:
        return [f"the import failed: {done.stderr.strip()[-2000:]}"]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    found = list(report["events"])
    if report["threads"] != 1:
        found.append(f"{report['threads'] - 1} thread(s) left running")
    if done.stderr.strip():
        found.append(f"printed to stderr: {done.stderr.strip()[:500]}")
    extra = done.stdout.strip().splitlines()[:-1]
    if extra:
        found.append(f"printed to stdout: {extra[:3]}")
    return found
