"""The measured scenarios of `make bench` (bench/run.py), each on a new stack of the real program that it destroys
at the end: the 2-node cycle (cold up, no-op up, preview, decode probes, a replacing up, a dead rank, a stall),
real vLLM's cold boot and dead rank, the previews of a deployed 2-node and 8-node stack, the observed stack's
no-op ups, and the copy-mode stack (issue 15). Each returns its raw figures; bench/analysis.py makes them
records.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pulumi import automation as auto

from bench import report
from bench.analysis import preview_phases
from bench.copy_mode import copy_outputs, time_copy_check
from bench.harness import (
    DEAD_GROUP,
    DEAD_LOAD_S,
    DECODE_RATES,
    GRAPH_S,
    KILL_AFTER_READY_GATE_S,
    MASTER_2,
    MASTER_8,
    PORT_2,
    PORT_8,
    READY_LOAD_S,
    SIM_RACES,
    STALL_LOAD_S,
    STALL_S,
    STARTUP_LINE,
    STEP_TIMEOUT,
    WORK,
    Events,
    Up,
    op_counts,
    ssh_clients,
    sshd_accepted,
    with_changes,
)
from sim.deploy import Deployment, assert_verified, docker_on, new_deployment, remove_deployment


@dataclass
class Bench:
    sim2: dict[str, Any]
    sim8: dict[str, Any]
    weights: Path
    env: dict[str, str]
    pulumi_root: Path
    run_id: str
    ssh_log: Path | None = None

    def indices(self, d: Deployment) -> list[int]:
        return [int(n["index"]) for n in d.sim["nodes"]]

    def new_stack(self, name: str, *, eight: bool = False, **config_kw: Any) -> Deployment:
        """A new stack of the real program on the bench's 2 nodes (`eight`: its 8), with the bench's environment,
        weights and that size's ports; `config_kw` go to the sim config (sim.stack.sim_config)."""
        sim, port, master_port = (self.sim8, PORT_8, MASTER_8) if eight else (self.sim2, PORT_2, MASTER_2)
        return new_deployment(
            sim,
            name,
            self.env,
            self.pulumi_root,
            weights_root=self.weights,
            port=port,
            master_port=master_port,
            **config_kw,
        )

    def destroy(self, d: Deployment) -> float:
        """Destroy the stack and remove it; the seconds that took."""
        began = time.monotonic()
        remove_deployment(d)
        return time.monotonic() - began

    def run_up(
        self,
        d: Deployment,
        config: dict[str, Any] | None = None,
        *,
        expect_failure: bool = False,
        events: Events | None = None,
    ) -> Up:
        if config is not None:
            d.write_config(config)
        events = events or Events()
        before = sshd_accepted(self.indices(d))
        began = time.time()
        try:
            result: auto.UpResult | None = d.up(on_event=events)
            error = ""
        except auto.CommandError as err:
            if not expect_failure:
                raise RuntimeError(f"up of {d.name} failed:\n{err}\n" + "\n".join(d.lines[-60:])) from err
            result, error = None, str(err) + "\n".join(d.lines)
        ended = time.time()
        time.sleep(0.5)  # let sshd log the last accepts
        print(f"bench:   {d.name} up {ended - began:.1f} s ({'failed' if result is None else 'ok'})", flush=True)
        if expect_failure and result is not None:
            raise RuntimeError(f"up of {d.name} succeeded where its fault must fail it")
        if expect_failure and any(r in error for r in SIM_RACES):
            raise RuntimeError(f"up of {d.name} failed on the sim's shared authorized_keys:\n{error}")
        return Up(
            result,
            events,
            began,
            ended,
            sshd_accepted(self.indices(d)) - before,
            error,
            ssh_clients(self.ssh_log, began, ended),
        )

    def logs(self, d: Deployment, rank: int) -> str:
        node = d.sim["nodes"][rank]
        proc = docker_on(int(node["index"]), "logs", "--timestamps", d.container(node))
        return proc.stdout + proc.stderr  # the stand-in logs to both; every line carries its timestamp

    def state_time(self, d: Deployment, rank: int, field_name: str) -> float:
        node = d.sim["nodes"][rank]
        out = docker_on(int(node["index"]), "inspect", "-f", "{{.State." + field_name + "}}", d.container(node))
        return report.parse_rfc3339(out.stdout.strip())

    def base(self, load: float, rate: int) -> dict[str, str]:
        return {
            "SIM_LOAD_SECONDS": f"{load:.2f}",
            "SIM_GRAPH_SECONDS": f"{GRAPH_S:g}",
            "SIM_DECODE_TOKENS_PER_SECOND": str(rate),
        }

    def ready_sample(self, d: Deployment, up: Up) -> dict[str, Any]:
        startup = report.first_line_at(self.logs(d, 0), STARTUP_LINE)
        v_out, r_out, r_pre = (
            up.events.at("verify", "outputs"),
            up.events.at("ready", "outputs"),
            up.events.at("ready", "pre"),
        )
        if startup is None or v_out is None or r_out is None or r_pre is None:
            raise RuntimeError(
                f"{d.name}: missing a timestamp (startup line {startup}, ready gate {r_pre}/{r_out}, verifier {v_out})"
            )
        return {
            "ready_gate_started_before_startup": r_pre < startup,
            "ready_gate_passed_s": r_out - startup,
            "watch_fallback": any("polling node" in line for line in d.lines),
            "verifier_passed_s": v_out - startup,
            "up_returned_s": up.ended - startup,
        }

    # --- the 2-node cycle: cold up, no-op up, preview, probe, replace, probe, dead rank, stall --------------

    def cycle(self, index: int, shift: float) -> dict[str, Any]:
        load = READY_LOAD_S + shift
        name = f"bench-{self.run_id}-2n-{index}"
        d = self.new_stack(name, extra_env=self.base(load, DECODE_RATES[0]))
        out: dict[str, Any] = {"stack": name, "load_s": load, "graph_s": GRAPH_S}
        try:
            cold = self.run_up(d)
            assert cold.result is not None
            assert_verified(d, cold.result.outputs)
            out["cold"] = {
                "wall_s": cold.wall,
                "ssh": cold.ssh,
                "ssh_clients": cold.clients,
                "changes": cold.changes(),
                "verify_latency_s": float(cold.result.outputs["verification"].value["latencySeconds"]),
                **self.ready_sample(d, cold),
            }

            noop = self.run_up(d)
            if set(noop.changes()) != {"same"}:
                raise RuntimeError(f"{name}: the no-op up changed something: {noop.changes()}")
            out["noop"] = {"wall_s": noop.wall, "ssh": noop.ssh, "ssh_clients": noop.clients}

            before = sshd_accepted(self.indices(d))
            began = time.monotonic()
            preview = d.preview()
            out["preview"] = {
                "wall_s": time.monotonic() - began,
                "changes": op_counts(preview.change_summary),
                "ssh": sshd_accepted(self.indices(d)) - before,
            }

            probe_cfg = with_changes(d.config, gates={"minDecodeTokensPerSecond": 1})
            probe = self.run_up(d, probe_cfg)
            assert probe.result is not None
            out["probe_20"] = {
                "wall_s": probe.wall,
                "ssh": probe.ssh,
                "changes": probe.changes(),
                "rate": float(probe.result.outputs["decodeTokensPerSecond"].value),
            }

            replace_cfg = with_changes(
                d.config,
                env={"SIM_DECODE_TOKENS_PER_SECOND": str(DECODE_RATES[1])},
                gates={"minDecodeTokensPerSecond": None},
            )
            replace = self.run_up(d, replace_cfg)
            assert replace.result is not None
            assert_verified(d, replace.result.outputs)
            if not replace.changes().get("replace"):
                raise RuntimeError(f"{name}: the serve change replaced nothing: {replace.changes()}")
            out["replace"] = {
                "wall_s": replace.wall,
                "ssh": replace.ssh,
                "ssh_clients": replace.clients,
                "changes": replace.changes(),
                "verify_latency_s": float(replace.result.outputs["verification"].value["latencySeconds"]),
                **self.ready_sample(d, replace),
            }

            probe = self.run_up(d, with_changes(d.config, gates={"minDecodeTokensPerSecond": 1}))
            assert probe.result is not None
            out["probe_40"] = {
                "wall_s": probe.wall,
                "ssh": probe.ssh,
                "rate": float(probe.result.outputs["decodeTokensPerSecond"].value),
            }

            out["dead_rank"] = self.dead_rank(d, KILL_AFTER_READY_GATE_S + shift)
            out["stall"] = self.stall(d, STALL_LOAD_S + shift)
        finally:
            out["destroy_s"] = self.destroy(d)
        return out

    # --- real vLLM: a cold boot to verified, then a worker killed while the ready gate watches -------------

    def real_cycle(self, index: int, shift: float) -> dict[str, Any]:
        name = f"bench-{self.run_id}-real-{index}"
        d = self.new_stack(name, server="real")
        out: dict[str, Any] = {"stack": name}
        try:
            cold = self.run_up(d)
            assert cold.result is not None
            assert_verified(d, cold.result.outputs)
            created = min(self.state_time(d, r, "StartedAt") for r in range(len(d.sim["nodes"])))
            out["cold"] = {
                "wall_s": cold.wall,
                "boot_to_verified_s": (cold.events.at("verify", "outputs") or 0) - created,
                **self.ready_sample(d, cold),
            }
            # A serve change boots both ranks again; the worker is killed once the ready gate watches.
            events = Events()
            worker = d.sim["nodes"][1]
            killed: dict[str, float] = {}

            def kill_when_ready_gate_watches() -> None:
                deadline = time.monotonic() + 600
                while events.at("ready", "pre") is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(KILL_AFTER_READY_GATE_S + shift)
                if docker_on(int(worker["index"]), "kill", d.container(worker)).returncode == 0:
                    killed["at"] = time.time()

            killer = threading.Thread(target=kill_when_ready_gate_watches, daemon=True)
            killer.start()
            up = self.run_up(
                d,
                # A gates-only change re-runs the verifier on the running ranks; an env change replaces them.
                with_changes(d.config, env={"DSV41_BENCH_BOOT": f"dead-{index}"}, gates={"verifyTimeoutSeconds": 121}),
                expect_failure=True,
                events=events,
            )
            killer.join(timeout=STEP_TIMEOUT)
            # The worker dies while the ready gate watches, or (a real pair whose ready phase is shorter than the
            # kill's delay) just after it passed: then the verifier names the dead group. Either is the program
            # catching a dead rank; which one is recorded.
            caught_by = "ready gate" if "rank 1" in up.error else "verifier" if DEAD_GROUP in up.error else None
            if "at" not in killed or caught_by is None:
                # The engine's error ends with the outputs diff: keep it all, quote the lines that say why.
                WORK.mkdir(parents=True, exist_ok=True)
                (WORK / f"{name}-dead-rank.log").write_text(up.error)
                why = [line.strip() for line in up.error.splitlines() if "error" in line.lower()][:12]
                raise RuntimeError(f"real dead rank: killed={killed}, failure ({WORK}/{name}-dead-rank.log): {why}")
            exited = self.state_time(d, 1, "FinishedAt")
            gate_failed = events.at("ready", "failed") or events.at("ready", "error")
            out["dead_rank"] = {
                "up_failed_s": up.ended - exited,
                "ready_gate_failed_event_s": gate_failed - exited if gate_failed else None,
                "caught_by": caught_by,
            }
        finally:
            remove_deployment(d)
        return out

    def dead_rank(self, d: Deployment, kill_after: float) -> dict[str, Any]:
        """Kill the worker mid-load once the ready gate is polling; time until `up` fails."""
        cfg = with_changes(
            d.config, env={"SIM_LOAD_SECONDS": str(DEAD_LOAD_S)}, gates={"minDecodeTokensPerSecond": None}
        )
        events = Events()
        killed: dict[str, Any] = {}
        worker = d.sim["nodes"][1]

        def kill_when_ready_gate_polls() -> None:
            deadline = time.monotonic() + STEP_TIMEOUT + DEAD_LOAD_S
            while events.at("ready", "pre") is None and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(kill_after)
            log = self.logs(d, 1)
            # A worker loads in silence (only rank 0 draws the progress bar): between these two lines it loads.
            killed["loading"] = "Starting to load model" in log and "Loading weights took" not in log
            killed["ready_gate_started"] = events.at("ready", "pre") is not None
            proc = docker_on(int(worker["index"]), "kill", d.container(worker))
            killed["kill"] = proc.stdout.strip() or proc.stderr.strip()

        killer = threading.Thread(target=kill_when_ready_gate_polls, daemon=True)
        killer.start()
        up = self.run_up(d, cfg, expect_failure=True, events=events)
        killer.join(timeout=STEP_TIMEOUT)
        if not killed.get("kill"):
            raise RuntimeError(f"dead rank: the worker was never killed; up failed with: {up.error[-800:]}")
        if not killed["loading"]:
            raise RuntimeError("dead rank: the worker was not loading when killed (raise DEAD_LOAD_S)")
        if "rank 1" not in up.error:
            raise RuntimeError(f"dead rank: the failure does not name rank 1: {up.error[-800:]}")
        exited = self.state_time(d, 1, "FinishedAt")
        gate_failed = events.at("ready", "failed") or events.at("ready", "error")
        loading_since = report.first_line_at(self.logs(d, 1), "Starting to load model")
        return {
            "kill_after_ready_gate_s": kill_after,
            "worker_exit": report.iso_utc(exited),
            "killed_s_into_load": exited - loading_since if loading_since else None,
            "ready_gate_polling_at_kill": killed["ready_gate_started"],
            "ready_gate_failed_event_s": gate_failed - exited if gate_failed else None,
            "up_failed_s": up.ended - exited,
            "wall_s": up.wall,
            "ssh": up.ssh,
        }

    def stall(self, d: Deployment, load: float) -> dict[str, Any]:
        """Every rank goes silent after load; the ready gate must call it at stallSeconds."""
        cfg = with_changes(
            d.config,
            env={"SIM_FAULT": "stall-after-load", "SIM_LOAD_SECONDS": f"{load:.2f}"},
            gates={"stallSeconds": STALL_S},
        )
        up = self.run_up(d, cfg, expect_failure=True)
        if "no rank logged anything new" not in up.error:
            raise RuntimeError(f"stall: not a stall verdict: {up.error[-800:]}")
        last = max(t for t in (report.last_line_at(self.logs(d, r)) for r in range(len(d.sim["nodes"]))) if t)
        gate_failed = up.events.at("ready", "failed") or up.events.at("ready", "error")
        return {
            "load_s": load,
            "last_log_line": report.iso_utc(last),
            "ready_gate_failed_event_s": gate_failed - last - STALL_S if gate_failed else None,
            "overrun_s": up.ended - last - STALL_S,
            "wall_s": up.wall,
        }

    # --- 2 nodes: one cold up, then previews of the deployed stack (with the 8-node one: --previews-only) -----

    def previews2(self, runs: int) -> list[dict[str, Any]]:
        name = f"bench-{self.run_id}-2n-previews"
        d = self.new_stack(name, extra_env=self.base(READY_LOAD_S, DECODE_RATES[0]))
        try:
            cold = self.run_up(d)
            assert cold.result is not None
            assert_verified(d, cold.result.outputs)
            previews = [self.timed_preview(d, "2-node") for _ in range(runs)]
            previews[0]["phases"] = self.preview_breakdown(d)
            return previews
        finally:
            remove_deployment(d)

    def timed_preview(self, d: Deployment, what: str) -> dict[str, Any]:
        before = sshd_accepted(self.indices(d))
        began = time.monotonic()
        p = d.preview()
        out = {"wall_s": time.monotonic() - began, "changes": op_counts(p.change_summary)}
        out["ssh"] = sshd_accepted(self.indices(d)) - before
        print(f"bench: {what} preview {out}", flush=True)
        return out

    def preview_breakdown(self, d: Deployment) -> dict[str, Any]:
        """One more preview, verbose, not timed with the others: where its time goes."""
        proc = d.cli("preview", "--diff", "--logtostderr", "-v=5", check=False)
        phases = preview_phases(proc.stderr)
        print(f"bench: preview phases {phases}", flush=True)
        return phases

    def noop_observed(self, runs: int) -> list[float]:
        """No-op ups of a 2-node stack as an owner runs it, the supervisor and the observability layer on."""
        name = f"bench-{self.run_id}-2n-observed"
        d = self.new_stack(
            name, extra_env=self.base(READY_LOAD_S, DECODE_RATES[0]), supervisor=True, observability=True
        )
        try:
            cold = self.run_up(d)
            assert cold.result is not None
            assert_verified(d, cold.result.outputs)
            walls = []
            for _ in range(runs):
                noop = self.run_up(d)
                if set(noop.changes()) != {"same"}:
                    raise RuntimeError(f"{name}: the no-op up changed something: {noop.changes()}")
                walls.append(noop.wall)
                print(f"bench: observed no-op up {noop.wall:.2f} s", flush=True)
            return walls
        finally:
            remove_deployment(d)

    # --- 8 nodes: one cold up, then previews of the deployed stack --------------------------------------

    def eight(self, runs: int) -> dict[str, Any]:
        name = f"bench-{self.run_id}-8n"
        d = self.new_stack(name, eight=True, extra_env=self.base(READY_LOAD_S, DECODE_RATES[0]))
        out: dict[str, Any] = {"stack": name, "nodes": len(self.sim8["nodes"])}
        try:
            attempts: list[str] = []
            while True:
                try:
                    cold = self.run_up(d)
                    break
                except RuntimeError as err:  # 8 watchdog installs at once on the sim's one authorized_keys
                    if not any(r in str(err) for r in SIM_RACES) or len(attempts) >= 3:
                        raise
                    attempts.append(str(err)[-600:])
                    print("bench: 8-node up hit the sim's shared authorized_keys race; up again", flush=True)
            out["race_retries"] = attempts
            assert cold.result is not None
            assert_verified(d, cold.result.outputs)
            out["cold"] = {
                "wall_s": cold.wall,
                "ssh": cold.ssh,
                "ssh_clients": cold.clients,
                "changes": cold.changes(),
                "after_race_retries": len(attempts),
            }
            print(f"bench: 8-node cold up {cold.wall:.1f} s, {cold.ssh} ssh sessions", flush=True)
            out["previews"] = [self.timed_preview(d, "8-node") for _ in range(runs)]
            out["phases"] = self.preview_breakdown(d)
        finally:
            out["destroy_s"] = self.destroy(d)
        return out

    # --- issue 15: `weights.share: copy` (the worker's own copy) ---------------------------------------------

    def copy_cycle(self, index: int, shift: float) -> dict[str, Any]:
        """A new copy-mode stack: the first up fills the worker's copy, a second up copies nothing; each
        copy step timed from the engine's events, the per-preview check timed on its own."""
        name = f"bench-{self.run_id}-copy-{index}"
        copies = Path(tempfile.mkdtemp(prefix=f"dsv41-bench-copies-{self.run_id}-", dir="/var/tmp"))
        d = self.new_stack(
            name, extra_env=self.base(READY_LOAD_S + shift, DECODE_RATES[0]), copy_root=f"{copies}/{{node}}"
        )
        worker = f"weights-copy-node-{self.sim2['nodes'][1]['index']}"
        out: dict[str, Any] = {"stack": name}
        try:
            first = self.run_up(d)
            assert first.result is not None
            assert_verified(d, first.result.outputs)
            pre, done = first.events.at(worker, "pre"), first.events.at(worker, "outputs")
            if pre is None or done is None:
                raise RuntimeError(f"{name}: no engine events for {worker}")
            outs = copy_outputs(d)
            out["first"] = {
                "wall_s": first.wall,
                "step_s": done - pre,
                "bytes": outs["copied_bytes"],
                "files": outs["copied_files"],
                "copier_s": outs["copy_seconds"],
                "provider_s": outs["elapsed_s"],
            }
            second = self.run_up(d)
            if set(second.changes()) != {"same"}:
                raise RuntimeError(f"{name}: the second copy-mode up changed something: {second.changes()}")
            if copy_outputs(d)["verified_at"] != outs["verified_at"]:
                raise RuntimeError(f"{name}: the second up copied again")
            out["second"] = {"wall_s": second.wall, "check_s": time_copy_check(outs)}
        finally:
            remove_deployment(d)
            shutil.rmtree(copies, ignore_errors=True)
        return out
