"""A stand-in `docker` CLI that runs a throwaway container's python program on this machine."""

from __future__ import annotations

import sys
from pathlib import Path


def install_fake_docker(bin_dir: Path, log: Path) -> None:
    """A `docker` on PATH that runs `docker run ... --entrypoint python3 IMG args` with the local python,
    mapping -v mounts to host paths and, like the real CLI, passing only the -e variables (what it would put in
    the container's Config.Env, logged as JSON to `<log>.env`) and stdin only with `-i`. Every call's argv is
    logged to `log`, one JSON list a line; every other subcommand succeeds doing nothing."""
    bin_dir.mkdir()
    shim = bin_dir / "docker"
    shim.write_text(f"""#!{sys.executable}
import json, os, subprocess, sys
argv = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")
if argv[0] != "run":
    sys.exit(0)
env, mounts, i, interactive = {{"PATH": os.environ["PATH"]}}, [], 1, False
while argv[i].startswith("-"):
    opt = argv[i]
    if opt in ("--rm", "-i"):
        interactive = interactive or opt == "-i"
        i += 1
        continue
    val = argv[i + 1]
    if opt == "-e":
        k, _, v = val.partition("=")
        env[k] = v if "=" in val else os.environ.get(k, "")
    elif opt == "-v":
        src, dst = val.split(":")[:2]
        mounts.append((dst, src))
    i += 2
with open({str(log) + ".env"!r}, "a") as f:
    f.write(json.dumps(env) + "\\n")
rest = argv[i + 1:]
def host(a):
    for dst, src in mounts:
        if a == dst or a.startswith(dst + "/"):
            return src + a[len(dst):]
    return a
stdin = None if interactive else subprocess.DEVNULL
sys.exit(subprocess.run([{sys.executable!r}] + [host(a) for a in rest], env=env, stdin=stdin).returncode)
""")
    shim.chmod(0o755)
