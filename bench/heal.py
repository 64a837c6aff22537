"""`heal_s`: a worker killed until the supervisor has verified the group again, on the simulated cluster; and
`reboot_heal_s`: the worker's node rebooted (a power cut, then a boot) until the same.

    make bench-heal            # python -m bench.heal [--runs 5] [--reboot-runs N] [--server standin|real]

Deploys one supervised stack on sim nodes 1-2, kills the worker's rank `--runs` times (each after the group is
verified again), then reboots the worker's node `--reboot-runs` times (default: as many as `--runs`) and writes
bench/heal-results.json: per run the time from the kill (the reboot command) to the verified restart, the
detection (to the restart's start, as the leader recorded it), the restart's phases (stop, memory, boot, verify),
and the overhead (everything but the boot); for a reboot also the reboot command's own seconds (until the node's
docker and sshd answer again); medians of each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import requests

from sim.cluster_daemons import reboot
from sim.cluster_layout import default_layout
from sim.deploy import REPO, Tool, docker_on, remove_deployment, tool_deployment
from sim.supervisor_view import armed, leader, restarted, restarts, wait_for

RESULTS = REPO / "bench" / "heal-results.json"

TOOL = Tool("bench.heal", "run through `make bench-heal`", scratch="heal", stack="heal")


def measured(killed: float, after: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: from `killed` (wall time) to the leader's last restart in `after`."""
    healed = time.time() - killed
    last = restarts(after)[-1]
    phases = last.get("phases", {})
    return {
        "heal_s": round(healed, 2),
        "detect_s": round(float(last["at"]) - killed, 2),
        "restart_s": last.get("seconds"),
        "phases": phases,
        "cause": last.get("cause"),
        "result": last["result"],
        "overhead_s": round(healed - float(phases.get("boot", 0)), 2),
    }


def heal_runs(runs: int, server: str, reboot_runs: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    d, work, weights = tool_deployment(TOOL, port=18899, master_port=29631, server=server, supervisor=True)
    sim = d.sim
    out: list[dict[str, Any]] = []
    rebooted: list[dict[str, Any]] = []
    try:
        d.up()
        worker = sim["nodes"][1]
        url, headers = leader(d)
        for i in range(runs):
            # Each kill on a fresh budget: within one window the 2nd and 3rd restarts wait out the backoff
            # (backoffSeconds, doubled), which is policy, not healing time.
            requests.post(f"{url}/resume", headers=headers, json={}, timeout=10).raise_for_status()
            before = armed(d)
            killed = time.time()
            docker_on(worker["index"], "kill", d.container(worker))
            run = measured(killed, wait_for(d, "a verified restart", restarted(before), 1200))
            print(f"bench.heal: run {i + 1}/{runs}: {json.dumps(run)}", flush=True)
            out.append(run)
        for i in range(reboot_runs):
            requests.post(f"{url}/resume", headers=headers, json={}, timeout=10).raise_for_status()
            before = armed(d)
            started = time.time()
            boot = reboot(default_layout(), int(worker["index"]))
            run = {
                **measured(started, wait_for(d, "a verified restart after the reboot", restarted(before), 1200)),
                "reboot_command_s": round(boot["total_s"], 2),
            }
            print(f"bench.heal: reboot {i + 1}/{reboot_runs}: {json.dumps(run)}", flush=True)
            rebooted.append(run)
    finally:
        remove_deployment(d)
        shutil.rmtree(weights, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return out, rebooted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--reboot-runs", type=int, default=None, help="worker-node reboots (default: --runs)")
    parser.add_argument("--server", choices=("standin", "real"), default="standin")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where the results go (default {RESULTS.name})")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still destroys the stack (finally)
    reboot_runs = args.runs if args.reboot_runs is None else args.reboot_runs
    runs, rebooted = heal_runs(args.runs, args.server, reboot_runs)

    def median(items: list[dict[str, Any]], key: str) -> float | None:
        return round(statistics.median(float(r[key]) for r in items), 2) if items else None

    def boot_median(items: list[dict[str, Any]]) -> float | None:
        return round(statistics.median(float(r["phases"].get("boot", 0)) for r in items), 2) if items else None

    summary = {
        "server": args.server,
        "runs": runs,
        "heal_s": median(runs, "heal_s"),
        "detect_s": median(runs, "detect_s"),
        "overhead_s": median(runs, "overhead_s"),
        "boot_s": boot_median(runs),
        "reboot_runs": rebooted,
        "reboot_heal_s": median(rebooted, "heal_s"),
        "reboot_detect_s": median(rebooted, "detect_s"),
        "reboot_command_s": median(rebooted, "reboot_command_s"),
        "reboot_boot_s": boot_median(rebooted),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"bench.heal: median heal {summary['heal_s']} s (detect {summary['detect_s']} s, boot "
        f"{summary['boot_s']} s, overhead {summary['overhead_s']} s); median reboot heal "
        f"{summary['reboot_heal_s']} s (the reboot command {summary['reboot_command_s']} s, detect "
        f"{summary['reboot_detect_s']} s, boot {summary['reboot_boot_s']} s) -> {args.out}"
    )
    return 0 if all(r["result"] == "verified" for r in [*runs, *rebooted]) else 1


if __name__ == "__main__":
    sys.exit(main())
