"""Unit tests of the benchmark logic (no sim, no engine): `venv/bin/python -m pytest bench`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pulumi.automation import events as ev

from bench import analysis, harness, report, staging
from bench.report import SPECS


def test_summary_is_median_min_max_of_at_least_three_runs() -> None:
    s = report.summarize([3.0, 1.0, 2.0, 10.0])
    assert (s.value, s.min, s.max, s.runs) == (2.5, 1.0, 10.0, (3.0, 1.0, 2.0, 10.0))
    with pytest.raises(ValueError, match="at least 3 runs"):
        report.summarize([1.0, 2.0])


def test_verdict_against_the_issue_targets() -> None:
    assert report.verdict(SPECS["ready_detect_s"], 0.25) == report.MET
    assert report.verdict(SPECS["ready_detect_s"], 0.26) == report.MISSED
    assert report.verdict(SPECS["dead_rank_detect_s"], 1.01) == report.MISSED
    assert report.verdict(SPECS["stall_detect_overrun_s"], 2.0) == report.MET
    assert report.verdict(SPECS["toolchain_warm_s"], 99.0) == report.REPORTED


def test_a_missed_target_must_carry_cause_and_next_step() -> None:
    with pytest.raises(ValueError, match="ready_detect_s missed"):
        report.measured(SPECS["ready_detect_s"], [5.0, 6.0, 7.0], "note")
    missed = report.measured(SPECS["ready_detect_s"], [5.0, 6.0, 7.0], "note", cause="c", next_step="n")
    assert (missed["status"], missed["value"], missed["cause"], missed["next_step"]) == ("missed", 6.0, "c", "n")
    met = report.measured(SPECS["ready_detect_s"], [0.1, 0.15, 0.12], "note", cause="c", next_step="n")
    assert met["status"] == "met" and "cause" not in met


def test_not_measured_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="say why"):
        report.not_measured(SPECS["noop_up_s"], "")
    assert report.not_measured(SPECS["noop_up_s"], "no provider")["status"] == report.NOT_MEASURED


def test_docker_timestamps_keep_sub_second_precision() -> None:
    assert report.parse_rfc3339("2026-01-02T03:04:05.123456789Z") == pytest.approx(1767323045.123456789, abs=1e-6)
    assert report.parse_rfc3339("2026-01-02T04:04:05.5+01:00") == pytest.approx(1767323045.5)
    assert report.parse_rfc3339("2026-01-02T03:04:05Z") == 1767323045.0
    with pytest.raises(ValueError, match="not RFC 3339"):
        report.parse_rfc3339("yesterday")


def test_first_and_last_log_lines() -> None:
    log = (
        "2026-01-02T03:04:05.100000000Z INFO loading\n"
        "2026-01-02T03:04:06.250000000Z (APIServer pid=1) INFO:     Application startup complete.\n"
        "2026-01-02T03:04:07.000000000Z tail\n"
        "2026-01-02T03:04:08.000000000Z \n"
    )
    assert report.first_line_at(log, "Application startup complete.") == pytest.approx(1767323046.25)
    assert report.first_line_at(log, "absent") is None
    assert report.last_line_at(log) == pytest.approx(1767323047.0)  # the empty line does not count
    assert report.last_line_at("") is None


def test_machine_info_from_nproc_free_and_cpuinfo() -> None:
    free = "               total        used\nMem:              23           0\nSwap:  0 0\n"
    info = report.machine_info("2\n", free, "processor\t: 0\nmodel name\t: AMD EPYC\n", "Linux 6.1\n")
    assert info == {"cpus": 2, "memory_gib": 23, "cpu_model": "AMD EPYC", "kernel": "Linux 6.1"}


def _results(metrics: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "generated_at": "2026-01-02T03:04:05Z",
        "commit": "abc1234",
        "bench_seconds": 600.0,
        "machine": {"cpus": 2, "memory_gib": 23, "cpu_model": "AMD EPYC", "kernel": "Linux 6.1"},
        "conditions": ["two loopback nodes"],
        "metrics": metrics,
    }


def test_markdown_has_the_table_the_machine_and_every_miss_explained() -> None:
    md = report.render_markdown(
        _results(
            {
                "ready_detect_s": report.measured(
                    SPECS["ready_detect_s"], [5.0, 6.0, 7.0], "n", cause="polls every 5 s", next_step="follow the log"
                ),
                "noop_up_s": report.not_measured(SPECS["noop_up_s"], "no docker provider"),
                "decode_probe_error_pct@20": report.measured(SPECS["decode_probe_error_pct@20"], [1.0, 2.0, 3.0], "n"),
            }
        )
    )
    assert (
        "| `ready_detect_s` | 6.00 s | 5.00 s .. 7.00 s | 3 | <= 0.25 s (issue 14; was <= 2 s) | up to 10 s | "
        "**missed** |"
    ) in md
    assert "| `noop_up_s` | - | - | - | <= 15 s, zero changes | - | not measured |" in md
    assert "| `decode_probe_error_pct` (20 tok/s) | 2.0 % |" in md
    assert "2 CPUs (AMD EPYC), 23 GiB RAM" in md and "- two loopback nodes" in md
    assert "Cause: polls every 5 s" in md and "Next step: follow the log" in md
    assert "no docker provider" in md


def test_markdown_without_misses_says_so_and_rejects_unknown_metrics() -> None:
    ok = report.measured(SPECS["ready_detect_s"], [0.1, 0.1, 0.1], "n")
    assert "None of the measured targets was missed." in report.render_markdown(_results({"ready_detect_s": ok}))
    with pytest.raises(ValueError, match="unknown metric 'bogus'"):
        report.render_markdown(_results({"bogus": ok}))


def _meta(urn: str) -> ev.StepEventMetadata:
    return ev.StepEventMetadata(op=ev.OpType.CREATE, urn=urn, type="t", provider="p")


def test_phase_shifts_cover_one_poll_interval_evenly() -> None:
    step = harness.GATE_POLL_S / 3
    assert [harness.phase_shift(i, 3) for i in range(3)] == pytest.approx([0.0, step, 2 * step])


def test_events_keep_the_first_arrival_per_resource_and_kind() -> None:
    events = harness.Events()
    urn = "urn:pulumi:s::p::pulumi-python:dynamic:Resource::ready"
    events(ev.EngineEvent(sequence=1, timestamp=0, resource_pre_event=ev.ResourcePreEvent(metadata=_meta(urn))))
    first = events.at("ready", "pre")
    events(ev.EngineEvent(sequence=2, timestamp=0, resource_pre_event=ev.ResourcePreEvent(metadata=_meta(urn))))
    assert first is not None and events.at("ready", "pre") == first
    assert events.at("ready", "outputs") is None and events.at("verify", "pre") is None


def _cycle(ready: float, load: float = 8.0) -> dict[str, Any]:
    sample = {
        "ready_gate_started_before_startup": True,
        "ready_gate_passed_s": ready - 0.2,
        "verifier_passed_s": ready,
        "up_returned_s": ready + 0.5,
        "verify_latency_s": 0.1,
    }
    return {
        "load_s": load,
        "graph_s": 2.0,
        "cold": {"wall_s": 40.0, "ssh": 30, **sample},
        "noop": {"wall_s": 9.0, "ssh": 6},
        "preview": {"wall_s": 7.0, "changes": {"same": 20}, "ssh": 4},
        "probe_20": {"rate": 20.3},
        "probe_40": {"rate": 40.6},
        "replace": {"wall_s": 35.0, "ssh": 20, **sample},
        "dead_rank": {"up_failed_s": 7.0, "ready_gate_failed_event_s": 5.0, "kill_after_ready_gate_s": 3.0},
        "stall": {"overrun_s": 4.0, "ready_gate_failed_event_s": 1.5},
    }


def test_analysis_turns_samples_into_records_and_explains_what_is_missed() -> None:
    cycles = [_cycle(x) for x in (4.0, 5.0, 6.0)]
    eight = {"cold": {"wall_s": 90.0, "ssh": 100}, "previews": [{"wall_s": x, "ssh": 12} for x in (20.0, 21.0, 22.0)]}
    out = analysis.analyse(cycles, eight, [1.0, 1.1, 1.2])
    assert out["ready_detect_s"]["status"] == "missed" and out["ready_detect_s"]["value"] == 5.0
    assert "what dominates: the ready gate" in out["ready_detect_s"]["cause"]
    assert "Issue 14's target (<= 0.25 s): missed; what dominates: the gate" in out["ready_detect_s"]["note"]
    dead = out["dead_rank_detect_s"]
    assert dead["status"] == "missed" and dead["value"] == 7.0
    assert "what dominates: the gate" in dead["cause"] and "5.00, 5.00, 5.00 s after the exit" in dead["note"]
    stall = out["stall_detect_overrun_s"]
    assert stall["value"] == 4.0 and stall["status"] == "missed"
    assert "what dominates: the engine winding the failed update down" in stall["cause"]
    assert out["decode_probe_error_pct@40"]["status"] == "met"
    assert out["up_overhead_s@2"]["value"] == 30.0 and out["up_overhead_s@2"]["status"] == "met"
    assert out["replace_cycle_overhead_s"]["value"] == 25.0
    assert out["noop_up_s"]["status"] == "met" and out["preview_s@2"]["value"] == 7.0
    assert out["preview_s@8"]["status"] == "missed" and out["preview_s@8"]["limit"] == 14.0
    assert out["ssh_sessions_per_up@noop"]["value"] == 6.0
    assert out["toolchain_warm_s"]["status"] == "reported" and out["toolchain_cold_s"]["value"] == 292.0
    assert set(out) <= set(SPECS)
    report.render_markdown(_results(out))


def test_analysis_meets_the_issue_14_targets_and_notes_a_polled_node() -> None:
    cycles = [_cycle(0.2) for _ in range(3)]
    for c in cycles:
        c["dead_rank"] = {"up_failed_s": 0.6, "ready_gate_failed_event_s": 0.4, "kill_after_ready_gate_s": 3.0}
        c["stall"] = {"overrun_s": 0.3, "ready_gate_failed_event_s": 0.1}
    cycles[0]["cold"]["watch_fallback"] = True
    out = analysis.analyse(cycles, None, [1.0, 1.1, 1.2], "not run")
    assert [out[k]["status"] for k in ("ready_detect_s", "dead_rank_detect_s", "stall_detect_overrun_s")] == ["met"] * 3
    assert "In 1 of 6 runs a node could not stream and was polled" in out["ready_detect_s"]["note"]


def test_without_the_eight_node_stack_its_figures_say_why() -> None:
    out = analysis.analyse([_cycle(1.0) for _ in range(3)], None, [1.0, 1.1, 1.2], "ssh refused")
    assert out["preview_s@8"]["status"] == "not measured" and "ssh refused" in out["preview_s@8"]["note"]


def test_changes_to_the_config_leave_the_original_alone() -> None:
    base = {"serve": {"extraEnv": {"A": "1"}}, "gates": {"x": 1}}
    changed = harness.with_changes(base, env={"A": "", "B": "2"}, gates={"x": None, "y": 3})
    assert changed == {"serve": {"extraEnv": {"B": "2"}}, "gates": {"y": 3}}
    assert base == {"serve": {"extraEnv": {"A": "1"}}, "gates": {"x": 1}}


def _engine_line(at: str, msg: str) -> str:
    return json.dumps({"time": f"2026-12-03T15:00:{at}Z", "level": "INFO", "msg": msg, "v": 5})


def test_preview_phases_come_from_the_engines_log() -> None:
    log = "\n".join(
        [
            _engine_line("00.000000000", "CLI Metadata"),
            "not json: ignored",
            _engine_line("02.500000000", "ResourceMonitor.RegisterResource received: t=pulumi:pulumi:Stack, name=s, x"),
            _engine_line(
                "02.500500000",
                "ResourceMonitor.RegisterResource operation finished: t=pulumi:pulumi:Stack, "
                "urn=urn:pulumi:p::dsv41-exl3::pulumi:pulumi:Stack::s, #outs=0",
            ),
            _engine_line(
                "03.000000000",
                "ResourceMonitor.RegisterResource received: t=docker:index/container:Container, "
                "name=serving-node-5, custom=true",
            ),
            _engine_line(
                "03.250000000",
                "ResourceMonitor.RegisterResource received: t=docker:index/container:Container, "
                "name=serving-node-6, custom=true",
            ),
            _engine_line(
                "03.500000000",
                "ResourceMonitor.RegisterResource operation finished: "
                "t=docker:index/container:Container, urn=urn:pulumi:p::dsv41-exl3::a$docker:index/container:"
                "Container::serving-node-6, #outs=3",
            ),
            _engine_line(
                "03.750000000",
                "ResourceMonitor.RegisterResource operation finished: "
                "t=docker:index/container:Container, urn=urn:pulumi:p::dsv41-exl3::a$docker:index/container:"
                "Container::serving-node-5, #outs=3",
            ),
            _engine_line("04.000000000", "the end"),
        ]
    )
    phases = analysis.preview_phases(log)
    assert phases["before_first_registration_s"] == 2.5
    assert phases["registrations_s"] == 1.25
    assert phases["after_last_registration_s"] == 0.25
    assert phases["resources"] == 3
    assert phases["by_type_s"]["Container"] == {"n": 2, "sum_s": 1.0}
    assert analysis.phases_text(phases).startswith("2.50 s before the first registration, 1.25 s of registrations (3 ")
    assert analysis.preview_phases("no engine log") == {}


def test_the_preview_breakdown_reaches_the_8_node_record() -> None:
    phases = {
        "before_first_registration_s": 2.0,
        "registrations_s": 2.5,
        "after_last_registration_s": 0.3,
        "resources": 40,
        "by_type_s": {},
    }
    previews2 = [{"wall_s": w, "changes": {"same": 40}, "ssh": 0} for w in (3.0, 3.1, 3.2)]
    previews2[0]["phases"] = phases
    eight = {"previews": [{"wall_s": w, "ssh": 0} for w in (7.0, 7.1, 7.2)], "phases": {**phases, "resources": 130}}
    rec = analysis.analyse_previews(previews2, eight)["preview_s@8"]
    assert "2 nodes 2.00 s before the first registration" in rec["note"]
    assert "(130 resources)" in rec["note"]
    assert rec["status"] == report.MISSED and "step generator" in rec["cause"]
    met = analysis.analyse_previews(previews2, {**eight, "previews": [{"wall_s": 6.0, "ssh": 0}] * 3})["preview_s@8"]
    assert met["status"] == report.MET and "cause" not in met


def test_staging_figures_give_both_rates_and_the_speed_up_in_one_record_each() -> None:
    loop = {
        "mib_s": {"1": [3.6, 3.7, 3.8], "8": [21.0, 22.2, 23.0]},
        "last_lines": {"1": "stage_weights: progress a", "8": "stage_weights: progress b"},
        "shard_mib": 3,
        "rate_mib_s": 4,
        "files": 48,
    }
    out = staging.analyse_staging(loop)
    assert set(out) == {"staging_loopback_mib_s@1", "staging_loopback_mib_s@8"} <= set(SPECS)
    assert out["staging_loopback_mib_s@1"]["value"] == 3.7 and out["staging_loopback_mib_s@8"]["value"] == 22.2
    assert "6.0 x the 1-stream rate" in out["staging_loopback_mib_s@8"]["note"]
    assert "capping every connection at 4 MiB/s" in out["staging_loopback_mib_s@1"]["note"]
    assert "(48 files)" in out["staging_loopback_mib_s@8"]["note"]
    report.render_markdown(_results(out))


def test_the_staging_checkpoint_enlarges_only_the_shards_staging_fetches() -> None:
    from components.weights import manifest as wm
    from sim import checkpoint

    repos = staging.staging_checkpoint(1000)
    model = repos[checkpoint.MODEL_REPO]
    assert sum(1 for n, d in model.items() if n.endswith(".safetensors") and len(d) == 1000) == 39
    base = repos[checkpoint.BASE_REPO]
    assert [len(base[wm.engram_shard_name(i)]) for i in (1, 47, 48)][1:] == [1000, 1000]
    assert (
        len(base[wm.engram_shard_name(1)]) != 1000
        and base[wm.ENGRAM_INDEX] == checkpoint.build()[checkpoint.BASE_REPO][wm.ENGRAM_INDEX]
    )
