"""`weights.share: copy` in `make bench` (issue 15; bench/run.py): the worker copy's outputs read from the stack's
state, the per-preview copy check timed on its own, the copier's throughput on loopback, and their records.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.analysis import fmt_runs
from bench.report import SPECS
from sim.deploy import Deployment


def copy_outputs(d: Deployment) -> dict[str, Any]:
    state = json.loads(d.cli("stack", "export", "--show-secrets").stdout)
    (copy,) = [r for r in state["deployment"]["resources"] if r["type"] == "pulumi-python:dynamic/weights:WorkerCopy"]
    outputs: dict[str, Any] = copy["outputs"]
    return outputs


def time_copy_check(props: dict[str, Any]) -> float:
    """What a second up adds for the copy: the WorkerCopy diff's check (one ssh session, record and stat only),
    as the provider runs it in a fresh process (cold ssh master)."""
    from components import ssh
    from components.dynamic import read_props
    from components.weights import worker_copy

    args = read_props(worker_copy.WorkerCopyArgs, props)
    began = time.monotonic()
    stale = worker_copy.check_copy(args)
    elapsed = time.monotonic() - began
    if stale:
        raise RuntimeError(f"the copy check found {stale} on a verified copy")
    with_master = ssh.control_path(args.worker_target())
    subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={with_master}", "x"], capture_output=True, check=False)
    return elapsed


def copy_loopback(runs: int, size_mib: int = 1024, files: int = 8, streams: int = 4) -> list[float]:
    """The copier's throughput against the head's source, both as processes on loopback (the zip applications the
    containers run, with this machine's python), a fresh destination each run: MiB/s."""
    from components.weights import local_copy as lc
    from components.weights import manifest as wm
    from components.weights.copy_config import Limits, SourceConfig

    rates = []
    with tempfile.TemporaryDirectory(prefix="dsv41-bench-copy-", dir="/var/tmp") as tmp:
        head = Path(tmp) / "head"
        (head / wm.MODEL_DIR).mkdir(parents=True)
        sizes, digests = {}, {}
        chunk = os.urandom(1 << 20)
        for i in range(files):
            rel = f"{wm.MODEL_DIR}/shard-{i}.safetensors"
            with (head / rel).open("wb") as f:
                for _ in range(size_mib // files):
                    f.write(chunk)
            sizes[rel] = (size_mib // files) << 20
            digests[rel] = hashlib.sha256(chunk * (size_mib // files)).hexdigest()
        copier = lc.copier_config(token="bench", files=sizes, sha256=digests)
        programs = {"source": lc.source_program_text(), "copier": lc.copier_program_text()}
        for name, text in programs.items():
            (Path(tmp) / f"{name}.pyz").write_bytes(base64.b64decode(text))
        for run in range(runs):
            source = subprocess.Popen(
                [sys.executable, "-I", str(Path(tmp) / "source.pyz"), "--root", str(head), "--bind", "127.0.0.1"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert source.stdin and source.stdout
            # No heartbeats here: the source must not take the bench's silence for a lost session.
            config = SourceConfig(
                token="bench", allow=("127.0.0.1",), dirs=(wm.MODEL_DIR,), limits=Limits(silence_s=3600)
            )
            source.stdin.write(config.to_line() + "\n")
            source.stdin.flush()
            ready = lc.parse_source_line(source.stdout.readline(), {})
            assert ready is not None
            dest = Path(tmp) / f"dest-{run}"
            dest.mkdir()
            began = time.monotonic()
            done = subprocess.run(
                [
                    sys.executable,
                    "-I",
                    str(Path(tmp) / "copier.pyz"),
                    "--node",
                    "bench",
                    "--source",
                    f"http://127.0.0.1:{ready.port}",
                    "--bind",
                    "127.0.0.1",
                    "--dest",
                    str(dest),
                    "--host-dest",
                    str(dest),
                    "--streams",
                    str(streams),
                ],
                input=copier.to_line() + "\n",
                capture_output=True,
                text=True,
                timeout=600,
            )
            elapsed = time.monotonic() - began
            source.stdin.close()
            source.wait(timeout=30)
            if done.returncode != 0:
                raise RuntimeError(f"loopback copy failed: {done.stderr[-1000:]}")
            rates.append(size_mib / elapsed)
            shutil.rmtree(dest)
    return rates


def analyse_copy(
    copies: list[dict[str, Any]], loopback: list[float], cycles: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Issue 15's figures: bytes copied, loopback throughput, what the copy adds to a first and a second up."""
    med = report.summarize
    first = [c["first"] for c in copies]
    second = [c["second"] for c in copies]
    bind_cold = med([c["cold"]["wall_s"] for c in cycles]).value
    bind_noop = med([c["noop"]["wall_s"] for c in cycles]).value
    return {
        "copy_bytes@first": report.measured(
            SPECS["copy_bytes@first"],
            [float(f["bytes"]) for f in first],
            f"Bytes the worker's copier received in the first up of a new copy-mode 2-node stack (the sim's "
            f"checkpoint: {first[0]['files']} files, KiB each; the real one is ~387 GiB).",
            digits=0,
        ),
        "copy_loopback_mib_s": report.measured(
            SPECS["copy_loopback_mib_s"],
            loopback,
            "copy_source.py and copy_weights.py as processes on 127.0.0.1 (the zip applications the throwaway "
            "containers run, with this machine's python), 8 files of 128 MiB, 4 streams, a fresh destination each run: "
            "hashing (sha256) and fsync included. Bounded here by 2 cores hashing and the disk; on a Spark the "
            "fabric and the worker's NVMe set it.",
        ),
        "copy_added_s@first": report.measured(
            SPECS["copy_added_s@first"],
            [f["step_s"] for f in first],
            "The WorkerCopy step of the first up (engine events: pre to outputs), which sits between staging and "
            f"the worker's container: the head's source container started, the copier run, the source stopped "
            f"(copier alone {fmt_runs([f['copier_s'] for f in first])} s, provider "
            f"{fmt_runs([f['provider_s'] for f in first])} s). "
            f"First copy-mode up wall {fmt_runs([f['wall_s'] for f in first])} s against a cold bind-mode up "
            f"{bind_cold:.2f} s (median; other runs, other load).",
        ),
        "copy_added_s@second": report.measured(
            SPECS["copy_added_s@second"],
            [s["check_s"] for s in second],
            "A second up of the copy-mode stack changes nothing (asserted, and the copy did not run again); what "
            "it adds for the copy is the WorkerCopy diff's check on the worker (one ssh session from a cold "
            "master, record and stat, no weights read), timed on its own. The no-op up's wall "
            f"{fmt_runs([s['wall_s'] for s in second])} s against the bind-mode no-op up {bind_noop:.2f} s "
            "(median; other runs).",
            cause="the check's ssh session and its stat of every file.",
            next_step="share the ssh master with the other providers' reads.",
        ),
    }
