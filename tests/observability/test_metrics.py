"""The program's metrics from the agents' answers (components/observability/metrics.py): pure logic."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from components.observability import metrics
from components.observability.metrics import ExporterConfig, Observed, RestartCounter

CFG = ExporterConfig(
    stack="sim",
    node="head",
    leader=True,
    generation="g1",
    image_id="sha256:abc",
    probe_seconds=60,
    watchdog_floor_gib=2.0,
    agent_url="http://127.0.0.1:1",
    leader_url="http://127.0.0.1:1",
    watchdog_log="",
    token_file="/t",
    listen_host="127.0.0.1",
    listen_port=1,
)
RANK = {"node": "head", "exists": True, "running": True, "mem_available_gib": 4.5, "generation": "g1"}
NOW = 1_000_000.0


def scrape(cfg: ExporterConfig, seen: Observed, restarts: RestartCounter | None = None) -> dict[str, float]:
    """The exposition text as Prometheus reads it, parsed back: `name{labels}` -> value."""
    counter = restarts or RestartCounter()

    class One(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            yield from metrics.families(cfg, seen, counter)

    registry = CollectorRegistry()
    registry.register(One())
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def status(**fields: Any) -> dict[str, Any]:
    return {"restarts": [], "events": [], "paused": False, **fields}


def test_a_running_rank_is_up_with_its_memory_in_bytes_and_the_floor_beside_it() -> None:
    got = scrape(CFG, Observed(now=NOW, rank=RANK))
    assert got['dsv41_rank_up{node="head"}'] == 1
    assert got['dsv41_agent_up{node="head"}'] == 1
    assert got['dsv41_mem_available_bytes{node="head"}'] == 4.5 * 2**30
    assert got['dsv41_watchdog_floor_bytes{node="head"}'] == 2 * 2**30
    assert got['dsv41_deployment_info{generation="g1",image_id="sha256:abc",node="head",stack="sim"}'] == 1
    assert got['dsv41_rank_info{generation="g1",node="head"}'] == 1


def test_a_stopped_rank_is_down_and_an_unanswering_agent_leaves_no_rank_series() -> None:
    down = scrape(CFG, Observed(now=NOW, rank={**RANK, "running": False, "exit_code": 137}))
    assert down['dsv41_rank_up{node="head"}'] == 0
    silent = scrape(CFG, Observed(now=NOW, rank=None))
    assert silent['dsv41_agent_up{node="head"}'] == 0
    # No guess: the rank's state is unknown, so Dsv41AgentUnreachable speaks, not Dsv41RankDown.
    assert not any(k.startswith("dsv41_rank_up") for k in silent)


def test_no_watchdog_means_no_floor_and_no_trip_counter() -> None:
    cfg = replace(CFG, watchdog_floor_gib=None)
    got = scrape(cfg, Observed(now=NOW, rank=RANK))
    assert not any(k.startswith(("dsv41_watchdog_floor_bytes", "dsv41_watchdog_trips")) for k in got)


def test_watchdog_trips_count_this_nodes_stop_lines_only() -> None:
    log = "\n".join(
        [
            "2026-01-01T00:00:00Z node=head container=c watchdog started pid=1 floor_kib=1",
            "2026-01-01T00:01:00Z node=head container=c STOP: MemAvailable below 1 KiB in 3 consecutive samples",
            "2026-01-01T00:01:00Z node=head container=c killed c",
            "2026-01-01T00:02:00Z node=head2 container=d STOP: MemAvailable below 1 KiB in 3 consecutive samples",
            "2026-01-01T00:03:00Z node=head container=c STOP: MemAvailable below 1 KiB in 3 consecutive samples",
        ]
    )
    got = scrape(CFG, Observed(now=NOW, rank=RANK, watchdog_log=log))
    assert got['dsv41_watchdog_trips_total{node="head"}'] == 2


def test_the_last_probe_verdict_its_age_and_bad_logprobs() -> None:
    healthy = scrape(
        CFG, Observed(now=NOW, rank=RANK, status=status(last_probe={"at": NOW - 42, "state": "healthy", "seen": "ok"}))
    )
    assert healthy['dsv41_probe_state{state="healthy"}'] == 1
    assert healthy['dsv41_probe_state{state="drift"}'] == 0
    assert healthy["dsv41_probe_healthy{}"] == 1
    assert healthy["dsv41_probe_age_seconds{}"] == 42
    assert healthy['dsv41_probe_bad_logprobs{reason=""}'] == 0
    assert healthy["dsv41_probe_interval_seconds{}"] == 60
    nan = scrape(
        CFG,
        Observed(
            now=NOW, rank=RANK, status=status(last_probe={"at": NOW, "state": "drift", "seen": "nan: NaN logprob"})
        ),
    )
    assert nan["dsv41_probe_healthy{}"] == 0
    assert nan['dsv41_probe_bad_logprobs{reason="nan"}'] == 1
    refused = scrape(
        CFG,
        Observed(
            now=NOW, rank=RANK, status=status(last_probe={"at": NOW, "state": "drift", "seen": "refuses connections"})
        ),
    )
    # A refused port is drift, but not a statement about logprobs.
    assert refused['dsv41_probe_bad_logprobs{reason=""}'] == 0


def test_the_last_verification_exports_its_logprobs_only_when_real() -> None:
    verified = {"at": NOW - 10, "generation": "g1", "answer": "Paris", "logprobs": [["Par", -0.25], ["is", -1.5]]}
    got = scrape(CFG, Observed(now=NOW, rank=RANK, status=status(last_verified=verified)))
    assert got["dsv41_last_verified_timestamp_seconds{}"] == NOW - 10
    assert got["dsv41_last_verified_logprobs_real{}"] == 1
    assert got["dsv41_last_verified_logprob{}"] == -0.25
    assert got["dsv41_last_verified_min_logprob{}"] == -1.5
    for bad in (-9999.0, math.nan, math.inf, None, 0.5):
        v = {**verified, "logprobs": [["a", -0.1], ["b", bad]]}
        got = scrape(CFG, Observed(now=NOW, rank=RANK, status=status(last_verified=v)))
        assert got["dsv41_last_verified_logprobs_real{}"] == 0, bad
        assert "dsv41_last_verified_logprob{}" not in got, bad


def test_given_up_paused_and_an_unanswering_leader() -> None:
    got = scrape(CFG, Observed(now=NOW, rank=RANK, status=status(given_up="3 restarts within 6 h", paused=True)))
    assert got["dsv41_supervisor_up{}"] == 1
    assert got["dsv41_supervisor_given_up{}"] == 1
    assert got["dsv41_supervisor_paused{}"] == 1
    gone = scrape(CFG, Observed(now=NOW, rank=RANK, status=None))
    assert gone["dsv41_supervisor_up{}"] == 0
    assert "dsv41_supervisor_given_up{}" not in gone


def test_a_worker_exports_no_supervisor_series() -> None:
    worker = replace(CFG, node="worker", leader=False)
    got = scrape(worker, Observed(now=NOW, rank={**RANK, "node": "worker"}))
    assert not any(k.startswith(("dsv41_supervisor", "dsv41_probe", "dsv41_restarts")) for k in got)


def test_restart_causes_are_bounded_labels() -> None:
    assert metrics.restart_cause("the rank on worker was OOM-killed") == "oom_killed"
    assert metrics.restart_cause("the rank on worker exited with code 137") == "rank_exited"
    assert metrics.restart_cause("the endpoint nan: NaN logprob") == "endpoint_drift"
    assert metrics.restart_cause("something new") == "other"


def test_restarts_only_go_up_when_the_supervisor_trims_its_list() -> None:
    counter = RestartCounter()
    first = [{"at": float(i), "cause": "the rank on w exited with code 1"} for i in range(50)]
    got = scrape(CFG, Observed(now=NOW, rank=RANK, status=status(restarts=first)), counter)
    assert got['dsv41_restarts_total{cause="rank_exited"}'] == 50
    # The list keeps its last 50: the oldest drops out as a new one comes in.
    trimmed = [*first[1:], {"at": 50.0, "cause": "the rank on w was OOM-killed"}]
    got = scrape(CFG, Observed(now=NOW, rank=RANK, status=status(restarts=trimmed)), counter)
    assert got['dsv41_restarts_total{cause="rank_exited"}'] == 50
    assert got['dsv41_restarts_total{cause="oom_killed"}'] == 1
    assert got['dsv41_restarts_total{cause="endpoint_drift"}'] == 0


def full_scrape() -> dict[str, float]:
    log = "t node=head container=c STOP: MemAvailable below 1 KiB\n"
    st = status(
        last_probe={"at": NOW, "state": "healthy", "seen": "ok"},
        last_verified={"at": NOW, "logprobs": [["a", -0.5]]},
        restarts=[{"at": 1.0, "cause": "the rank on w exited with code 1"}],
    )
    return scrape(CFG, Observed(now=NOW, rank=RANK, status=st, watchdog_log=log))


def test_every_program_series_the_alert_rules_read_is_exported() -> None:
    import re

    from tests.observability.tools import OBSERVABILITY

    used = set(re.findall(r"\bdsv41_[a-z0-9_]+", (OBSERVABILITY / "rules.yml").read_text()))
    exported = {k.split("{", 1)[0] for k in full_scrape()}
    assert used <= exported, f"rules.yml reads series the exporter never writes: {sorted(used - exported)}"


def test_armed_is_zero_only_when_the_head_runs_a_generation_the_supervisor_is_not_armed_for() -> None:
    armed = scrape(CFG, Observed(now=NOW, rank=RANK, status=status(armed_generation="g1")))
    assert armed["dsv41_supervisor_armed{}"] == 1
    stale = scrape(CFG, Observed(now=NOW, rank=RANK, status=status(armed_generation="g0")))
    assert stale["dsv41_supervisor_armed{}"] == 0, "the head runs g1, the supervisor is armed for g0"
    never = scrape(CFG, Observed(now=NOW, rank=RANK, status=status()))
    assert never["dsv41_supervisor_armed{}"] == 0
    no_rank = scrape(CFG, Observed(now=NOW, rank={**RANK, "exists": False, "generation": ""}, status=status()))
    assert no_rank["dsv41_supervisor_armed{}"] == 1, "nothing runs: nothing to be armed for (RankDown says it)"
