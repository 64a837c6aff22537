"""`make bench`: how fast the program sees the truth, measured on the simulated cluster (issue 6).

Every figure goes through the program's own code and the project's Pulumi engine: `sim/ranks.py` starts the
ranks from the program's spec (the docker provider cannot be built here) and runs the program's rendezvous
gate, ready gate and verifier as an Automation API stack over them. Each scenario starts fresh containers
carrying this run's label; all of them are removed at the end, on failure too.

    python -m bench.run            # measure, write bench/results.json and BENCHMARKS.md
    python -m bench.run --render   # redraw BENCHMARKS.md from bench/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pulumi import automation as auto

from bench import report
from bench.report import SPECS
from components import serve_spec
from components import weights_manifest as wm
from components.config import Settings
from components.rank_watch import ReadySettings
from sim import checkpoint, cluster, ranks

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results.json"
BENCHMARKS = REPO / "BENCHMARKS.md"
WORK = REPO / "bench" / "tmp"  # git-ignored: per-run backends, PULUMI_HOME, program work dirs
STEP_TIMEOUT = 120
STARTUP_LINE = "Application startup complete."

# The program's gate poll interval: verify_after() leaves RendezvousGateArgs/ReadyGateArgs at their default.
GATE_POLL_S = 5.0
# Stand-in load times: long enough for what each scenario observes, short enough for 20 minutes on 2 cores.
# The gates poll every 5 s from a start that sits at a near-constant offset after the containers start, so a
# fixed load time would sample one poll phase only: each run shifts its event by a step of `phase_shift`.
READY_LOAD_S = 12  # the ready gate must already be polling when the head logs startup complete
DEAD_LOAD_S = 40  # the worker is killed mid-load, after the ready gate started polling
KILL_AFTER_READY_GATE_S = 3.0
STALL_LOAD_S = 2
STALL_S = 20
DECODE_RATES = (20, 40)
TOOLCHAIN_COLD_S = 292.0  # README "Toolchain": CLI, everything cold, 4 min 52 s


@dataclass
class Events:
    """Arrival time (host clock) of the engine events per resource name, from the tailed event log."""

    seen: dict[tuple[str, str], float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, event: auto.EngineEvent) -> None:
        now = time.time()
        pairs: list[tuple[str | None, str]] = []
        if event.resource_pre_event is not None:
            pairs.append((event.resource_pre_event.metadata.urn, "pre"))
        if event.res_outputs_event is not None:
            pairs.append((event.res_outputs_event.metadata.urn, "outputs"))
        if event.res_op_failed_event is not None:
            pairs.append((event.res_op_failed_event.metadata.urn, "failed"))
        if event.diagnostic_event is not None and event.diagnostic_event.severity == "error":
            pairs.append((event.diagnostic_event.urn, "error"))
        with self.lock:
            for urn, kind in pairs:
                if urn:
                    self.seen.setdefault((urn.rsplit("::", 1)[-1], kind), now)

    def at(self, name: str, kind: str) -> float | None:
        with self.lock:
            return self.seen.get((name, kind))


@dataclass
class Bench:
    sim: dict[str, Any]
    weights: Path
    label: str
    pulumi_root: Path
    work: Path
    raw: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    # --- plumbing -------------------------------------------------------------------------------

    def engine_env(self, name: str) -> tuple[dict[str, str], Path]:
        """A fresh file backend per stack (so every up creates the gates anew), one PULUMI_HOME."""
        run_dir = self.work / name
        (run_dir / "backend").mkdir(parents=True)
        (run_dir / "program").mkdir()
        home = self.work / "pulumi-home"
        home.mkdir(exist_ok=True)
        env = {
            "PULUMI_BACKEND_URL": f"file://{run_dir / 'backend'}",
            "PULUMI_HOME": str(home),
            "PULUMI_CONFIG_PASSPHRASE": "bench-only",  # a throwaway backend, deleted at the end
            "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",
            "PULUMI_SKIP_UPDATE_CHECK": "true",
            "PULUMI_IGNORE_AMBIENT_PLUGINS": "true",
            "PULUMI_PYTHON_CMD": sys.executable,
            "PATH": os.pathsep.join([str(self.pulumi_root / "bin"), str(Path(sys.executable).parent),
                                     os.environ.get("PATH", "")]),
        }
        return env, run_dir / "program"

    def stack(self, name: str, s: Settings, ids: list[str]) -> auto.Stack:
        env, work_dir = self.engine_env(name)
        return ranks.gated_stack(self.pulumi_root, env, work_dir, s, ids)

    def container(self, s: Settings, rank: int) -> str:
        return serve_spec.container_name(ranks.STACK, s.nodes[rank])

    def docker(self, rank: int, *args: str) -> str:
        proc = ranks.docker(ranks.node_index(self.sim, rank), *args)
        if proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} on rank {rank} failed: {proc.stderr.strip()}")
        return proc.stdout

    def logs(self, s: Settings, rank: int) -> str:
        proc = ranks.docker(ranks.node_index(self.sim, rank), "logs", "--timestamps", self.container(s, rank))
        return proc.stdout + proc.stderr  # the stand-in logs to both; every line carries its timestamp

    def state_time(self, s: Settings, rank: int, field_name: str) -> float:
        out = self.docker(rank, "inspect", "-f", "{{.State." + field_name + "}}", self.container(s, rank))
        return report.parse_rfc3339(out.strip())

    def settings(self, extra_env: dict[str, str], gates: dict[str, Any] | None = None) -> Settings:
        return ranks.sim_settings(self.sim, self.weights, extra_env=extra_env, gates=gates)

    def start(self, s: Settings) -> list[str]:
        remove_labelled(self.label)
        return ranks.start_ranks(self.sim, s, self.weights, self.label)

    def verifier_outputs(self, stack: auto.Stack) -> dict[str, Any]:
        deployment = stack.export_stack().deployment or {}
        for resource in deployment.get("resources", []):
            if str(resource.get("urn", "")).endswith("::verify"):
                return dict(resource.get("outputs", {}))
        raise RuntimeError("the stack state has no `verify` resource after a successful up")

    # --- scenarios ------------------------------------------------------------------------------

    def healthy(self, index: int, rate: int, shift: float) -> dict[str, Any]:
        """A healthy boot: ready detection and the gates' overhead; then the decode probe over the same ranks."""
        load = READY_LOAD_S + shift
        env = {"SIM_LOAD_SECONDS": f"{load:.2f}", "SIM_DECODE_TOKENS_PER_SECOND": str(rate)}
        s = self.settings(env)
        ids = self.start(s)
        stack = self.stack(f"healthy-{rate}-{index}", s, ids)
        events = Events()
        began = time.time()
        up = stack.up(on_event=events)
        returned = time.time()
        if not str(up.outputs["answer"].value).strip().startswith("Paris"):
            raise RuntimeError(f"healthy run {index}: the verifier passed with {up.outputs['answer'].value!r}")
        startup = report.first_line_at(self.logs(s, 0), STARTUP_LINE)
        verify_out, ready_out, ready_pre = events.at("verify", "outputs"), events.at("ready", "outputs"), \
            events.at("ready", "pre")
        if startup is None or verify_out is None or ready_out is None or ready_pre is None:
            raise RuntimeError(f"healthy run {index}: missing a timestamp (startup line {startup}, ready gate "
                               f"{ready_pre}/{ready_out}, verifier {verify_out})")
        verified_at = report.parse_rfc3339(str(up.outputs["verifiedAt"].value))
        started = [self.state_time(s, r, "StartedAt") for r in range(len(s.nodes))]
        boot = startup - started[0]
        latency = float(self.verifier_outputs(stack)["latency_s"])

        probe_s = self.settings(env, gates={"minDecodeTokensPerSecond": 1})
        probe = self.stack(f"probe-{rate}-{index}", probe_s, ids).up()
        measured = float(probe.outputs["decodeTokensPerSecond"].value)
        return {
            "rate": rate,
            "load_s": load,
            "startup_line": report.iso_utc(startup),
            "ready_gate_started_before_startup": ready_pre < startup,
            "ready_gate_passed_s": ready_out - startup,
            "verifier_passed_s": verify_out - startup,
            "verified_at": up.outputs["verifiedAt"].value,
            "verified_at_minus_startup_s": verified_at - startup,  # verifiedAt is truncated to the second
            "up_returned_s": returned - startup,
            "up_wall_s": returned - began,
            "head_boot_s": boot,
            "gates_overhead_over_boot_s": (returned - min(started)) - boot,
            "verify_latency_s": latency,
            "decode_tokens_per_second": measured,
            "decode_error_pct": abs(measured - rate) / rate * 100,
        }

    def dead_rank(self, index: int, shift: float) -> dict[str, Any]:
        """Kill the worker mid-load once the ready gate is polling; time until `up` fails."""
        kill_after = KILL_AFTER_READY_GATE_S + shift
        s = self.settings({"SIM_LOAD_SECONDS": str(DEAD_LOAD_S)})
        ids = self.start(s)
        stack = self.stack(f"dead-{index}", s, ids)
        events = Events()
        killed: dict[str, Any] = {}

        def kill_when_ready_gate_polls() -> None:
            deadline = time.monotonic() + DEAD_LOAD_S
            while events.at("ready", "pre") is None and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(kill_after)
            log = self.logs(s, 1)
            killed["loading"] = "Loading safetensors checkpoint shards" in log and "Loading weights took" not in log
            killed["ready_gate_started"] = events.at("ready", "pre") is not None
            killed["kill"] = self.docker(1, "kill", self.container(s, 1)).strip()

        killer = threading.Thread(target=kill_when_ready_gate_polls, daemon=True)
        killer.start()
        message, failed = run_expecting_failure(stack, events)
        killer.join(timeout=STEP_TIMEOUT)
        if not killed.get("kill"):
            raise RuntimeError(f"dead-rank run {index}: the worker was never killed; up failed with: {message}")
        if not killed["loading"]:
            raise RuntimeError(f"dead-rank run {index}: the worker was not loading when killed (raise DEAD_LOAD_S)")
        if "rank 1" not in message:
            raise RuntimeError(f"dead-rank run {index}: the failure does not name rank 1: {message[:400]}")
        exited = self.state_time(s, 1, "FinishedAt")
        gate_failed = events.at("ready", "failed") or events.at("ready", "error")
        loading_since = report.first_line_at(self.logs(s, 1), "Loading safetensors checkpoint shards")
        return {
            "kill_after_ready_gate_s": kill_after,
            "worker_exit": report.iso_utc(exited),
            "killed_s_into_load": exited - loading_since if loading_since else None,
            "ready_gate_polling_at_kill": killed["ready_gate_started"],
            "ready_gate_failed_event_s": gate_failed - exited if gate_failed else None,
            "up_failed_s": failed - exited,
        }

    def stall(self, index: int, shift: float) -> dict[str, Any]:
        """Every rank goes silent after load; the ready gate must call it at stallSeconds."""
        load = STALL_LOAD_S + shift
        s = self.settings({"SIM_FAULT": "stall-after-load", "SIM_LOAD_SECONDS": f"{load:.2f}"},
                          gates={"stallSeconds": STALL_S})
        ids = self.start(s)
        stack = self.stack(f"stall-{index}", s, ids)
        events = Events()
        message, failed = run_expecting_failure(stack, events)
        if "no rank logged anything new" not in message:
            raise RuntimeError(f"stall run {index}: not a stall verdict: {message[:400]}")
        last = max(t for t in (report.last_line_at(self.logs(s, r)) for r in range(len(s.nodes))) if t)
        gate_failed = events.at("ready", "failed") or events.at("ready", "error")
        return {
            "load_s": load,
            "last_log_line": report.iso_utc(last),
            "ready_gate_failed_event_s": gate_failed - last - STALL_S if gate_failed else None,
            "overrun_s": failed - last - STALL_S,
        }


def run_expecting_failure(stack: auto.Stack, events: Events) -> tuple[str, float]:
    """(the error, the host time `up` raised); an up that succeeds is a broken scenario."""
    try:
        stack.up(on_event=events)
    except auto.CommandError as err:
        return str(err), time.time()
    raise RuntimeError("`pulumi up` succeeded where the scenario's fault must fail it")


def remove_labelled(label: str) -> None:
    layout = cluster.default_layout()
    for i in layout.existing_nodes():
        ps = subprocess.run(["docker", "-H", layout.docker_host(i), "ps", "-aq", "--filter", f"label={label}"],
                            capture_output=True, text=True, timeout=STEP_TIMEOUT)
        if ps.stdout.split():
            subprocess.run(["docker", "-H", layout.docker_host(i), "rm", "-f", *ps.stdout.split()],
                           capture_output=True, timeout=STEP_TIMEOUT)


def stage_weights(sim: dict[str, Any], root: Path) -> float:
    """The program's own staging command, run on the head over ssh with the image from the registry."""
    plan = wm.staging_plan(model_repo=checkpoint.MODEL_REPO, engram_repo=checkpoint.BASE_REPO, revision="main")
    command = wm.render_stage_command(root=str(root), image=sim["image"], plan=plan, hf_endpoint=sim["hub"],
                                      with_token=False, timeout_s=STEP_TIMEOUT)
    began = time.monotonic()
    proc = subprocess.run(["ssh", "-F", sim["ssh"]["config"], f"root@{sim['nodes'][0]['ip']}", command],
                          input=wm.stage_stdin(None, wm.stage_script_source()), capture_output=True, text=True,
                          timeout=STEP_TIMEOUT + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"staging the checkpoint on the head failed: {proc.stderr[-2000:]}")
    return time.monotonic() - began


def time_toolchain(runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        began = time.monotonic()
        proc = subprocess.run(["bash", "toolchain/build.sh"], cwd=REPO, capture_output=True, text=True,
                              timeout=900)
        times.append(time.monotonic() - began)
        if proc.returncode != 0:
            raise RuntimeError(f"bash toolchain/build.sh failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return times


def _sh(*argv: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30).stdout


def machine() -> dict[str, Any]:
    return report.machine_info(_sh("nproc"), _sh("free", "-g"), Path("/proc/cpuinfo").read_text(),
                               _sh("uname", "-sr"))


def phase_shift(index: int, runs: int) -> float:
    """Run `index` of `runs`: an even step across one gate poll interval."""
    return index * GATE_POLL_S / runs


def repeat(what: str, runs: int, scenario: Callable[[int, float], dict[str, Any]], *, first: int = 0,
           total: int | None = None) -> list[dict[str, Any]]:
    """Runs `first`..`first + runs - 1` of `total`, each shifted by its phase."""
    samples = []
    for i in range(runs):
        began = time.monotonic()
        sample = scenario(i, phase_shift(first + i, total or runs))
        print(f"bench: {what} run {i + 1}/{runs} ({time.monotonic() - began:.0f} s): "
              f"{json.dumps(sample, default=str)}", flush=True)
        samples.append(sample)
    return samples


# --- what cannot run here, and the analysis of misses -----------------------------------------------

NO_PROVIDERS = ("not measured: `pulumi preview`/`up` of the whole program needs the docker and command "
                "resource providers, which cannot be built here (the Go module proxy answers 403 for them; README "
                "'What is missing, and why'), so the engine stops at the first docker/command resource")


def unmeasurable() -> dict[str, dict[str, Any]]:
    reasons = {
        "preview_s@2": NO_PROVIDERS + ".",
        "preview_s@4": NO_PROVIDERS + ".",
        "preview_s@8": NO_PROVIDERS + ".",
        "noop_up_s": NO_PROVIDERS + ".",
        "up_overhead_s@2": NO_PROVIDERS + "; see the gates+verifier overhead over the stand-in's boot below "
                           "for the part that can run.",
        "up_overhead_s@4": NO_PROVIDERS + ".",
        "up_overhead_s@8": NO_PROVIDERS + ".",
        "replace_cycle_overhead_s": NO_PROVIDERS + " (a serve change replaces the containers through the docker "
                                    "provider).",
        "ssh_sessions_per_up": NO_PROVIDERS + "; most of an up's sessions are the command provider's and the "
                               "docker provider's, so counting only the gates' would not be this figure.",
    }
    return {k: report.not_measured(SPECS[k], v) for k, v in reasons.items()}


def analyse(healthy: list[dict[str, Any]], dead: list[dict[str, Any]], stalls: list[dict[str, Any]],
            toolchain: list[float]) -> dict[str, dict[str, Any]]:
    """The measured records, each missed target with its cause and next step from the breakdown measured."""
    med = report.summarize
    out: dict[str, dict[str, Any]] = {}

    ready = [h["verifier_passed_s"] for h in healthy]
    gate_part = med([h["ready_gate_passed_s"] for h in healthy]).value
    verifier_part = med([h["verifier_passed_s"] - h["ready_gate_passed_s"] for h in healthy]).value
    latency = med([h["verify_latency_s"] for h in healthy]).value
    waiting = sum(h["ready_gate_started_before_startup"] for h in healthy)
    loads = f"{min(h['load_s'] for h in healthy):.2f}..{max(h['load_s'] for h in healthy):.2f}"
    out["ready_detect_s"] = report.measured(
        SPECS["ready_detect_s"], ready,
        f"From the head's `{STARTUP_LINE}` (docker logs --timestamps, ns) to the verifier's pass, taken as the "
        "arrival of the engine's outputs event for `verify` (event log tailed every 0.1 s: an upper bound, more "
        "precise than `verifiedAt`, which is truncated to whole seconds, and than `stack.up()` returning, "
        f"median {med([h['up_returned_s'] for h in healthy]).value:.2f} s). SIM_LOAD_SECONDS {loads}; the ready "
        f"gate was already polling at the startup line in {waiting} of {len(healthy)} runs. Breakdown "
        f"(medians): ready gate passes {gate_part:.2f} s after the line, the verifier {verifier_part:.2f} s after "
        f"the gate (its request took {latency:.2f} s).",
        cause=(f"the ready gate reads the logs by polling every {GATE_POLL_S:g} s (`poll_interval_s`, the default "
               f"that `verify_after` keeps), so it sees the startup line on average half a poll late plus one "
               f"ssh round of `docker inspect`/`docker logs` per rank and the /v1/models probe (median "
               f"{gate_part:.2f} s in all); then the engine starts the verifier step and its request takes "
               f"{latency:.2f} s at the stand-in's decode pace (median {verifier_part:.2f} s from the gate's pass "
               "to the verifier's)."),
        next_step=("make the ready gate follow the head's log instead of polling it (`docker logs --follow "
                   "--since` over the existing ssh master, waking on the startup line), or poll the head's "
                   "/v1/models every ~0.5 s once the load phase has ended, keeping the 5 s poll for the other "
                   "ranks; then re-run `make bench`. The verifier's own request time is the floor that remains."),
    )
    out["verify_latency_s"] = report.measured(
        SPECS["verify_latency_s"], [h["verify_latency_s"] for h in healthy],
        "The verifier's `latencySeconds` output: the recipe's request answered by the stand-in at its decode "
        "pace (20 and 40 tok/s runs together).")
    out["gates_overhead_over_boot_s"] = report.measured(
        SPECS["gates_overhead_over_boot_s"], [h["gates_overhead_over_boot_s"] for h in healthy],
        "(`stack.up()` returned - first rank container started) - (head container started -> its startup "
        f"line), healthy 2 nodes, SIM_LOAD_SECONDS {loads}; median stand-in boot "
        f"{med([h['head_boot_s'] for h in healthy]).value:.2f} s, median gated up "
        f"{med([h['up_wall_s'] for h in healthy]).value:.2f} s. The containers are started by sim/ranks.py "
        "before the up, so this is what the gates and the verifier (and the engine) add after the boot, not "
        "up_overhead_s.")

    for rate in DECODE_RATES:
        errors = [h["decode_error_pct"] for h in healthy if h["rate"] == rate]
        rates = [h["decode_tokens_per_second"] for h in healthy if h["rate"] == rate]
        out[f"decode_probe_error_pct@{rate}"] = report.measured(
            SPECS[f"decode_probe_error_pct@{rate}"], errors,
            f"|probe - {rate}| / {rate}: the verifier's decode probe (gates.minDecodeTokensPerSecond=1) read from "
            f"its `decodeTokensPerSecond` output; measured {', '.join(f'{r:.2f}' for r in rates)} tok/s.",
            cause=(f"the probe measured {med(rates).value:.2f} tok/s (median) where the stand-in paces {rate}."),
            next_step=("compare the probe's token count and timing with the stand-in's pacing "
                       "(tokens after the first / their time) and fix whichever side counts wrong."),
        )

    dead_s = [d["up_failed_s"] for d in dead]
    gate_dead = [d["ready_gate_failed_event_s"] for d in dead if d["ready_gate_failed_event_s"] is not None]
    kill_after = ", ".join(f"{d['kill_after_ready_gate_s']:.1f}" for d in dead)
    into_load = ", ".join(f"{d['killed_s_into_load']:.1f}" for d in dead if d["killed_s_into_load"] is not None)
    out["dead_rank_detect_s"] = report.measured(
        SPECS["dead_rank_detect_s"], dead_s,
        f"`docker kill` of the worker {kill_after} s after the ready gate started polling, mid-load "
        f"(SIM_LOAD_SECONDS={DEAD_LOAD_S}; killed {into_load} s into the worker's load), from its "
        "`.State.FinishedAt` to `stack.up()` raising; the ready gate's failure event arrived after "
        f"{', '.join(f'{g:.2f}' for g in gate_dead)} s.",
        cause=(f"the ready gate checks the containers' state once per {GATE_POLL_S:g} s poll over ssh, then the "
               "engine winds the update down."),
        next_step=("watch `docker events --filter container=...` over the ssh master for `die` instead of "
                   "polling `docker inspect`; re-run `make bench`."),
    )
    over = [st["overrun_s"] for st in stalls]
    out["stall_detect_overrun_s"] = report.measured(
        SPECS["stall_detect_overrun_s"], over,
        f"SIM_FAULT=stall-after-load, stallSeconds={STALL_S}: `stack.up()` raising minus (the last log line of "
        f"any rank + {STALL_S} s). The gate counts silence from when it read the last line, so up to one poll "
        f"({GATE_POLL_S:g} s) of read delay and one of check delay can add to the limit.",
        cause=(f"silence is measured from when the gate read the last line (up to {GATE_POLL_S:g} s after it "
               f"was written) and checked once per {GATE_POLL_S:g} s poll."),
        next_step=("count silence from the docker timestamp of the last line rather than the time it was "
                   "read; re-run `make bench`."),
    )
    out["toolchain_warm_s"] = report.measured(
        SPECS["toolchain_warm_s"], toolchain,
        "`bash toolchain/build.sh` with everything built; includes its three look-ups of the pieces the Go "
        "module proxy refuses.")
    out["toolchain_cold_s"] = report.from_record(
        SPECS["toolchain_cold_s"], TOOLCHAIN_COLD_S,
        "Not re-measured in a routine run (a cold build wipes Go's caches and takes ~5 min): the last measured "
        "value from README.md, 'CLI, everything cold' (4 min 52 s, empty module and build caches).")
    return out


def conditions(sim: dict[str, Any], staging_s: float) -> list[str]:
    return [
        f"Simulated cluster (`make sim-up`): {len(sim['nodes'])} loopback nodes "
        f"({', '.join(n['ip'] for n in sim['nodes'])}), each its own dockerd + sshd; stand-in vLLM image "
        f"`{sim['image']}` from the loopback registry; checkpoint staged once from the hub stand-in with the "
        f"program's own staging command ({staging_s:.1f} s).",
        "The ranks' containers are started by `sim/ranks.py` from the program's own spec with the docker CLI "
        "(the stand-in for the docker provider); everything after them is the program's rendezvous gate, ready "
        "gate and verifier (`components.deployment.verify_after`) run by the project's Pulumi CLI (v3.260.0, "
        "stand-in Python language host, file backend) through the Automation API, reading the ranks over ssh.",
        f"Gates at the program's defaults: poll every {GATE_POLL_S:g} s, the ready gate every "
        f"{ReadySettings().near_ready_poll_s:g} s from KV-cache profiling on; "
        "sim settings from `sim.ranks.sim_settings` "
        f"(readyTimeoutSeconds 180, verifyTimeoutSeconds 30); stallSeconds {STALL_S} in the stall runs.",
        f"Stand-in load times: SIM_LOAD_SECONDS={READY_LOAD_S} (healthy runs), {DEAD_LOAD_S} (dead rank), "
        f"{STALL_LOAD_S} (stall), plus the phase shift below; decode pace SIM_DECODE_TOKENS_PER_SECOND "
        f"{' and '.join(map(str, DECODE_RATES))}.",
        f"Poll phase: the gates poll every {GATE_POLL_S:g} s from a near-constant offset after the containers "
        "start, so one fixed timing would sample one phase only. Run k of n shifts the observed event by "
        f"k x {GATE_POLL_S:g}/n s (the healthy load time, the dead-rank kill delay, the stall load time), so the "
        "runs cover a whole poll interval evenly.",
        "All times are host-clock differences on one machine (the nodes' daemons share its clock).",
    ]


def render(results_path: Path = RESULTS, out: Path = BENCHMARKS) -> None:
    out.write_text(report.render_markdown(json.loads(results_path.read_text())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--render", action="store_true", help="only redraw BENCHMARKS.md from results.json")
    parser.add_argument("--runs", type=int, default=report.MIN_RUNS, help="runs per figure (at least 3)")
    args = parser.parse_args(argv)
    if args.render:
        render()
        return 0
    if args.runs < report.MIN_RUNS:
        parser.error(f"--runs {args.runs}: each figure is the median of at least {report.MIN_RUNS} runs")

    bench_began = time.monotonic()
    sim = json.loads((cluster.default_layout().state / "sim.json").read_text())
    pulumi_root = Path(os.environ.get("DSV41_TOOLCHAIN_DIR") or "")
    if not os.access(pulumi_root / "bin" / "pulumi", os.X_OK):
        print("bench: DSV41_TOOLCHAIN_DIR/bin/pulumi is missing; run through `make bench` (it builds the "
              "toolchain and sources toolchain/env.sh)", file=sys.stderr)
        return 2
    run_id = uuid.uuid4().hex[:12]
    WORK.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"run-{run_id}-", dir=WORK))
    weights = Path(tempfile.mkdtemp(prefix="dsv41-bench-weights-"))
    label = f"dsv41.bench={run_id}"
    try:
        staging_s = stage_weights(sim, weights)
        print(f"bench: staged the checkpoint in {staging_s:.1f} s", flush=True)
        b = Bench(sim=sim, weights=weights, label=label, pulumi_root=pulumi_root, work=work)
        healthy = [
            sample
            for n, rate in enumerate(DECODE_RATES)
            for sample in repeat(f"healthy {rate} tok/s", args.runs,
                                 lambda i, shift, rate=rate: b.healthy(i, rate, shift),  # type: ignore[misc]
                                 first=n * args.runs, total=len(DECODE_RATES) * args.runs)
        ]
        dead = repeat("dead rank", args.runs, b.dead_rank)
        stalls = repeat("stall", args.runs, b.stall)
        toolchain = time_toolchain(args.runs)
        print(f"bench: toolchain warm {toolchain}", flush=True)
    finally:
        remove_labelled(label)
        shutil.rmtree(weights, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    measured = analyse(healthy, dead, stalls, toolchain)
    metrics = {**unmeasurable(), **measured}
    results: dict[str, Any] = {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "commit": _sh("git", "-C", str(REPO), "rev-parse", "--short", "HEAD").strip(),
        "bench_seconds": round(time.monotonic() - bench_began, 1),
        "machine": machine(),
        "conditions": conditions(sim, staging_s),
        "metrics": {k: metrics[k] for k in SPECS if k in metrics},
        "raw": {"healthy": healthy, "dead_rank": dead, "stall": stalls, "toolchain_warm_s": toolchain},
    }
    RESULTS.write_text(json.dumps(results, indent=2, default=str) + "\n")
    render()
    for key, m in results["metrics"].items():
        print(f"bench: {key:28s} {m['status']:13s} {m['value']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
