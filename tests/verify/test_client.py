"""The client: real HTTP against a loopback fake vLLM, one test per way a deployment can lie."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from components.verify import client as verify
from components.verify.client import (
    Passed,
    VerificationTimeout,
    measure_decode,
    run_bounded,
    verify_endpoint,
)
from components.verify.verdict import (
    DECODE_PROBE_PROMPTS,
    Failed,
    Reason,
    TokenLogprob,
    completion_request,
)
from tests.support.fake_vllm import (
    ENGINE_DEAD_BODY,
    GOOD_TOKENS,
    NAN_STREAM_ERROR,
    FakeVllm,
    Reply,
    chat_body,
    error_body,
    free_port,
    good_items,
    items_with,
    paced_stream,
    reasoning_body,
    reasoning_stream,
    stream_events,
    with_literal,
)

MODEL = "fake-model"
pytestmark = pytest.mark.timeout(10)


# (case id, reply, expected reason, words the diagnosis must contain)
BAD_ANSWERS: list[tuple[str, Reply, Reason, str]] = [
    ("nan-literal", Reply(body=with_literal(chat_body(good_items()), "NaN")), Reason.NAN, "the model produced NaN"),
    ("infinity-literal", Reply(body=with_literal(chat_body(good_items()), "Infinity")), Reason.INF, "Infinity"),
    ("minus-infinity-literal", Reply(body=with_literal(chat_body(good_items()), "-Infinity")), Reason.INF, "inf"),
    ("overflowing-number", Reply(body=with_literal(chat_body(good_items()), "-1e999")), Reason.INF, "inf"),
    ("null-logprob", Reply(body=chat_body(items_with(None)).encode()), Reason.NAN, "null"),
    ("clamped-minus-9999", Reply(body=chat_body(items_with(-9999.0)).encode()), Reason.INF, "-9999.0"),
    ("string-logprob", Reply(body=chat_body(items_with("-0.5")).encode()), Reason.BAD_LOGPROB, "not a number"),
    ("bool-logprob", Reply(body=chat_body(items_with(False)).encode()), Reason.BAD_LOGPROB, "not a number"),
    ("positive-logprob", Reply(body=chat_body(items_with(0.25)).encode()), Reason.BAD_LOGPROB, "> 0"),
    ("missing-logprobs", Reply(body=chat_body(None).encode()), Reason.NO_LOGPROBS, "logprobs"),
    ("empty-content", Reply(body=chat_body([]).encode()), Reason.NO_LOGPROBS, "empty"),
    (
        "top-logprob-not-sampled-token",
        Reply(body=chat_body([{**good_items()[0], "top_logprobs": [{"token": "Lyon", "logprob": -0.1}]}]).encode()),
        Reason.BAD_LOGPROB,
        "not the sampled token",
    ),
    (
        "http-400-out-of-range",
        Reply(status=400, body=error_body(NAN_STREAM_ERROR, "BadRequestError", 400)),
        Reason.NAN,
        "the model produced NaN",
    ),
    (
        "http-500-out-of-range",
        Reply(status=500, body=b'{"detail":"ValueError: Out of range float values are not JSON compliant"}'),
        Reason.NAN,
        "the model produced NaN",
    ),
    (
        "non-json",
        Reply(body=b"<html><body>Welcome to nginx!</body></html>", content_type="text/html"),
        Reason.NOT_JSON,
        "not JSON",
    ),
    (
        "unknown-model",
        Reply(
            status=404,
            body=error_body("The model `x` does not exist.", "NotFoundError", 404, "model"),
        ),
        Reason.UNKNOWN_MODEL,
        "served: fake-model",
    ),
    (
        # real vLLM 0.32 after a worker of the group was killed (shared/notes/vllm-real.md), byte for byte
        "engine-dead-500",
        Reply(status=500, body=ENGINE_DEAD_BODY),
        Reason.DEAD_RANK,
        "a rank of the group died",
    ),
    ("unauthorized", Reply(status=401, body=b'{"error":"Unauthorized"}'), Reason.UNAUTHORIZED, "API key"),
    ("wrong-route", Reply(status=404, body=b'{"detail":"Not Found"}'), Reason.HTTP_ERROR, "ending in /v1"),
]


def test_good_answer_passes_with_answer_and_logprobs() -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2)
    assert isinstance(outcome, Passed), outcome
    assert outcome.answer == "Paris."
    assert outcome.logprobs == tuple(TokenLogprob(token, value) for token, value in GOOD_TOKENS)
    assert 0 <= outcome.latency_s < 2
    assert outcome.decode_tokens_per_second is None


@pytest.mark.parametrize(("case", "reply", "reason", "words"), BAD_ANSWERS, ids=[case[0] for case in BAD_ANSWERS])
def test_bad_answer_fails_with_its_reason_and_is_never_retried(
    case: str, reply: Reply, reason: Reason, words: str
) -> None:
    sleeps: list[float] = []
    with FakeVllm(reply) as server:
        # A generous retry window: a retried verdict would show as a second request.
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2, retry_window_s=30, sleep=sleeps.append)
        completions = server.completion_requests()
    assert isinstance(outcome, Failed), f"{case} must not verify"
    assert outcome.reason is reason, outcome.message
    assert words in outcome.message
    assert "\n" not in outcome.message
    assert server.url in outcome.message and MODEL in outcome.message
    assert len(completions) == 1 and sleeps == [], f"{case} is final and must not be retried"


def test_the_streamed_engine_dead_error_names_a_dead_rank() -> None:
    # Real vLLM 0.32 streams HTTP 200, the error object in a data event, then [DONE].
    events = [(0.0, ENGINE_DEAD_BODY.decode()), (0.0, "[DONE]")]
    with FakeVllm(Reply(events=events)) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2, retry_window_s=30, stream=True, sleep=lambda _: None)
        assert len(server.completion_requests()) == 1, "a dead engine is final, never retried"
    assert isinstance(outcome, Failed) and outcome.reason is Reason.DEAD_RANK, outcome
    assert "a rank of the group died" in outcome.message and "docker logs" in outcome.message


def test_nan_is_never_retried() -> None:
    reply = Reply(status=400, body=error_body(NAN_STREAM_ERROR, "BadRequestError", 400))
    with FakeVllm(reply) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2, retry_window_s=3)
        assert len(server.completion_requests()) == 1
    assert isinstance(outcome, Failed) and outcome.reason is Reason.NAN
    assert "the model produced NaN" in outcome.message


def test_request_is_the_recipe_request_with_bearer_key() -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as server:
        assert isinstance(verify_endpoint(server.url + "/", MODEL, "k-123", timeout_s=2), Passed)
        assert isinstance(verify_endpoint(server.url, MODEL, timeout_s=2), Passed)
        keyed, anonymous = server.completion_requests()
    assert keyed.path == "/v1/chat/completions"
    assert keyed.body == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    assert keyed.headers["Authorization"] == "Bearer k-123"
    assert "Authorization" not in anonymous.headers


def test_streamed_request_asks_for_usage() -> None:
    assert completion_request(MODEL, stream=True) == {
        **completion_request(MODEL),
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_api_key_never_appears_in_a_diagnosis() -> None:
    echo = Reply(status=403, body=error_body("key k-secret-9 is not allowed here", "PermissionError", 403))
    with FakeVllm(echo) as server:
        outcome = verify_endpoint(server.url, MODEL, "k-secret-9", timeout_s=2)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.HTTP_ERROR
    assert "k-secret-9" not in outcome.message and "***" in outcome.message


def test_endpoint_must_end_in_v1() -> None:
    with pytest.raises(ValueError, match="http://HOST:PORT/v1"):
        verify_endpoint("http://127.0.0.1:9/", MODEL)


# --- streamed answers (NaN arrives as null with HTTP 200) --------------------------------------

STREAMED: list[tuple[str, Reply, Reason | None]] = [
    ("good", Reply(events=stream_events(good_items())), None),
    ("null-is-nan", Reply(events=stream_events(items_with(None))), Reason.NAN),
    (
        "nan-literal",
        Reply(events=[(0, p.replace("-0.3817", "NaN")) for _, p in stream_events(good_items())]),
        Reason.NAN,
    ),
    (
        "infinity-literal",
        Reply(events=[(0, p.replace("-0.3817", "-Infinity")) for _, p in stream_events(good_items())]),
        Reason.INF,
    ),
    ("clamped-minus-9999", Reply(events=stream_events(items_with(-9999.0))), Reason.INF),
    ("string-logprob", Reply(events=stream_events(items_with("nan"))), Reason.BAD_LOGPROB),
    (
        "missing-logprobs",
        Reply(
            events=[(0, p.replace('"logprobs": {"content"', '"x": {"content"')) for _, p in stream_events(good_items())]
        ),
        Reason.NO_LOGPROBS,
    ),
    ("empty-content", Reply(events=stream_events([])), Reason.NO_LOGPROBS),
    (
        "error-event",
        Reply(
            events=[stream_events(good_items())[0], (0, error_body(NAN_STREAM_ERROR, "BadRequestError", 400).decode())]
        ),
        Reason.NAN,
    ),
    ("cut-off-before-done", Reply(events=stream_events(good_items())[:-1]), Reason.MALFORMED),
    ("non-json-event", Reply(events=[(0, "hello"), (0, "[DONE]")]), Reason.NOT_JSON),
    ("http-400-out-of-range", Reply(status=400, body=error_body(NAN_STREAM_ERROR, "BadRequestError", 400)), Reason.NAN),
    (
        "unknown-model",
        Reply(status=404, body=error_body("The model `x` does not exist.", "NotFoundError", 404, "model")),
        Reason.UNKNOWN_MODEL,
    ),
]


@pytest.mark.parametrize(("case", "reply", "reason"), STREAMED, ids=[case[0] for case in STREAMED])
def test_streamed_answer_verdict(case: str, reply: Reply, reason: Reason | None) -> None:
    with FakeVllm(reply) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2, retry_window_s=30, stream=True, sleep=lambda _: None)
        (request,) = server.completion_requests()
    assert request.body == completion_request(MODEL, stream=True)
    if reason is None:
        assert isinstance(outcome, Passed), outcome
        assert outcome.answer == "Paris." and [t.token for t in outcome.logprobs] == ["Paris", "."]
    else:
        assert isinstance(outcome, Failed), f"streamed {case} must not verify"
        assert outcome.reason is reason, outcome.message


# --- time: hung ranks, trickles, and starting servers -----------------------------------------


@pytest.mark.parametrize(("health", "reason"), [(200, Reason.HUNG_RANK), (503, Reason.TIMEOUT)])
def test_completion_that_never_returns_is_diagnosed_within_the_deadline(health: int, reason: Reason) -> None:
    with FakeVllm(Reply(hang_s=30), health_status=health) as server:
        started = time.monotonic()
        outcome = verify_endpoint(server.url, MODEL, timeout_s=1, retry_window_s=30)
        elapsed = time.monotonic() - started
        completions = len(server.completion_requests())
    assert isinstance(outcome, Failed) and outcome.reason is reason, outcome
    assert 1 <= elapsed < 3, f"verdict took {elapsed:.2f} s for a 1 s timeout"
    assert completions == 1, "a timeout is diagnosed, not retried"
    if reason is Reason.HUNG_RANK:
        assert "a rank is dead or hung" in outcome.message
        assert "/health answers 200 but a completion did not return within 1 s" in outcome.message


def test_trickling_stream_is_cut_at_the_total_deadline() -> None:
    # Each event arrives well within the timeout, but the whole answer would take 6 s.
    trickle = [(0.3, p) for _, p in stream_events(good_items() * 10)]
    with FakeVllm(Reply(events=trickle)) as server:
        started = time.monotonic()
        outcome = verify_endpoint(server.url, MODEL, timeout_s=1, stream=True)
        elapsed = time.monotonic() - started
    assert isinstance(outcome, Failed) and outcome.reason is Reason.HUNG_RANK
    assert elapsed < 2.5


def test_connection_refused_is_retried_until_the_server_comes_up() -> None:
    port = free_port()
    server = FakeVllm(Reply(body=chat_body(good_items()).encode()), port=port)
    progress: list[str] = []

    def sleep_then_start(seconds: float) -> None:
        if not progress[1:]:  # bring the API up during the second pause
            time.sleep(seconds)
        else:
            server.start()
            time.sleep(0.05)

    try:
        outcome = verify_endpoint(
            f"http://127.0.0.1:{port}/v1",
            MODEL,
            timeout_s=1,
            retry_window_s=4,
            sleep=sleep_then_start,
            on_progress=progress.append,
        )
        assert len(server.completion_requests()) == 1
    finally:
        server.stop()
    assert isinstance(outcome, Passed), outcome
    assert len(progress) == 2 and all("connection refused" in line for line in progress)


def test_connection_refused_gives_up_when_the_retry_window_is_spent() -> None:
    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    port = free_port()
    outcome = verify_endpoint(
        f"http://127.0.0.1:{port}/v1", MODEL, timeout_s=1, retry_window_s=30, clock=lambda: now[0], sleep=sleep
    )
    assert isinstance(outcome, Failed) and outcome.reason is Reason.UNREACHABLE
    assert "not ready for 30 s" in outcome.message and "connection refused" in outcome.message
    assert sum(sleeps) == pytest.approx(30)
    assert max(sleeps) <= verify.MAX_RETRY_PAUSE_S
    assert sleeps[:3] == [1, 2, 4], "backs off instead of hammering a loading server"


def test_503_is_retried_then_verifies() -> None:
    answers = iter(
        [Reply(status=503, body=b'{"detail":"loading"}')] * 2 + [Reply(body=chat_body(good_items()).encode())]
    )
    with FakeVllm(lambda _body: next(answers)) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2, retry_window_s=30, sleep=lambda _: None)
        assert len(server.completion_requests()) == 3
    assert isinstance(outcome, Passed)


def test_run_bounded_gives_up_at_its_deadline() -> None:
    started = time.monotonic()
    with pytest.raises(VerificationTimeout, match="did not finish within its 0.2 s deadline"):
        run_bounded(lambda: time.sleep(3), 0.2, "the test's work")
    assert time.monotonic() - started < 1
    assert run_bounded(lambda: 7, 1, "quick work") == 7
    with pytest.raises(KeyError):
        run_bounded(lambda: {}["missing"], 1, "failing work")


# --- decode probe -------------------------------------------------------------------------------

PROBE_PROMPTS = DECODE_PROBE_PROMPTS[:3]


def test_decode_probe_measures_a_paced_stream_within_15_percent() -> None:
    with FakeVllm(Reply(events=paced_stream(30, 40.0))) as server:
        measured = measure_decode(server.url, MODEL, timeout_s=3, prompts=PROBE_PROMPTS)
        prompts = [r.body["messages"][0]["content"] for r in server.completion_requests()]
        streamed = [r.body["stream"] and r.body["stream_options"] for r in server.completion_requests()]
    assert not isinstance(measured, Failed), measured
    assert measured.median_tokens_per_second == pytest.approx(40.0, rel=0.15)
    assert len(measured.per_prompt) == 3
    assert prompts == list(PROBE_PROMPTS), "each prompt is sent once, in order"
    assert streamed == [{"include_usage": True}] * 3


def test_decode_probe_counts_chunks_when_usage_is_missing() -> None:
    with FakeVllm(Reply(events=paced_stream(12, 50.0, with_usage=False))) as server:
        measured = measure_decode(server.url, MODEL, timeout_s=3, prompts=PROBE_PROMPTS)
    assert not isinstance(measured, Failed), measured
    assert measured.median_tokens_per_second == pytest.approx(50.0, rel=0.2)


def test_probe_prompts_are_varied_and_not_counting() -> None:
    assert len(set(DECODE_PROBE_PROMPTS)) == len(DECODE_PROBE_PROMPTS) >= 3
    assert not any("count" in prompt.lower() or "repeat" in prompt.lower() for prompt in DECODE_PROBE_PROMPTS)
    with pytest.raises(ValueError, match="at least 3 prompts"):
        measure_decode("http://127.0.0.1:9/v1", MODEL, prompts=PROBE_PROMPTS[:2])


def test_decode_below_threshold_fails_naming_measured_required_and_eager_mode() -> None:
    def script(body: dict[str, Any]) -> Reply:
        if body.get("logprobs"):
            return Reply(body=chat_body(good_items()).encode())
        return Reply(events=paced_stream(10, 40.0))

    with FakeVllm(script) as server:
        outcome = verify_endpoint(
            server.url, MODEL, timeout_s=3, min_decode_tokens_per_second=80, decode_prompts=PROBE_PROMPTS
        )
        assert len(server.completion_requests()) == 4  # the recipe request, then the 3 probe prompts
    assert isinstance(outcome, Failed) and outcome.reason is Reason.SLOW_DECODE, outcome
    assert "below the required 80 tok/s" in outcome.message
    assert "11-13 tok/s is eager mode" in outcome.message
    rate = float(outcome.message.split("decode speed ")[1].split(" tok/s")[0])
    assert rate == pytest.approx(40.0, rel=0.2)


def test_decode_above_threshold_passes_with_the_rate() -> None:
    def script(body: dict[str, Any]) -> Reply:
        if body.get("logprobs"):
            return Reply(body=chat_body(good_items()).encode())
        return Reply(events=paced_stream(10, 40.0))

    with FakeVllm(script) as server:
        outcome = verify_endpoint(
            server.url, MODEL, timeout_s=3, min_decode_tokens_per_second=20, decode_prompts=PROBE_PROMPTS
        )
    assert isinstance(outcome, Passed), outcome
    assert outcome.decode_tokens_per_second == pytest.approx(40.0, rel=0.2)


# --- issue 10: the answer must say Paris; a slow first request is a warm-up ------------------------


def _answer(content: str | None, reasoning: str | None = None) -> Reply:
    body = json.loads(chat_body(good_items(), content=content))
    body["choices"][0]["message"]["reasoning_content"] = reasoning
    return Reply(body=json.dumps(body).encode())


def test_fluent_wrong_answer_with_finite_logprobs_fails_naming_the_answer() -> None:
    with FakeVllm(_answer("Lyon.")) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.WRONG_ANSWER
    assert "'Lyon.'" in outcome.message and "does not say Paris" in outcome.message


@pytest.mark.parametrize(
    ("content", "reasoning"),
    [
        ("PARIS", None),
        ("The capital of France is paris.", None),
        ("<think>Lyon? No, the capital is...</think>Paris", None),
        ("Paris", "Is it Lyon or Marseille? The capital is Paris."),
        (None, "The user asks for the capital of France, which is Paris, so"),  # reasoning took the budget
    ],
)
def test_the_answer_says_paris_in_any_case_reasoning_aside(content: str | None, reasoning: str | None) -> None:
    with FakeVllm(_answer(content, reasoning)) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2)
    assert isinstance(outcome, Passed), outcome


def test_paris_in_the_reasoning_does_not_save_a_wrong_answer() -> None:
    with FakeVllm(_answer("<think>Paris is the capital... but</think>Lyon", "Paris, surely")) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.WRONG_ANSWER and "'Lyon'" in outcome.message


def test_the_expected_answer_is_the_stacks_setting() -> None:
    # gates.expectedAnswer: a model that answers another word passes when the stack expects it, and the
    # recipe's word is then refused like any other wrong answer.
    with FakeVllm(_answer("Lyon.")) as server:
        assert isinstance(verify_endpoint(server.url, MODEL, timeout_s=2, expected_answer="Lyon"), Passed)
    with FakeVllm(_answer("Paris")) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2, expected_answer="Lyon")
    assert isinstance(outcome, Failed) and outcome.reason is Reason.WRONG_ANSWER
    assert "does not say Lyon" in outcome.message


def test_an_empty_expected_answer_judges_the_logprobs_alone() -> None:
    # The sim's random-weight model answers bytes of nonsense: with no expected answer, finite logprobs pass
    # and a NaN still fails.
    with FakeVllm(_answer("\ufffd`i`i`")) as server:
        assert isinstance(verify_endpoint(server.url, MODEL, timeout_s=2, expected_answer=""), Passed)
    body = json.loads(chat_body(good_items(), content="x"))
    body["choices"][0]["logprobs"]["content"][0]["logprob"] = None
    with FakeVllm(Reply(body=json.dumps(body).encode())) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2, expected_answer="")
    assert isinstance(outcome, Failed) and outcome.reason is not Reason.WRONG_ANSWER


def test_a_partial_word_is_not_the_expected_answer() -> None:
    with FakeVllm(_answer("Parisian")) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.WRONG_ANSWER


# The recipe's thinking default against vLLM 0.32's own shape: `reasoning` in the message and in stream deltas,
# `content` null while the reasoning runs, logprobs over the reasoning tokens too.
WEIGHING = ["The", " user", " asks", " for", " a", " capital", ".", " Lyon", " is", " large", ",", " but"]
SAYS_PARIS = ["The", " capital", " of", " France", " is", " Paris", ",", " so"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_only_in_the_reasoning_is_judged_on_the_reasoning(stream: bool) -> None:
    def reply(reasoning: list[str]) -> Reply:
        if stream:
            return Reply(events=reasoning_stream(reasoning, []))
        return Reply(body=reasoning_body(reasoning, []).encode())

    with FakeVllm(reply(SAYS_PARIS)) as server:
        passed = verify_endpoint(server.url, MODEL, timeout_s=2, stream=stream)
    assert isinstance(passed, Passed), passed
    assert passed.answer == "" and len(passed.logprobs) == len(SAYS_PARIS), "the answer itself was empty"
    with FakeVllm(reply(WEIGHING)) as server:
        failed = verify_endpoint(server.url, MODEL, timeout_s=2, stream=stream)
    assert isinstance(failed, Failed) and failed.reason is Reason.WRONG_ANSWER, failed
    assert "the reasoning (the answer itself was empty)" in failed.message and "Lyon is large" in failed.message


@pytest.mark.parametrize("stream", [False, True])
def test_with_reasoning_done_the_answer_is_judged_not_the_reasoning(stream: bool) -> None:
    def reply(reasoning: list[str], answer: list[str]) -> Reply:
        if stream:
            return Reply(events=reasoning_stream(reasoning, answer))
        return Reply(body=reasoning_body(reasoning, answer).encode())

    with FakeVllm(reply(WEIGHING, ["Paris", "."])) as server:
        passed = verify_endpoint(server.url, MODEL, timeout_s=2, stream=stream)
    assert isinstance(passed, Passed) and passed.answer == "Paris.", passed
    with FakeVllm(reply(SAYS_PARIS, ["Lyon"])) as server:
        failed = verify_endpoint(server.url, MODEL, timeout_s=2, stream=stream)
    assert isinstance(failed, Failed) and "the answer to" in failed.message and "'Lyon'" in failed.message


def test_streamed_wrong_answer_fails_too() -> None:
    events = [(0.0, p.replace('"Paris"', '"Lyon"')) for _, p in stream_events(good_items())]
    with FakeVllm(Reply(events=events)) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=2, stream=True)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.WRONG_ANSWER


@pytest.mark.timeout(20)
def test_slow_first_request_is_a_warm_up_and_the_next_answer_is_judged() -> None:
    replies = iter([Reply(body=chat_body(good_items()).encode(), hang_s=2.5), _answer("Paris.")])
    progress: list[str] = []
    with FakeVllm(lambda _body: next(replies)) as server:
        started = time.monotonic()
        outcome = verify_endpoint(
            server.url, MODEL, timeout_s=1, retry_window_s=5, warmup_timeout_s=5, on_progress=progress.append
        )
        elapsed = time.monotonic() - started
        assert len(server.completion_requests()) == 2
    assert isinstance(outcome, Passed), outcome
    assert outcome.latency_s < 1, "the judged request is the second, after the warm-up"
    assert 2.5 <= elapsed < 5 and any("warm-up request answered" in line for line in progress)


@pytest.mark.timeout(20)
def test_without_warm_up_the_same_slow_first_request_fails_at_the_request_timeout() -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode(), hang_s=2.5)) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=1, retry_window_s=5)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.HUNG_RANK


@pytest.mark.timeout(20)
def test_warm_up_that_never_answers_fails_at_the_warm_up_bound() -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode(), hang_s=30)) as server:
        started = time.monotonic()
        outcome = verify_endpoint(server.url, MODEL, timeout_s=1, retry_window_s=2, warmup_timeout_s=2)
        elapsed = time.monotonic() - started
    assert isinstance(outcome, Failed) and outcome.reason is Reason.HUNG_RANK and "within 2 s" in outcome.message
    assert elapsed < 4


def test_a_nan_warm_up_fails_at_once_without_a_second_request() -> None:
    with FakeVllm(Reply(body=chat_body(items_with(None)).encode())) as server:
        outcome = verify_endpoint(server.url, MODEL, timeout_s=1, warmup_timeout_s=5)
        assert len(server.completion_requests()) == 1
    assert isinstance(outcome, Failed) and outcome.reason is Reason.NAN
