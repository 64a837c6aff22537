"""Does a vLLM chat completion prove the model computes real numbers? Pure judgement, no I/O.

A deployment that emits NaN still reports plausible throughput, so the pass condition is a
real log-probability for every generated token (recipe step 5). vLLM shows a broken model in
several shapes, each handled here:
- non-streamed NaN: HTTP 400 (0.33) or 500 (older) "Out of range float values are not JSON compliant";
- streamed NaN/inf: `null` in an HTTP 200 chunk (pydantic writes non-finite floats as null);
- -inf: clamped to -9999.0, which is also the filler for a missing entry;
- other servers and proxies may write the bare literals NaN / Infinity, which Python's json
  module would silently accept as floats, so they are parsed into a marker and diagnosed.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

VERIFY_PROMPT = "What is the capital of France? Answer in one word."
VERIFY_MAX_TOKENS = 40
# The recipe's question has one right answer.
# The recipe's expected answer; `gates.expectedAnswer` sets what the verifier asks for.
VERIFY_EXPECTED = "Paris"
# Where a reasoning parser puts the reasoning, in the message and in stream deltas: `reasoning` (vLLM 0.32's
# ChatMessage and DeltaMessage; 0.32 renames a `reasoning_content` it is given), `reasoning_content` (older vLLM).
REASONING_KEYS = ("reasoning", "reasoning_content")
# Reasoning a server left inline (no reasoning parser): <think>...</think>, or cut off unterminated.
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.IGNORECASE | re.DOTALL)

# vLLM's EngineDeadError (v1/engine/exceptions.py): every request after its engine died, non-streamed as HTTP 500,
# streamed as an error event in an HTTP 200 stream. In a group, the engine dies when a rank does.
ENGINE_DEAD = "EngineCore encountered an issue"

# vLLM's stand-in for -inf and for a position without a logprob entry: never a real value.
CLAMPED_LOGPROB = -9999.0

# Varied, realistic prompts: repetitive or counting prompts let a speculative drafter accept
# nearly every token and inflate the measured rate.
DECODE_PROBE_PROMPTS: tuple[str, ...] = (
    "Explain in one short paragraph why the sky looks blue at noon and red at sunset.",
    "Write a brief, polite email asking a colleague to move Thursday's design review to Friday "
    "morning, and give one reason.",
    "Summarize the main causes of the French Revolution in four sentences.",
    "Describe how a hash table deals with collisions, using a small example in plain words.",
    "Give three practical tips for keeping a sourdough starter healthy and explain each briefly.",
)
DECODE_PROBE_MAX_TOKENS = 128


class Reason(StrEnum):
    """Why a verification failed; stable strings the CLI and tests can match on."""

    NAN = "nan"
    INF = "inf"
    BAD_LOGPROB = "bad_logprob"
    NO_LOGPROBS = "no_logprobs"
    NOT_JSON = "not_json"
    MALFORMED = "malformed"
    UNKNOWN_MODEL = "unknown_model"
    UNAUTHORIZED = "unauthorized"
    NOT_READY = "not_ready"
    HTTP_ERROR = "http_error"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    HUNG_RANK = "hung_rank"
    DEAD_RANK = "dead_rank"
    SLOW_DECODE = "slow_decode"
    UNMEASURABLE = "unmeasurable"
    WRONG_ANSWER = "wrong_answer"


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float


@dataclass(frozen=True)
class Verified:
    """The completion carried a real, finite log-probability for every generated token."""

    answer: str
    logprobs: tuple[TokenLogprob, ...]
    # What a reasoning parser split off (`reasoning`, or the older `reasoning_content`), if any.
    reasoning: str = ""


@dataclass(frozen=True)
class Failed:
    """A verification failure: a category and a one-line diagnosis."""

    reason: Reason
    message: str


Verdict = Verified | Failed


@dataclass(frozen=True)
class NonFiniteLiteral:
    """A bare NaN / Infinity / -Infinity in a JSON body (not valid JSON, but Python accepts it)."""

    text: str


def parse_json(text: str) -> Any:
    """json.loads that keeps NaN/Infinity literals visible instead of turning them into floats."""
    return json.loads(text, parse_constant=NonFiniteLiteral)


def completion_request(model: str, *, stream: bool = False) -> dict[str, Any]:
    """The recipe's verification request, exactly; the streamed form adds usage to the last chunk."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": VERIFY_PROMPT}],
        "max_tokens": VERIFY_MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def drift_probe_request(model: str) -> dict[str, Any]:
    """The recipe's request cut to one token: enough to prove every rank still computes real numbers."""
    return {**completion_request(model), "max_tokens": 1}


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class EngineActivity:
    """What vLLM's `/metrics` says about its engine's work, summed over every engine (`engine` label)."""

    steps: float | None
    """`vllm:iteration_tokens_total_count`: the step-size histogram's count, one per engine step with output."""
    tokens: float | None
    """`vllm:prompt_tokens_total` + `vllm:generation_tokens_total`."""
    kv_cache_usage: float | None
    """`vllm:kv_cache_usage_perc` (a fraction), reported after every step, partial prefills included."""
    running: float | None
    """`vllm:num_requests_running`."""


def engine_activity(metrics: str) -> EngineActivity | None:
    """vLLM's engine from `/metrics`, or None when the text has none of its series (not vLLM's metrics)."""
    found: dict[str, float] = {}
    for line in metrics.splitlines():
        m = _METRIC_LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        name = m.group(1)
        key = {
            "vllm:iteration_tokens_total_count": "steps",
            "vllm:prompt_tokens_total": "tokens",
            "vllm:generation_tokens_total": "tokens",
            "vllm:kv_cache_usage_perc": "kv",
            "vllm:num_requests_running": "running",
        }.get(name)
        if key is not None:
            found[key] = found.get(key, 0.0) + value
    if not found:
        return None
    return EngineActivity(
        steps=found.get("steps"),
        tokens=found.get("tokens"),
        kv_cache_usage=found.get("kv"),
        running=found.get("running"),
    )


def engine_busy(first: EngineActivity, second: EngineActivity) -> str | None:
    """Why the engine counts as busy between two reads a moment apart, or None when nothing says so.

    Busy: a step or token counter moved, the KV cache usage changed, or a request is running. vLLM records
    iteration stats only for steps with output, so a long partial prefill freezes every counter while the KV
    usage grows and `num_requests_running` stays above 0. The scheduler's gauges are reported after each step,
    so a step that never ends (a hang inside it) leaves `num_requests_running` standing above 0 too: that looks
    busy until vLLM's own execute-model timeout ends the engine, which the next probe then finds.
    """
    seen: list[str] = []
    for what, a, b in (("engine steps", first.steps, second.steps), ("tokens", first.tokens, second.tokens)):
        if a is not None and b is not None and b > a:
            seen.append(f"{what} {a:g} -> {b:g}")
    a_kv, b_kv = first.kv_cache_usage, second.kv_cache_usage
    if a_kv is not None and b_kv is not None and a_kv != b_kv:
        seen.append(f"KV cache usage {a_kv:.2%} -> {b_kv:.2%}")
    if second.running is not None and second.running > 0:
        seen.append(f"{second.running:g} request(s) running")
    return ", ".join(seen) or None


def decode_probe_request(model: str, prompt: str, max_tokens: int = DECODE_PROBE_MAX_TOKENS) -> dict[str, Any]:
    """A streamed request for measuring decode speed; sampling is left to the server's defaults."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _snippet(text: str, limit: int = 160) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 3] + "..."


_NAN_FIX = "the deployment is computing garbage; check that every rank is healthy and the weights and kernels match"


def _check_logprob(value: Any, where: str) -> Failed | None:
    """None when `value` is a real log-probability, else the diagnosis."""
    if value is None:
        return Failed(
            Reason.NAN,
            f"the model produced NaN or inf: logprob of {where} is null (vLLM writes non-finite "
            f"floats as null); {_NAN_FIX}",
        )
    if isinstance(value, NonFiniteLiteral):
        if value.text == "NaN":
            return Failed(Reason.NAN, f"the model produced NaN: logprob of {where} is the literal NaN; {_NAN_FIX}")
        return Failed(Reason.INF, f"the model produced inf: logprob of {where} is the literal {value.text}; {_NAN_FIX}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return Failed(
            Reason.BAD_LOGPROB,
            f"logprob of {where} is {_snippet(repr(value), 40)} ({type(value).__name__}), not a number; "
            "the server is not returning vLLM's logprobs",
        )
    number = float(value)
    if math.isnan(number):
        return Failed(Reason.NAN, f"the model produced NaN: logprob of {where} is NaN; {_NAN_FIX}")
    if math.isinf(number):
        return Failed(Reason.INF, f"the model produced inf: logprob of {where} is {number}; {_NAN_FIX}")
    if number <= CLAMPED_LOGPROB:
        return Failed(
            Reason.INF,
            f"logprob of {where} is {number}, vLLM's clamp for -inf or a missing entry, not a real "
            f"probability; {_NAN_FIX}",
        )
    if number > 0:
        return Failed(
            Reason.BAD_LOGPROB,
            f"logprob of {where} is {number} > 0, impossible for a log-probability; run vLLM with the "
            "default --logprobs-mode raw_logprobs",
        )
    return None


def judge_tokens(items: Sequence[Any]) -> tuple[TokenLogprob, ...] | Failed:
    """Check `choices[0].logprobs.content`: every token must carry a real log-probability."""
    if not items:
        return Failed(
            Reason.NO_LOGPROBS,
            "logprobs.content is empty: no token carries a log-probability, so nothing proves the model computes",
        )
    checked: list[TokenLogprob] = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping) or not isinstance(item.get("token"), str):
            return Failed(
                Reason.MALFORMED,
                f"logprobs.content[{index}] is {_snippet(repr(item), 60)}, not a {{token, logprob}} object",
            )
        token: str = item["token"]
        where = f"token {index} ({_snippet(repr(token), 30)})"
        problem = _check_logprob(item.get("logprob"), where)
        if problem is not None:
            return problem
        top = item.get("top_logprobs")
        if isinstance(top, list) and top:
            first = top[0]
            top_token = first.get("token") if isinstance(first, Mapping) else None
            if top_token != token:
                return Failed(
                    Reason.BAD_LOGPROB,
                    f"top_logprobs[0] of {where} is {_snippet(repr(top_token), 30)}, not the sampled token; "
                    "vLLM lists the sampled token first, so these logprobs are inconsistent",
                )
            assert isinstance(first, Mapping)
            problem = _check_logprob(first.get("logprob"), f"top_logprobs[0] of {where}")
            if problem is not None:
                return problem
        checked.append(TokenLogprob(token=token, logprob=float(item["logprob"])))
    return tuple(checked)


def _error_text(payload: Any) -> str | None:
    """The human message inside an OpenAI/vLLM/FastAPI error body, if there is one."""
    if not isinstance(payload, Mapping):
        return None
    error = payload.get("error")
    if isinstance(error, Mapping) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    for key in ("message", "detail"):
        if isinstance(payload.get(key), str):
            return str(payload[key])
    return None


def judge_error(status: int, body: str) -> Failed:
    """Classify a non-200 answer (or an error object inside a stream)."""
    try:
        payload = parse_json(body)
    except ValueError:
        payload = None
    message = _error_text(payload) or _snippet(body) or "(empty body)"
    lowered = message.lower()
    if status == 401:
        return Failed(
            Reason.UNAUTHORIZED,
            f"HTTP 401 ({_snippet(message, 80)}): the API key is missing or wrong; pass the key the server "
            "was started with (--api-key / VLLM_API_KEY)",
        )
    if "out of range float" in lowered or "not json compliant" in lowered:
        return Failed(
            Reason.NAN,
            f"the model produced NaN: HTTP {status} {_snippet(message, 80)!r} is how vLLM reports a NaN "
            f"logprob in a non-streamed answer; {_NAN_FIX}",
        )
    error = payload.get("error") if isinstance(payload, Mapping) else None
    if ENGINE_DEAD.lower() in lowered:
        return Failed(
            Reason.DEAD_RANK,
            f"a rank of the group died: HTTP {status} {_snippet(message, 80)!r} is vLLM's answer once its engine is "
            "dead, which in a group means a rank (a worker on another node, or a process of the head) died or lost "
            "its connection; the head exits (code 0) seconds later; find the first rank to die (`docker ps -a` and "
            "`docker logs --tail 50` of every serving container), then `pulumi up` replaces the group",
        )
    about_model = isinstance(error, Mapping) and error.get("param") == "model"
    if "does not exist" in lowered or (status == 404 and about_model):
        return Failed(
            Reason.UNKNOWN_MODEL,
            f"HTTP {status} {_snippet(message, 100)!r}: the server does not serve this model name; use an id "
            "from GET /v1/models (the --served-model-name)",
        )
    if status == 404:
        return Failed(
            Reason.HTTP_ERROR,
            f"HTTP 404 {_snippet(message, 80)!r} for the chat completions route: the endpoint must be the "
            "server's OpenAI base URL ending in /v1",
        )
    if status == 503:
        return Failed(Reason.NOT_READY, f"HTTP 503 {_snippet(message, 80)!r}: the server is not ready yet")
    return Failed(Reason.HTTP_ERROR, f"HTTP {status} {_snippet(message)!r}")


def judge_completion(status: int, headers: Mapping[str, str], body: bytes | str) -> Verdict:
    """Judge a non-streamed `/v1/chat/completions` answer."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    if status != 200:
        return judge_error(status, text)
    try:
        payload = parse_json(text)
    except ValueError:
        content_type = {k.lower(): v for k, v in headers.items()}.get("content-type", "none")
        return Failed(
            Reason.NOT_JSON,
            f"HTTP 200 but the body is not JSON (content-type {content_type}): {_snippet(text, 80)!r}; the "
            "endpoint is not vLLM's OpenAI server (check the URL, port and any proxy)",
        )
    if isinstance(payload, Mapping) and "error" in payload and "choices" not in payload:
        return judge_error(status, text)
    choices = payload.get("choices") if isinstance(payload, Mapping) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return Failed(Reason.MALFORMED, f"the answer has no choices[0]: {_snippet(text, 100)!r}")
    choice = choices[0]
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, Mapping) or not isinstance(logprobs.get("content"), list):
        return Failed(
            Reason.NO_LOGPROBS,
            "the answer carries no logprobs.content although logprobs=true was asked; the server ignored it",
        )
    tokens = judge_tokens(logprobs["content"])
    if isinstance(tokens, Failed):
        return tokens
    message = choice.get("message")
    content = message.get("content") if isinstance(message, Mapping) else None
    reasoning = "".join(
        value for key in REASONING_KEYS if isinstance(message, Mapping) and isinstance(value := message.get(key), str)
    )
    answer = content if isinstance(content, str) else ""
    return Verified(answer=_answer_text(answer, reasoning, tokens), logprobs=tokens, reasoning=reasoning.strip())


def _answer_text(content: str, reasoning: str, tokens: Sequence[TokenLogprob]) -> str:
    """The answer: the content; the generated tokens only when the server split off neither content nor
    reasoning (with a reasoning parser, tokens without content are the reasoning: the answer itself is empty)."""
    if content.strip() or reasoning.strip():
        return content.strip()
    return "".join(t.token for t in tokens).strip()


def _stream_chunks(payloads: Sequence[str]) -> list[Mapping[str, Any]] | Failed:
    """Parse each data payload; an error event or a missing [DONE] is a failure."""
    chunks: list[Mapping[str, Any]] = []
    done = False
    for index, payload in enumerate(payloads):
        if payload.strip() == "[DONE]":
            done = True
            break
        try:
            chunk = parse_json(payload)
        except ValueError:
            return Failed(
                Reason.NOT_JSON,
                f"stream event {index} is not JSON: {_snippet(payload, 80)!r}; the endpoint is not vLLM's "
                "OpenAI server",
            )
        if not isinstance(chunk, Mapping):
            return Failed(Reason.MALFORMED, f"stream event {index} is not an object: {_snippet(payload, 80)!r}")
        if "error" in chunk:
            error = chunk["error"]
            code = error.get("code") if isinstance(error, Mapping) else None
            return judge_error(code if isinstance(code, int) and code != 200 else 500, payload)
        chunks.append(chunk)
    if not done:
        return Failed(
            Reason.MALFORMED,
            f"the stream ended after {len(payloads)} event(s) without 'data: [DONE]': the server cut it off",
        )
    return chunks


def _first_choice(chunk: Mapping[str, Any]) -> Mapping[str, Any] | None:
    choices = chunk.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, Mapping) and choice.get("index", 0) == 0:
                return choice
    return None


def _delta_text(choice: Mapping[str, Any]) -> str:
    """Generated text of one chunk, counting reasoning text (it is decoded like any token)."""
    delta = choice.get("delta")
    if not isinstance(delta, Mapping):
        return ""
    return "".join(value for key in (*REASONING_KEYS, "content") if isinstance(value := delta.get(key), str))


def judge_stream(status: int, headers: Mapping[str, str], payloads: Sequence[str]) -> Verdict:
    """Judge a streamed answer given its SSE data payloads (for a non-200 answer: the body)."""
    if status != 200:
        return judge_error(status, "\n".join(payloads))
    chunks = _stream_chunks(payloads)
    if isinstance(chunks, Failed):
        return chunks
    items: list[Any] = []
    answer: list[str] = []
    reasoning: list[str] = []
    for chunk in chunks:
        choice = _first_choice(chunk)
        if choice is None:
            continue
        delta = choice.get("delta")
        if isinstance(delta, Mapping) and isinstance(delta.get("content"), str):
            answer.append(delta["content"])
        if isinstance(delta, Mapping):
            reasoning += [v for key in REASONING_KEYS if isinstance(v := delta.get(key), str)]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, Mapping) and isinstance(logprobs.get("content"), list):
            items.extend(logprobs["content"])
    if not items:
        return Failed(
            Reason.NO_LOGPROBS,
            "the stream carried no logprobs.content although logprobs=true was asked; the server ignored it",
        )
    tokens = judge_tokens(items)
    if isinstance(tokens, Failed):
        return tokens
    thought = "".join(reasoning)
    return Verified(answer=_answer_text("".join(answer), thought, tokens), logprobs=tokens, reasoning=thought.strip())


def judge_answer(verified: Verified, expected: str) -> Failed | None:
    """None when the answer to the recipe's question says `expected` (any case, a whole word), reasoning text
    aside; with `expected` empty, any answer passes (the logprobs were judged already).

    Finite logprobs prove numbers, not sense: fluent garbage has them too. The reasoning is not
    judged (it may weigh other cities); only when the answer itself is empty (the reasoning took
    the whole token budget) is the reasoning read instead.
    """
    answer = _THINK.sub("", verified.answer).strip()
    judged, where = answer, "answer"
    if not answer:
        inline = " ".join(m.group(0) for m in _THINK.finditer(verified.answer))
        judged, where = (verified.reasoning or inline).strip(), "reasoning (the answer itself was empty)"
    if not expected or re.search(rf"(?<!\w){re.escape(expected)}(?!\w)", judged, re.IGNORECASE):
        return None
    return Failed(
        Reason.WRONG_ANSWER,
        f"the {where} to {VERIFY_PROMPT!r} is {_snippet(judged, 80)!r}, which does not say "
        f"{expected}: the logprobs are finite but the model computes the wrong text; suspect the "
        "weights (a shard of another revision), one node running a different image build, or a "
        "serve.extraArgs / serve.extraEnv change",
    )


@dataclass(frozen=True)
class DecodeSample:
    """One streamed answer's timing: tokens generated and when the first and last arrived."""

    completion_tokens: int
    first_token_at: float
    last_token_at: float

    @property
    def tokens_per_second(self) -> float:
        """Decode rate after the first token, so prefill time is not counted."""
        return (self.completion_tokens - 1) / (self.last_token_at - self.first_token_at)


def decode_sample(events: Sequence[tuple[float, str]]) -> DecodeSample | Failed:
    """Timing of one streamed answer from (arrival time, data payload) events.

    Token count comes from the final chunk's usage (a speculative step can put several tokens in
    one chunk); without usage, each chunk with text counts as one token.
    """
    chunks = _stream_chunks([payload for _, payload in events])
    if isinstance(chunks, Failed):
        return chunks
    by_payload = [(at, payload) for at, payload in events if payload.strip() != "[DONE]"]
    token_times: list[float] = []
    usage_tokens: int | None = None
    for (at, _), chunk in zip(by_payload, chunks, strict=False):
        choice = _first_choice(chunk)
        if choice is not None and _delta_text(choice):
            token_times.append(at)
        usage = chunk.get("usage")
        if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
            usage_tokens = int(usage["completion_tokens"])
    tokens = usage_tokens if usage_tokens is not None else len(token_times)
    if tokens < 2 or len(token_times) < 2 or token_times[-1] <= token_times[0]:
        return Failed(
            Reason.UNMEASURABLE,
            f"the answer had {tokens} token(s) in {len(token_times)} chunk(s); at least 2 tokens arriving "
            "at different times are needed to measure decode speed",
        )
    return DecodeSample(completion_tokens=tokens, first_token_at=token_times[0], last_token_at=token_times[-1])


def median_rate(samples: Sequence[DecodeSample]) -> float:
    """The median decode rate: robust to one prompt that speculates unusually well or badly."""
    if not samples:
        raise ValueError("median_rate needs at least one decode sample")
    return float(statistics.median(sample.tokens_per_second for sample in samples))
