"""`doctor_s`: `dsv41-exl3 doctor` on a two-node stack of the simulated cluster, end to end (the CLI's process,
reading the stack, every node's preflight report and image manifest over ssh, the hub), median of `--runs`.

    make bench-doctor          # python -m bench.doctor [--runs 5]

Nothing is deployed: the doctor runs where an owner runs it, after `make stack` and before the first preview.
Writes bench/doctor-results.json. Issue 38 asks for <= 15 s here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sim.deploy import REPO, Tool, tool_deployment

RESULTS = REPO / "bench" / "doctor-results.json"
TOOL = Tool("bench.doctor", "run through `make bench-doctor`", scratch="doctor", stack="doctor")
TARGET_S = 15.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    d, work, weights = tool_deployment(TOOL, port=18898, master_port=29633)
    env = {**os.environ, **d.env, "PATH": f"{d.pulumi_root / 'bin'}:{os.environ['PATH']}"}
    times: list[float] = []
    try:
        for i in range(args.runs):
            began = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "components", "doctor", "--stack", d.name, "--json"],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            times.append(round(time.monotonic() - began, 2))
            if done.returncode != 0:
                print(
                    f"bench.doctor: run {i + 1} exited {done.returncode}:\n{done.stdout}{done.stderr}", file=sys.stderr
                )
                return 1
            checks = len(json.loads(done.stdout)["checks"])
            print(f"bench.doctor: run {i + 1}/{args.runs}: {times[-1]} s, {checks} checks", flush=True)
    finally:
        d.stack.workspace.remove_stack(d.name)
        shutil.rmtree(weights, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        "doctor_s": round(statistics.median(times), 2),
        "runs_s": times,
        "target_s": TARGET_S,
        "nodes": 2,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"bench.doctor: median {summary['doctor_s']} s over {args.runs} runs (target <= {TARGET_S} s) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
