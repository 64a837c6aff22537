"""The pure judgement: decode samples, probe prompts, logprob edge cases, vLLM's metrics, the probe request."""

from __future__ import annotations

import pytest

from components.verify.verdict import (
    EngineActivity,
    Failed,
    Reason,
    Verified,
    completion_request,
    decode_sample,
    drift_probe_request,
    engine_activity,
    engine_busy,
    judge_completion,
)
from tests.support.fake_vllm import (
    chat_body,
    logprob_item,
    stream_events,
)

pytestmark = pytest.mark.timeout(10)


def test_decode_sample_uses_usage_when_speculation_packs_tokens_into_chunks() -> None:
    events = [
        (at, p)
        for at, (_, p) in zip(
            [0.0, 1.0, 1.5, 2.0, 2.0, 2.0],
            stream_events([{"token": "a"}, {"token": "b"}, {"token": "c"}], completion_tokens=9),
            strict=True,
        )
    ]
    sample = decode_sample(events)
    assert not isinstance(sample, Failed)
    # 9 tokens in 3 chunks between t=1.0 and t=2.0: 8 tokens after the first in 1 s
    assert sample.tokens_per_second == pytest.approx(8.0)


def test_decode_sample_needs_two_timed_tokens() -> None:
    sample = decode_sample([(0.0, p) for _, p in stream_events([{"token": "a"}])])
    assert isinstance(sample, Failed) and sample.reason is Reason.UNMEASURABLE


# --- pure judgement edge cases ------------------------------------------------------------------


def test_zero_and_integer_logprobs_are_real() -> None:
    verdict = judge_completion(200, {}, chat_body([logprob_item("Paris", 0), logprob_item(".", -0.0)]))
    assert isinstance(verdict, Verified) and [t.logprob for t in verdict.logprobs] == [0.0, -0.0]


def test_engine_activity_reads_vllms_step_histogram_count_over_every_engine() -> None:
    metrics = "\n".join(
        [
            "# TYPE vllm:iteration_tokens_total histogram",
            'vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3.0',
            'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 120.0',
            'vllm:iteration_tokens_total_count{engine="1",model_name="m"} 5.0',
            'vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 9000.0',
            'vllm:generation_tokens_total{engine="0"} 77.0',
        ]
    )
    activity = engine_activity(metrics)
    assert activity is not None and activity.steps == 125.0 and activity.tokens == 77.0


def test_engine_activity_reads_the_token_counters_and_is_none_without_vllms_series() -> None:
    activity = engine_activity('vllm:prompt_tokens_total 10\nvllm:generation_tokens_total{engine="0"} 4\n')
    assert activity is not None and activity.tokens == 14.0 and activity.steps is None
    assert engine_activity("# nothing\nprocess_cpu_seconds_total 3.5\n") is None


# Real vLLM 0.32 during a long partial prefill: no step with output, so the counters stand still, while the KV
# cache fills and the requests run (shared/notes/vllm-real.md, "Metrics").
PREFILL = (
    'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} 40.0\n'
    'vllm:prompt_tokens_total{{engine="0",model_name="m"}} 120.0\n'
    'vllm:generation_tokens_total{{engine="0",model_name="m"}} 33.0\n'
    'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n'
    'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
)


def _activity(kv: float, running: int) -> EngineActivity:
    activity = engine_activity(PREFILL.format(kv=kv, running=running))
    assert activity is not None
    return activity


def test_a_partial_prefill_is_busy_by_its_kv_cache_or_its_running_requests() -> None:
    both = engine_busy(_activity(0.41, 2), _activity(0.42, 2))
    assert both == "KV cache usage 41.00% -> 42.00%, 2 request(s) running"
    assert engine_busy(_activity(0.42, 1), _activity(0.42, 1)) == "1 request(s) running"
    assert engine_busy(_activity(0.41, 0), _activity(0.42, 0)) == "KV cache usage 41.00% -> 42.00%"


def test_an_idle_engine_with_frozen_counters_is_not_busy() -> None:
    assert engine_busy(_activity(0.0, 0), _activity(0.0, 0)) is None


def test_drift_probe_request_is_the_recipe_request_cut_to_one_token() -> None:
    body = drift_probe_request("m")
    assert body == {**completion_request("m"), "max_tokens": 1}
