"""The observability layer's footprint on the simulated cluster: Prometheus' and the exporters' memory on the head
over a scrape run, and what the layer adds to a no-op `pulumi up`.

    python -m bench.observability [--minutes 10] [--noop-runs 3]   # with toolchain/env.sh sourced, under the
                                                                   # sim's lock: flock /tmp/dsv41-sim.lock ...

Deploys one supervised, observed stand-in stack on sim nodes 1-2, samples every 15 s for `--minutes` the RSS
(VmRSS of the container's process) and docker's memory figure (`docker stats --no-stream`) of each of the
layer's containers on the head, then times `--noop-runs` no-op ups with the layer, turns it off (one up), times
as many without it, and writes bench/observability-results.json: per container the RSS at the end and its
maximum, the no-op up's median with and without the layer, and their difference.
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

from components import labels
from sim.deploy import REPO, Deployment, Tool, docker_on, remove_deployment, tool_deployment

RESULTS = REPO / "bench" / "observability-results.json"

TOOL = Tool("bench.observability", "source toolchain/env.sh", scratch="observability-bench", stack="obsbench")
SAMPLE_S = 15
MIB = 1 << 20


def layer_on_head(d: Deployment) -> list[str]:
    head = d.sim["nodes"][0]["index"]
    ps = docker_on(head, "ps", "--filter", f"label=dsv41-exl3.observability={d.name}", "--format", "{{.Names}}")
    return sorted(ps.stdout.split())


def vm_rss_mib(d: Deployment, container: str) -> float | None:
    """The container's main process' resident set (/proc/<pid>/status VmRSS: the sim's nodes share this kernel)."""
    pid = docker_on(d.sim["nodes"][0]["index"], "inspect", "--format", "{{.State.Pid}}", container).stdout.strip()
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def docker_mem_mib(d: Deployment) -> dict[str, float]:
    """`docker stats --no-stream`'s memory use of every container on the head (what `--memory` is held to)."""
    out = docker_on(d.sim["nodes"][0]["index"], "stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}").stdout
    units = {"B": 1 / MIB, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}
    found = {}
    for line in out.splitlines():
        name, used = line.split(" ", 2)[:2]
        for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
            if used.endswith(unit):
                found[name] = round(float(used[: -len(unit)]) * scale, 1)
                break
    return found


def timed_up(d: Deployment) -> float:
    """The engine's up alone (`Deployment.up` also inspects every rank afterwards, for the tests)."""
    d.lines = []
    start = time.monotonic()
    result = d.stack.up(on_output=d.lines.append, color="never")
    elapsed = time.monotonic() - start
    changes = {k: v for k, v in (result.summary.resource_changes or {}).items() if k != "same"}
    if changes:
        raise SystemExit(f"bench.observability: the up was not a no-op: {changes}\n" + "\n".join(d.lines[-30:]))
    return round(elapsed, 2)


def run(minutes: float, noop_runs: int) -> dict[str, Any]:
    d, work, weights = tool_deployment(
        TOOL, nodes=2, port=18913, master_port=29681, supervisor=True, observability=True
    )
    try:
        start = time.monotonic()
        d.up()
        first_up_s = round(time.monotonic() - start, 1)
        names = layer_on_head(d)
        samples: dict[str, list[float]] = {n: [] for n in names}
        docker: dict[str, list[float]] = {n: [] for n in names}
        deadline = time.monotonic() + minutes * 60
        while True:
            mem = docker_mem_mib(d)
            for n in names:
                rss = vm_rss_mib(d, n)
                if rss is not None:
                    samples[n].append(rss)
                if n in mem:
                    docker[n].append(mem[n])
            if time.monotonic() >= deadline:
                break
            time.sleep(SAMPLE_S)
        prefix = labels.stack_prefix("dsv41-exl3", d.name) + "-"
        memory = {
            n.removeprefix(prefix): {
                "rss_mib_end": samples[n][-1] if samples[n] else None,
                "rss_mib_max": max(samples[n]) if samples[n] else None,
                "docker_mib_end": docker[n][-1] if docker[n] else None,
                "docker_mib_max": max(docker[n]) if docker[n] else None,
            }
            for n in names
        }
        with_layer = [timed_up(d) for _ in range(noop_runs)]
        off = json.loads(json.dumps(d.config))
        off["observability"]["enabled"] = False
        d.write_config(off)
        d.up()
        without = [timed_up(d) for _ in range(noop_runs)]
    finally:
        remove_deployment(d)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(weights, ignore_errors=True)
    noop_with, noop_without = round(statistics.median(with_layer), 2), round(statistics.median(without), 2)
    return {
        "server": "standin",
        "scrape_seconds": d.config["observability"].get("scrapeSeconds"),
        "scrape_minutes": minutes,
        "first_up_s": first_up_s,
        "memory_on_head": memory,
        "noop_up_s_with": with_layer,
        "noop_up_s_without": without,
        "noop_up_median_with_s": noop_with,
        "noop_up_median_without_s": noop_without,
        "noop_up_added_s": round(noop_with - noop_without, 2),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long Prometheus scrapes before the reading")
    parser.add_argument("--noop-runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where the results go (default {RESULTS.name})")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still destroys the stack (finally)
    summary = run(args.minutes, args.noop_runs)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    mem = ", ".join(f"{k} {v['rss_mib_max']} MiB" for k, v in summary["memory_on_head"].items())
    print(
        f"bench.observability: max RSS on the head after {args.minutes:g} min of scraping: {mem}; no-op up "
        f"{summary['noop_up_median_with_s']} s with the layer, {summary['noop_up_median_without_s']} s without "
        f"(+{summary['noop_up_added_s']} s) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
