"""The gates' and the verifier's decisions replayed over real vLLM's recorded transcripts
(tests/support/fixtures/real-vllm, `make record-real`): what the program decides on hardware is decided on
what vLLM itself printed and answered, at the times it did, not on the stand-in's imitation."""

from __future__ import annotations

import json

import pytest

from components.gates import decisions, log_patterns
from components.gates.observations import GateFailure
from components.verify.verdict import Failed, Reason, Verified, judge_completion, judge_error, judge_stream
from tests.gates.test_decisions import (
    LISTED,
    RANKS,
    FakeClock,
    Probe,
    ScriptedRank,
    ScriptedSource,
    _rdv,
    _ready,
    loading,
)
from tests.support import recorded


def boot() -> dict[int, ScriptedRank]:
    """Both ranks' recorded boot lines at their recorded times."""
    return {
        rank: ScriptedRank(lines=[(ln.t, ln.text) for ln in recorded.log("boot", role)])
        for rank, role in ((0, "head"), (1, "worker"))
    }


def test_the_rendezvous_gate_sees_both_real_ranks_join() -> None:
    clock = FakeClock()
    result = decisions.wait_for_rendezvous(
        RANKS, ScriptedSource(clock, boot()), _rdv(poll_interval_s=1.0), clock, lambda _: None
    )
    joined_at = max(
        ln.t for role in ("head", "worker") for ln in recorded.log("boot", role) if log_patterns.is_join_line(ln.text)
    )
    assert joined_at <= result.elapsed_s <= joined_at + 2.0, result


def test_the_ready_gate_passes_on_real_vllms_boot_with_its_phases() -> None:
    clock = FakeClock()
    ready = decisions.wait_for_ready(
        RANKS,
        ScriptedSource(clock, boot()),
        _ready(poll_interval_s=1.0),
        clock,
        lambda _: None,
        Probe(LISTED),
        "DeepSeek-v4.1-Flash-EXL3",
    )
    startup = next(ln.t for ln in recorded.log("boot", "head") if "Application startup complete" in ln.text)
    assert startup <= ready.elapsed_s <= startup + 2.0
    assert {"rendezvous", "loading weights", "KV cache", "API starting", "ready"} <= set(ready.phases)


def test_a_real_worker_loading_for_15_silent_minutes_is_not_a_stall() -> None:
    # The recorded boot with the worker's load made 15 minutes long (196 GiB over NFS): from its join to its
    # load done the worker prints nothing and the head, waiting on it in the collective KV profile, neither.
    # Its container's memory grows meanwhile, which is what hardware shows too; the default stall_s holds.
    silent = 900.0
    worker_log = recorded.log("boot", "worker")
    joined = next(ln.t for ln in worker_log if log_patterns.is_join_line(ln.text))
    loaded_head = next(ln.t for ln in recorded.log("boot", "head") if "Loading weights took" in ln.text)

    def shifted(role: str, after: float) -> list[tuple[float, str]]:
        return [(ln.t + (silent if ln.t > after else 0.0), ln.text) for ln in recorded.log("boot", role)]

    ranks = {
        0: ScriptedRank(lines=shifted("head", loaded_head)),
        1: ScriptedRank(lines=shifted("worker", joined + 0.01), usage=loading(joined, joined + silent, 96.0)),
    }
    longest = max(b[0] - a[0] for a, b in zip(ranks[1].lines, ranks[1].lines[1:], strict=False))
    assert longest >= silent, "the worker must be silent for the whole load"
    clock = FakeClock()
    ready = decisions.wait_for_ready(
        RANKS,
        ScriptedSource(clock, ranks),
        _ready(stall_s=600.0, ready_timeout_s=3600.0),
        clock,
        lambda _: None,
        Probe(LISTED),
        "DeepSeek-v4.1-Flash-EXL3",
    )
    assert "ready" in ready.phases and ready.elapsed_s > silent


def test_the_same_silence_with_nothing_growing_is_a_stall() -> None:
    silent = 900.0
    joined = next(ln.t for ln in recorded.log("boot", "worker") if log_patterns.is_join_line(ln.text))
    loaded_head = next(ln.t for ln in recorded.log("boot", "head") if "Loading weights took" in ln.text)
    ranks = {
        0: ScriptedRank(
            lines=[(ln.t + (silent if ln.t > loaded_head else 0.0), ln.text) for ln in recorded.log("boot", "head")]
        ),
        1: ScriptedRank(
            lines=[(ln.t + (silent if ln.t > joined + 0.01 else 0.0), ln.text) for ln in recorded.log("boot", "worker")]
        ),
    }
    clock = FakeClock()
    with pytest.raises(GateFailure, match="no rank logged anything new"):
        decisions.wait_for_ready(
            RANKS,
            ScriptedSource(clock, ranks),
            _ready(stall_s=600.0, ready_timeout_s=3600.0),
            clock,
            lambda _: None,
            Probe(LISTED),
            "DeepSeek-v4.1-Flash-EXL3",
        )


def test_the_ready_gate_names_a_head_that_exits_0_after_the_worker_died() -> None:
    # Real vLLM: a worker lost, the head's engine fails and the head exits 0; the gate must call it a dead
    # group and point at the lost rank, with both ranks' last lines.
    ranks = boot()
    head_after = recorded.log("killed-worker", "head")
    end = max(ln.t for ln in recorded.log("boot", "head"))
    stop = recorded.document("killed-worker", "sequence.json")
    ranks[0] = ScriptedRank(
        lines=[(t, x) for t, x in ranks[0].lines if "Application startup" not in x]
        + [(end + 1 + ln.t, ln.text) for ln in head_after if ln.t > 0],
        exits_at=end + 1 + stop["head"]["secondsFromKill"],
        exit_code=stop["head"]["exitCode"],
    )
    ranks[1] = ScriptedRank(lines=ranks[1].lines, exits_at=end + 1, exit_code=stop["worker"]["exitCode"])
    clock = FakeClock()
    with pytest.raises(GateFailure) as failure:
        decisions.wait_for_ready(
            RANKS,
            ScriptedSource(clock, ranks),
            _ready(poll_interval_s=1.0),
            clock,
            lambda _: None,
            Probe(LISTED),
            "DeepSeek-v4.1-Flash-EXL3",
        )
    message = str(failure.value)
    assert "exit code 137" in message or "exit code 0" in message, message
    assert "watchdog" in message and "OOM" in message.upper(), "exit 0 and 137 name both candidates"
    assert "--- rank 0" in message and "--- rank 1" in message, message


@pytest.mark.parametrize("scenario", ["killed-worker", "stopped-worker"])
def test_the_head_s_answer_after_a_lost_worker_is_a_dead_rank(scenario: str) -> None:
    answer = recorded.document(scenario, "sequence.json")["request"]
    verdict = judge_error(answer["status"], json.dumps(answer["body"]))
    assert isinstance(verdict, Failed) and verdict.reason is Reason.DEAD_RANK, verdict


def test_a_streamed_answer_after_a_lost_worker_is_a_dead_rank() -> None:
    for scenario in ("killed-worker", "killed-worker-streamed"):
        path = recorded.FIXTURES / scenario / "sequence.json"
        if not path.exists():
            continue
        answer = recorded.document(scenario, "sequence.json")["streamed"]
        headers = {"content-type": answer["contentType"]}
        if answer["contentType"].startswith("text/event-stream"):
            verdict = judge_stream(answer["status"], headers, [e.removeprefix("data: ") for e in answer["events"]])
        else:
            verdict = judge_completion(answer["status"], headers, "".join(answer["events"]))
        assert isinstance(verdict, Failed) and verdict.reason is Reason.DEAD_RANK, (scenario, verdict)


def test_real_vllms_completion_and_stream_verify() -> None:
    plain = recorded.document("http", "chat-logprobs.json")
    assert isinstance(
        judge_completion(plain["status"], {"content-type": plain["contentType"]}, json.dumps(plain["body"])), Verified
    )
    streamed = recorded.document("http", "chat-stream.json")
    assert isinstance(
        judge_stream(
            streamed["status"],
            {"content-type": streamed["contentType"]},
            [e.removeprefix("data: ") for e in streamed["events"]],
        ),
        Verified,
    )
