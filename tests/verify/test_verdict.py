"""The pure judgement: decode samples, probe prompts, logprob edge cases, vLLM's metrics, the probe request."""

from __future__ import annotations

import pytest

from components.verify.verdict import (
    Failed,
    Reason,
    Verified,
    completion_request,
    decode_sample,
    drift_probe_request,
    engine_steps,
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


def test_engine_steps_reads_vllms_step_histogram_count_over_every_engine() -> None:
    metrics = "\n".join([
        "# TYPE vllm:iteration_tokens_total histogram",
        'vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3.0',
        'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 120.0',
        'vllm:iteration_tokens_total_count{engine="1",model_name="m"} 5.0',
        'vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 9000.0',
        'vllm:generation_tokens_total{engine="0"} 77.0',
    ])
    assert engine_steps(metrics) == 125.0


def test_engine_steps_falls_back_to_the_token_counters_and_is_none_without_either() -> None:
    assert engine_steps('vllm:prompt_tokens_total 10\nvllm:generation_tokens_total{engine="0"} 4\n') == 14.0
    assert engine_steps("# nothing\nprocess_cpu_seconds_total 3.5\n") is None


def test_drift_probe_request_is_the_recipe_request_cut_to_one_token() -> None:
    body = drift_probe_request("m")
    assert body == {**completion_request("m"), "max_tokens": 1}
