"""Staging in `make bench` (bench/run.py): the checkpoint staged on the bench's head with the program's own command
before the stacks, and the staging rates: the staging program against the hub stand-in on loopback, every
connection capped, at 1 and 8 download streams, and their records.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.harness import STEP_TIMEOUT
from bench.report import SPECS
from components.config import Weights
from components.scripts import sh_command
from components.weights import manifest as wm
from sim import checkpoint


def stage_weights(sim: dict[str, Any], root: Path) -> float:
    """The program's own staging command, run on the head over ssh with the image from the registry, so every
    stack's weights layer finds the checkpoint staged (as on a cluster that has deployed before)."""
    plan = wm.staging_plan(
        model_repo=checkpoint.MODEL_REPO,
        engram_repo=checkpoint.BASE_REPO,
        revision="main",
        download_streams=Weights.model_fields["download_streams"].default,
    )
    command = wm.render_stage_command(
        root=str(root),
        image=sim["image"],
        plan=plan,
        hf_endpoint=sim["hub"],
        with_token=False,
        timeout_s=STEP_TIMEOUT,
        stack_prefix="dsv41-exl3-bench-staging",
    )
    began = time.monotonic()
    ssh = [
        "ssh",
        "-F",
        "none",
        "-p",
        str(sim["ssh"]["port"]),
        "-i",
        sim["ssh"]["key"],
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        f"UserKnownHostsFile={sim['ssh']['known_hosts']}",
        "-o",
        "StrictHostKeyChecking=yes",
    ]
    proc = subprocess.run(
        [*ssh, f"{sim['ssh']['user']}@{sim['nodes'][0]['ip']}", sh_command(command)],
        input=wm.stage_stdin(None, wm.stage_program_text()),
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT + 60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"staging the checkpoint on the head failed: {proc.stderr[-2000:]}")
    return time.monotonic() - began


# The staging figures: 41 shards (the model's 39, the base's 47 and 48) of STAGING_SHARD_MIB each from the hub
# stand-in on loopback, every download capped at STAGING_RATE_MIB_S (a CDN caps one stream; the link does not).
STAGING_SHARD_MIB = 3
STAGING_RATE_MIB_S = 4
STAGING_STREAMS = (1, 8)


def staging_checkpoint(shard_bytes: int) -> dict[str, dict[str, bytes]]:
    """The sim's checkpoint with every shard staging fetches made `shard_bytes` long (random content: the
    program hashes it all the same; the Engram shards keep a safetensors header naming their embed tables, which
    staging reads); the index, configs and the shards it never fetches stay as they are."""
    repos = checkpoint.build()
    for name in list(repos[checkpoint.MODEL_REPO]):
        if name.endswith(".safetensors"):
            repos[checkpoint.MODEL_REPO][name] = os.urandom(shard_bytes)
    for i in wm.ENGRAM_SHARDS:
        repos[checkpoint.BASE_REPO][wm.engram_shard_name(i)] = checkpoint.base_engram_shard(i, shard_bytes)
    return repos


def staging_loopback(
    runs: int,
    shard_mib: int = STAGING_SHARD_MIB,
    rate_mib_s: int = STAGING_RATE_MIB_S,
    streams: tuple[int, ...] = STAGING_STREAMS,
) -> dict[str, Any]:
    """The staging program (the zip application the head's container runs, with this machine's python and
    huggingface_hub) against the hub stand-in on 127.0.0.1, each connection capped, a fresh root each run, the
    stream counts alternating within each run: {"mib_s": {streams: [aggregate MiB/s]}, "last_lines": ...}."""
    from sim import hub as sim_hub

    hub = sim_hub.Hub(repos=staging_checkpoint(shard_mib << 20), rate_per_connection=rate_mib_s << 20)
    server = sim_hub.serve("127.0.0.1", 0, hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    program = base64.b64decode(wm.stage_program_text())  # what stage.sh writes to stage_weights.pyz
    rates: dict[str, list[float]] = {str(n): [] for n in streams}
    lines: dict[str, str] = {}
    files = 0
    hub_log = io.StringIO()  # the hub's line per request: kept out of the bench's output
    try:
        for run in range(runs):
            for n in streams:
                with tempfile.TemporaryDirectory(prefix="dsv41-bench-stage-", dir="/var/tmp") as tmp:
                    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k != "HF_TOKEN"}
                    env.update(
                        HF_ENDPOINT=endpoint,
                        HF_HOME=f"{tmp}/hf-home",
                        HF_HUB_OFFLINE="0",
                        HF_HUB_ENABLE_HF_TRANSFER="0",
                        HF_HUB_DISABLE_PROGRESS_BARS="1",
                        HF_HUB_DISABLE_TELEMETRY="1",
                        NO_PROXY="*",
                    )
                    plan = wm.staging_plan(
                        model_repo=checkpoint.MODEL_REPO,
                        engram_repo=checkpoint.BASE_REPO,
                        revision="main",
                        download_streams=n,
                    )
                    script = Path(tmp) / "stage_weights.pyz"
                    script.write_bytes(program)
                    began = time.monotonic()
                    with contextlib.redirect_stderr(hub_log):
                        done = subprocess.run(
                            [sys.executable, str(script), "--plan", json.dumps(plan), "--dest-root", f"{tmp}/root"]
                            + ["--host-root", f"{tmp}/root"],
                            env=env,
                            input="\n",
                            capture_output=True,
                            text=True,
                            timeout=900,
                        )
                    elapsed = time.monotonic() - began
                if done.returncode != 0:
                    raise RuntimeError(f"staging from the loopback hub failed: {done.stderr[-1500:]}")
                # What was downloaded: the slim Engram directory's files are hardlinks of staged ones (no bytes).
                staged_files = {
                    rel: size
                    for rel, size in wm.parse_stage_output(done.stdout).files.items()
                    if not rel.startswith(f"{wm.ENGRAM_VLLM_DIR}/")
                }
                files, staged = len(staged_files), sum(staged_files.values())
                rates[str(n)].append(staged / (1 << 20) / elapsed)
                progress = [ln for ln in done.stderr.splitlines() if ln.startswith("stage_weights: progress ")]
                lines[str(n)] = progress[-1] if progress else ""
                print(f"bench: staging run {run + 1}, {n} stream(s): {rates[str(n)][-1]:.1f} MiB/s", flush=True)
    finally:
        server.shutdown()
        server.server_close()
    return {"mib_s": rates, "last_lines": lines, "shard_mib": shard_mib, "rate_mib_s": rate_mib_s, "files": files}


def analyse_staging(loop: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The two staging figures, each with what it was measured on; the 8-stream note gives the speed-up."""
    one, eight = loop["mib_s"]["1"], loop["mib_s"]["8"]
    speedup = report.summarize(eight).value / report.summarize(one).value
    setup = (
        f"stage_weights.py from the hub stand-in on 127.0.0.1 capping every connection at {loop['rate_mib_s']} MiB/s "
        f"(`sim/hub.py --rate-per-connection`), 41 shards of {loop['shard_mib']} MiB and the small files "
        f"({loop['files']} files), a fresh root each run: bytes staged over the program's wall time (python "
        "start, listing, hashing included)"
    )
    return {
        "staging_loopback_mib_s@1": report.measured(
            SPECS["staging_loopback_mib_s@1"],
            one,
            f"{setup}; weights.downloadStreams 1, what staging did before the setting. Program's own last line: "
            f"`{loop['last_lines'].get('1', '')}`.",
        ),
        "staging_loopback_mib_s@8": report.measured(
            SPECS["staging_loopback_mib_s@8"],
            eight,
            f"{setup}; weights.downloadStreams 8 (the default), {speedup:.1f} x the 1-stream rate in the same "
            "runs (alternating). Below 8 x: 41 shards are 6 rounds of 8 (the last holds one), and the fixed "
            f"start-up and listing. Program's own last line: `{loop['last_lines'].get('8', '')}`.",
        ),
    }
