"""`image_change_outage_s`: how long the endpoint answers nothing during an image change, against the boot alone.

    make bench-image           # python -m bench.image_change [--runs 3] [--pad-mb 400] [--server standin|real]

Deploys one stack on sim nodes 1-2, builds a variant of its image with a `--pad-mb` MiB layer (so each node's pull
takes measurable time) and pushes it, then switches `image` between the two builds `--runs` times, each with
`pulumi up`. During each up a probe asks `GET /v1/models` every 0.2 s. Per run, written to
bench/image-change-results.json:
- `outage_s`: the longest stretch without an answer;
- `pull_s`: from the up's start until the last node's pull finished (the endpoint must answer throughout);
- `boot_s`: from the new head container's start (docker's StartedAt) to the first answer after the outage;
- `overhead_s`: outage minus boot (stopping the old ranks, creating the new containers).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import sys
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import requests
from pulumi import automation as auto

from sim.deploy import REPO, Tool, build_image_variant, docker_on, remove_deployment, tool_deployment

RESULTS = REPO / "bench" / "image-change-results.json"

TOOL = Tool("bench.image_change", "run `make bench-image`", scratch="image", stack="image")
PROBE_EVERY_S = 0.2


def answers(endpoint: str, key: str) -> bool:
    try:
        return requests.get(f"{endpoint}/models", headers={"Authorization": f"Bearer {key}"}, timeout=1).ok
    except requests.RequestException:
        return False


def longest_gap(probes: list[tuple[float, bool]]) -> tuple[float, float | None]:
    """The longest run of failed probes (seconds, from its first failure to the next answer) and where it ended."""
    best, end, started = 0.0, None, None
    for t, ok in probes:
        if not ok and started is None:
            started = t
        elif ok and started is not None:
            if t - started > best:
                best, end = t - started, t
            started = None
    if started is not None and probes and probes[-1][0] - started > best:
        best, end = probes[-1][0] - started, None
    return best, end


def one_change(d: Any, image: str, endpoint: str, key: str) -> dict[str, Any]:
    d.write_config({**d.config, "image": image})
    probes: list[tuple[float, bool]] = []
    pulled: dict[str, float] = {}
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            probes.append((time.time(), answers(endpoint, key)))
            time.sleep(PROBE_EVERY_S)

    def record(event: auto.EngineEvent) -> None:
        out = event.res_outputs_event
        if out is not None and str(out.metadata.op.value) != "delete-replaced":
            name = out.metadata.urn.split("::")[-1]
            if re.fullmatch(r"image-node-\d+-pull", name):
                pulled.setdefault(name, time.time())

    prober = threading.Thread(target=probe, daemon=True)
    started = time.time()
    prober.start()
    try:
        d.stack.up(on_event=record, on_output=lambda _l: None, color="never")
        deadline = time.time() + 60
        while not (probes and probes[-1][1]) and time.time() < deadline:
            time.sleep(PROBE_EVERY_S)
    finally:
        done.set()
        prober.join(5)
    outage, back = longest_gap(probes)
    head = d.sim["nodes"][0]
    started_at = docker_on(head["index"], "inspect", "-f", "{{.State.StartedAt}}", d.container(head)).stdout.strip()
    head_start = datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", started_at.replace("Z", "+00:00")))
    last_pull = max(pulled.values()) if pulled else started
    return {
        "outage_s": round(outage, 2),
        "pull_s": round(last_pull - started, 2),
        "answered_while_pulling": all(ok for t, ok in probes if t <= last_pull),
        "boot_s": round(back - head_start.timestamp(), 2) if back is not None else None,
        "overhead_s": round(outage - (back - head_start.timestamp()), 2) if back is not None else None,
        "up_s": round(time.time() - started, 2),
    }


def runs(count: int, pad_mb: int, server: str) -> list[dict[str, Any]]:
    d, work, weights = tool_deployment(TOOL, port=18893, master_port=29633, server=server)
    sim = d.sim
    out: list[dict[str, Any]] = []
    tag = None
    try:
        outputs = d.up().outputs
        endpoint, key = outputs["endpoint"].value, outputs["apiKey"].value
        images = [d.config["image"]]
        tag = build_image_variant(images[0], sim["nodes"][0]["index"], f"bench-{uuid.uuid4().hex[:6]}", pad_mb)
        pushed = docker_on(sim["nodes"][0]["index"], "push", tag)
        if pushed.returncode != 0:
            raise RuntimeError(f"docker push {tag}: {pushed.stderr}")
        images.append(tag)
        for i in range(count):
            # Every node pulls the build it switches to: drop it first (the serving one stays, it is in use).
            target = images[(i + 1) % 2]
            for n in sim["nodes"][:2]:
                docker_on(n["index"], "rmi", target)
            run = one_change(d, target, endpoint, key)
            print(f"bench.image_change: run {i + 1}/{count}: {json.dumps(run)}", flush=True)
            out.append(run)
    finally:
        remove_deployment(d)
        if tag:
            for n in sim["nodes"][:2]:
                docker_on(n["index"], "rmi", tag)
        shutil.rmtree(weights, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pad-mb", type=int, default=400, help="MiB added to the new build's layers")
    parser.add_argument("--server", choices=("standin", "real"), default="standin")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still destroys the stack (finally)
    measured = runs(args.runs, args.pad_mb, args.server)

    def median(key: str) -> float | None:
        values = [float(r[key]) for r in measured if r.get(key) is not None]
        return round(statistics.median(values), 2) if values else None

    summary = {
        "server": args.server,
        "pad_mb": args.pad_mb,
        "runs": measured,
        "outage_s": median("outage_s"),
        "boot_s": median("boot_s"),
        "overhead_s": median("overhead_s"),
        "pull_s": median("pull_s"),
        "answered_while_pulling": all(r["answered_while_pulling"] for r in measured),
    }
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"bench.image_change: median outage {summary['outage_s']} s (boot {summary['boot_s']} s, overhead "
        f"{summary['overhead_s']} s); pulls took {summary['pull_s']} s, answered throughout: "
        f"{summary['answered_while_pulling']}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
