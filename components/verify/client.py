"""Talking to a served endpoint: the verifying completion, the decode-speed measurement, the drift probe.

- `verify_endpoint(...)`: the recipe's request (recipe step 5), bounded retries while the API starts, the
  dead-rank diagnosis, and the optional decode-speed probe (`measure_decode`);
- `probe_endpoint(...)`: LiveRanks' 1-token drift probe (`ask_probe` + `judge_probe`), busy told apart from
  hung by vLLM's counters, KV cache usage and running requests;
- `run_bounded(...)`: the last-resort deadline every caller puts around them.

The HTTP is `components.http`; judging an answer is pure and lives in `components.verify.verdict`. The
callers are the Verifier resource (`components.verify.verifier`), LiveRanks and the operators' command
(`dsv41-exl3 verify`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.client import HTTPException
from typing import Literal, TypeVar
from urllib.parse import urlsplit

from components.http import Clock, ConnectionRefusedOrReset, DeadlineExceeded, HttpReply, exchange
from components.redaction import redact
from components.verify.verdict import (
    DECODE_PROBE_MAX_TOKENS,
    DECODE_PROBE_PROMPTS,
    VERIFY_EXPECTED,
    DecodeSample,
    Failed,
    Reason,
    TokenLogprob,
    completion_request,
    decode_probe_request,
    decode_sample,
    drift_probe_request,
    engine_activity,
    engine_busy,
    judge_answer,
    judge_completion,
    judge_error,
    judge_stream,
    median_rate,
)

Sleep = Callable[[float], None]
Progress = Callable[[str], None]
T = TypeVar("T")

DEFAULT_TIMEOUT_S = 120.0
HEALTH_TIMEOUT_S = 5.0
FIRST_RETRY_PAUSE_S = 1.0
MAX_RETRY_PAUSE_S = 10.0
# Eager mode (no CUDA graphs) is what the recipe measured at 11-13 tok/s on two Sparks.
EAGER_MODE_TOKENS_PER_SECOND = "11-13"


# ---------------------------------------------------------------------------------------------
# Verification against a live endpoint.


@dataclass(frozen=True)
class Passed:
    """The endpoint answered the recipe's request with real logprobs (and fast enough, if asked)."""

    answer: str
    logprobs: tuple[TokenLogprob, ...]
    latency_s: float
    decode_tokens_per_second: float | None = None


Outcome = Passed | Failed


@dataclass(frozen=True)
class DecodeMeasurement:
    median_tokens_per_second: float
    per_prompt: tuple[float, ...]


def normalize_endpoint(endpoint: str) -> str:
    """The OpenAI base URL without a trailing slash; it must be http(s)://host[:port]/.../v1."""
    cleaned = endpoint.strip().rstrip("/")
    parts = urlsplit(cleaned)
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.path.endswith("/v1"):
        raise ValueError(
            f"endpoint {endpoint!r} is not an OpenAI base URL: use http://HOST:PORT/v1 (vLLM serves "
            "/v1/chat/completions)"
        )
    return cleaned


def health_url(endpoint: str) -> str:
    return normalize_endpoint(endpoint)[: -len("/v1")] + "/health"


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _named(failed: Failed, endpoint: str, model: str, api_key: str | None) -> Failed:
    """Prefix the diagnosis with what was verified; a server echoing the key never leaks it."""
    return Failed(failed.reason, redact(f"{endpoint} model {model!r}: {failed.message}", [api_key]))


def worst_case_seconds(
    timeout_s: float, retry_window_s: float, decode_prompts: int = 0, warmup_timeout_s: float = 0.0
) -> float:
    """Upper bound of verify_endpoint's run time; callers add a margin for their own guard."""
    # retry window + a warm-up + the last attempt + the /health (or /v1/models) look-up + each probe prompt
    return retry_window_s + warmup_timeout_s + timeout_s + HEALTH_TIMEOUT_S + decode_prompts * timeout_s


def _served_models(endpoint: str, api_key: str | None, clock: Clock) -> list[str] | None:
    try:
        reply = exchange(
            "GET", f"{endpoint}/models", headers=_headers(api_key), deadline=clock() + HEALTH_TIMEOUT_S, clock=clock
        )
        payload = json.loads(reply.body)
        return [str(item["id"]) for item in payload["data"]]
    except (OSError, HTTPException, ConnectionRefusedOrReset, DeadlineExceeded, ValueError, KeyError, TypeError):
        return None


def _diagnose_timeout(endpoint: str, timeout_s: float, clock: Clock) -> Failed:
    """A completion that never returns while /health says 200 is vLLM's signature of a lost rank."""
    url = health_url(endpoint)
    try:
        reply = exchange("GET", url, deadline=clock() + min(HEALTH_TIMEOUT_S, timeout_s), clock=clock)
        health = f"answered HTTP {reply.status}"
    except (OSError, HTTPException, ConnectionRefusedOrReset, DeadlineExceeded):
        reply, health = None, "did not answer"
    if reply is not None and reply.status == 200:
        return Failed(
            Reason.HUNG_RANK,
            f"a rank is dead or hung: {url} answers 200 but a completion did not return within "
            f"{timeout_s:g} s; /health only sees the head's local processes, so check that every "
            "serving container (head and workers) is running and restart the set",
        )
    return Failed(
        Reason.TIMEOUT,
        f"no completion within {timeout_s:g} s and {url} {health}: the server is stuck or unreachable; "
        "check the head container's logs",
    )


def _post_completion(
    endpoint: str, model: str, api_key: str | None, *, stream: bool, timeout_s: float, clock: Clock
) -> HttpReply:
    body = json.dumps(completion_request(model, stream=stream)).encode()
    return exchange(
        "POST",
        f"{endpoint}/chat/completions",
        body=body,
        headers=_headers(api_key),
        deadline=clock() + timeout_s,
        clock=clock,
        stream=stream,
    )


def verify_endpoint(
    endpoint: str,
    model: str,
    api_key: str | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry_window_s: float = 0.0,
    min_decode_tokens_per_second: float | None = None,
    stream: bool = False,
    decode_prompts: Sequence[str] = DECODE_PROBE_PROMPTS,
    decode_max_tokens: int = DECODE_PROBE_MAX_TOKENS,
    warmup_timeout_s: float | None = None,
    expected_answer: str = VERIFY_EXPECTED,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
    on_progress: Progress | None = None,
) -> Outcome:
    """Send the recipe's request and judge it; retry only what clears by itself.

    Connection refused/reset (the port is not serving until the engine is ready) and HTTP 503
    are retried until `retry_window_s` is spent; a NaN, a bad logprob or any other answer is
    final. With `warmup_timeout_s`, the first answered request is a warm-up: the first request
    after a boot can spend minutes in JIT, so it may take until `warmup_timeout_s` after the
    start; its answer fails only on a hard fault (NaN, ...), and the next request, bounded by
    `timeout_s`, is the one judged. The judged answer must also say `expected_answer` (empty: any). Total time is
    bounded by `worst_case_seconds(...)`.
    """
    endpoint = normalize_endpoint(endpoint)
    if timeout_s <= 0 or retry_window_s < 0 or (warmup_timeout_s is not None and warmup_timeout_s <= 0):
        raise ValueError(
            f"timeout_s and warmup_timeout_s must be > 0 and retry_window_s >= 0, got {timeout_s!r}, "
            f"{warmup_timeout_s!r} and {retry_window_s!r}"
        )
    start = clock()
    window_end = start + retry_window_s
    warming = warmup_timeout_s is not None
    pause = FIRST_RETRY_PAUSE_S
    attempts = 0
    while True:
        attempts += 1
        sent_at = clock()
        bound = timeout_s
        if warming and warmup_timeout_s is not None:
            bound = max(timeout_s, start + warmup_timeout_s - sent_at)
        try:
            reply = _post_completion(endpoint, model, api_key, stream=stream, timeout_s=bound, clock=clock)
        except ConnectionRefusedOrReset as error:
            retry_reason, last = Reason.UNREACHABLE, f"connection {'refused' if 'Refused' in str(error) else 'reset'}"
        except DeadlineExceeded:
            return _named(_diagnose_timeout(endpoint, bound, clock), endpoint, model, api_key)
        except HTTPException as error:
            failed = Failed(Reason.HTTP_ERROR, f"the server does not speak HTTP correctly ({error!r})")
            return _named(failed, endpoint, model, api_key)
        except OSError as error:
            failed = Failed(Reason.UNREACHABLE, f"cannot connect ({error}); check the host name and port")
            return _named(failed, endpoint, model, api_key)
        else:
            latency = clock() - sent_at
            if stream and reply.status == 200:
                verdict = judge_stream(reply.status, reply.headers, [data for _, data in reply.events])
            else:
                verdict = judge_completion(reply.status, reply.headers, reply.body)
            if isinstance(verdict, Failed) and verdict.reason is Reason.NOT_READY:
                retry_reason, last = Reason.NOT_READY, verdict.message
            elif isinstance(verdict, Failed):
                if verdict.reason is Reason.UNKNOWN_MODEL and (served := _served_models(endpoint, api_key, clock)):
                    verdict = Failed(verdict.reason, f"{verdict.message}; served: {', '.join(served)}")
                return _named(verdict, endpoint, model, api_key)
            elif warming:
                warming = False
                if on_progress is not None:
                    on_progress(f"{endpoint} warm-up request answered in {latency:.0f} s; judging the next answer")
                continue
            else:
                break
        now = clock()
        if now >= window_end:
            waited = f"for {retry_window_s:g} s ({attempts} attempt{'s' if attempts > 1 else ''})"
            fix = (
                "the API is not listening: check the head container is running and its log shows "
                "'Application startup complete' (model loading takes minutes; raise retry_window_s)"
                if retry_reason is Reason.UNREACHABLE
                else "the server kept answering 503: check the head container's log"
            )
            return _named(Failed(retry_reason, f"not ready {waited}, last: {last}; {fix}"), endpoint, model, api_key)
        wait = min(pause, window_end - now)
        if on_progress is not None:
            on_progress(
                f"{endpoint} not ready ({last}); retrying in {wait:.0f} s "
                f"({now - start:.0f} of {retry_window_s:g} s spent, attempt {attempts})"
            )
        sleep(wait)
        pause = min(pause * 2, MAX_RETRY_PAUSE_S)

    wrong = judge_answer(verdict, expected_answer)
    if wrong is not None:
        return _named(wrong, endpoint, model, api_key)
    decode_rate: float | None = None
    if min_decode_tokens_per_second is not None:
        measured = measure_decode(
            endpoint,
            model,
            api_key,
            timeout_s=timeout_s,
            prompts=decode_prompts,
            max_tokens=decode_max_tokens,
            clock=clock,
        )
        if isinstance(measured, Failed):
            return _named(measured, endpoint, model, api_key)
        decode_rate = measured.median_tokens_per_second
        if decode_rate < min_decode_tokens_per_second:
            rates = ", ".join(f"{rate:.1f}" for rate in measured.per_prompt)
            failed = Failed(
                Reason.SLOW_DECODE,
                f"decode speed {decode_rate:.1f} tok/s is below the required {min_decode_tokens_per_second:g} "
                f"tok/s (median of {len(measured.per_prompt)} prompts: {rates}); "
                f"{EAGER_MODE_TOKENS_PER_SECOND} tok/s is eager mode: check the serving command has no "
                "--enforce-eager and the head log shows 'Capturing CUDA graphs'",
            )
            return _named(failed, endpoint, model, api_key)
    return Passed(
        answer=verdict.answer, logprobs=verdict.logprobs, latency_s=latency, decode_tokens_per_second=decode_rate
    )


def measure_decode(
    endpoint: str,
    model: str,
    api_key: str | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    prompts: Sequence[str] = DECODE_PROBE_PROMPTS,
    max_tokens: int = DECODE_PROBE_MAX_TOKENS,
    clock: Clock = time.monotonic,
) -> DecodeMeasurement | Failed:
    """Stream each prompt and report the median decode rate (tokens after the first / their time)."""
    if len(prompts) < 3:
        raise ValueError(f"the decode probe needs at least 3 prompts for a meaningful median, got {len(prompts)}")
    endpoint = normalize_endpoint(endpoint)
    samples: list[DecodeSample] = []
    for index, prompt in enumerate(prompts):
        body = json.dumps(decode_probe_request(model, prompt, max_tokens)).encode()
        try:
            reply = exchange(
                "POST",
                f"{endpoint}/chat/completions",
                body=body,
                headers=_headers(api_key),
                deadline=clock() + timeout_s,
                clock=clock,
                stream=True,
            )
        except DeadlineExceeded:
            return Failed(
                Reason.TIMEOUT,
                f"decode probe prompt {index} did not finish within {timeout_s:g} s "
                f"({max_tokens} tokens); the server is stalled or slower than {max_tokens / timeout_s:.1f} tok/s",
            )
        except (ConnectionRefusedOrReset, OSError, HTTPException) as error:
            return Failed(Reason.UNREACHABLE, f"decode probe prompt {index} lost the connection ({error!r})")
        if reply.status != 200:
            return judge_error(reply.status, reply.body.decode("utf-8", errors="replace"))
        sample = decode_sample(reply.events)
        if isinstance(sample, Failed):
            return Failed(sample.reason, f"decode probe prompt {index}: {sample.message}")
        samples.append(sample)
    return DecodeMeasurement(
        median_tokens_per_second=median_rate(samples), per_prompt=tuple(s.tokens_per_second for s in samples)
    )


# ---------------------------------------------------------------------------------------------
# Drift probe: is a verified endpoint still computing? (LiveRanks asks on every preview and up.)

# After a probe timed out: how long between the two /metrics reads that tell busy from hung.
BUSY_CHECK_GAP_S = 2.0
# Reasons that say nothing about the ranks: the configured key or name, not the deployment, is wrong.
_NOT_DRIFT = (Reason.UNAUTHORIZED,)
# Findings the server proves by its own answer (a proxy does not write NaN logprobs or vLLM's dead-engine error):
# drift at once. Any other finding (an HTTP error, a refused or reset connection, a timeout, an answer that is not
# vLLM's) may come from the network between this machine and the head, and is confirmed from the head first.
_SERVER_PROVES = (Reason.NAN, Reason.INF, Reason.BAD_LOGPROB, Reason.DEAD_RANK)


ProbeState = Literal["healthy", "drift", "unknown"]


@dataclass(frozen=True)
class Probe:
    """One drift probe's finding: `healthy`, `drift` (replace every rank) or `unknown` (cannot tell).
    `confirm`: a drift finding that the network between could have caused (see _SERVER_PROVES)."""

    state: ProbeState
    seen: str
    confirm: bool = False


Failure = Literal["refused", "reset", "timeout", "protocol", "network"]


@dataclass(frozen=True)
class ProbeAnswer:
    """What one 1-token probe got, wherever it was sent from (this machine, or the head's own loopback)."""

    status: int | None = None
    body: bytes = b""
    failure: Failure | None = None
    """No answer: why (`protocol`: not HTTP; `network`: any other socket error)."""
    detail: str = ""
    metrics: tuple[str | None, str | None] = (None, None)
    """After a timeout: `/metrics` read twice BUSY_CHECK_GAP_S apart (None: it did not answer)."""
    accepts: bool = True
    """After a timeout with `/metrics` silent: does the port still accept TCP connections?"""


def judge_probe(answer: ProbeAnswer, timeout_s: float) -> Probe:
    """The drift verdict on one probe's answer: the verifier's rules, busy told apart from hung."""
    if answer.failure in ("refused", "reset"):
        what = "refuses connections" if answer.failure == "refused" else "resets connections"
        return Probe(
            "drift", f"{what} ({answer.detail}) while every rank container runs: the API is down", confirm=True
        )
    if answer.failure == "timeout":
        first, second = (engine_activity(m) if m is not None else None for m in answer.metrics)
        busy = engine_busy(first, second) if first is not None and second is not None else None
        if busy is not None:
            return Probe(
                "unknown",
                f"did not answer a 1-token request within {timeout_s:g} s, but the engine is "
                f"busy ({busy}): not treated as drift",
            )
        if (first is None or second is None) and not answer.accepts:
            return Probe(
                "unknown",
                f"cannot be reached (no TCP connection within {HEALTH_TIMEOUT_S:g} s): "
                "nothing is known about the ranks",
            )
        steps = (
            second.steps
            if second is not None and second.steps is not None
            else (second.tokens if second is not None else None)
        )
        engine = (
            "/metrics does not answer"
            if first is None or second is None
            else f"the engine's step counter stayed at {steps:g}"
            if steps is not None
            else "the engine's counters stood still"
        )
        return Probe(
            "drift",
            f"did not answer a 1-token request within {timeout_s:g} s and {engine}: a rank is dead or hung",
            confirm=True,
        )
    if answer.failure == "protocol":
        return Probe("drift", f"does not speak HTTP correctly ({answer.detail})", confirm=True)
    if answer.failure is not None or answer.status is None:
        return Probe("unknown", f"cannot be reached ({answer.detail}): nothing is known about the ranks")
    if answer.status == 429:
        return Probe("unknown", "answers HTTP 429 (too many requests): busy, not treated as drift")
    verdict = judge_completion(answer.status, {}, answer.body)
    if isinstance(verdict, Failed):
        if verdict.reason in _NOT_DRIFT:
            return Probe("unknown", f"{verdict.reason}: {verdict.message}")
        return Probe("drift", f"{verdict.reason}: {verdict.message}", confirm=verdict.reason not in _SERVER_PROVES)
    pairs = ", ".join(f"{t.token!r} {t.logprob:.3f}" for t in verdict.logprobs)
    return Probe("healthy", f"answers with real logprobs ({pairs})")


def _metrics(endpoint: str, clock: Clock) -> str | None:
    url = normalize_endpoint(endpoint)[: -len("/v1")] + "/metrics"
    try:
        reply = exchange("GET", url, deadline=clock() + HEALTH_TIMEOUT_S, clock=clock)
    except (OSError, HTTPException, ConnectionRefusedOrReset, DeadlineExceeded):
        return None
    return reply.body.decode("utf-8", errors="replace") if reply.status == 200 else None


def _accepts(endpoint: str) -> bool:
    """A hung server still accepts TCP connections (the kernel's backlog); a dropped route does not."""
    parts = urlsplit(endpoint)
    try:
        socket.create_connection((parts.hostname or "", parts.port or 80), timeout=HEALTH_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def probe_worst_case_seconds(timeout_s: float) -> float:
    """Upper bound of probe_endpoint's run time: the probe, two /metrics reads a gap apart, a TCP connect."""
    return timeout_s + 3 * HEALTH_TIMEOUT_S + BUSY_CHECK_GAP_S


def ask_probe(
    endpoint: str,
    model: str,
    api_key: str | None = None,
    *,
    timeout_s: float,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> ProbeAnswer:
    """Send the 1-token probe from this machine; after a timeout read `/metrics` twice (and try a TCP connect)."""
    endpoint = normalize_endpoint(endpoint)
    body = json.dumps(drift_probe_request(model)).encode()
    try:
        reply = exchange(
            "POST",
            f"{endpoint}/chat/completions",
            body=body,
            headers=_headers(api_key),
            deadline=clock() + timeout_s,
            clock=clock,
        )
    except ConnectionRefusedOrReset as error:
        return ProbeAnswer(failure="refused" if "Refused" in str(error) else "reset", detail=str(error))
    except DeadlineExceeded:
        first = _metrics(endpoint, clock)
        sleep(BUSY_CHECK_GAP_S)
        second = _metrics(endpoint, clock)
        accepts = first is not None and second is not None or _accepts(endpoint)
        return ProbeAnswer(failure="timeout", metrics=(first, second), accepts=accepts)
    except HTTPException as error:
        return ProbeAnswer(failure="protocol", detail=repr(error))
    except OSError as error:
        return ProbeAnswer(failure="network", detail=str(error))
    return ProbeAnswer(status=reply.status, body=reply.body)


def probe_endpoint(
    endpoint: str,
    model: str,
    api_key: str | None = None,
    *,
    timeout_s: float,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> Probe:
    """One 1-token completion with logprobs from this machine, judged by the verifier's rules; no retries.

    Real finite logprobs: healthy. NaN, -inf, a bad answer, vLLM's dead-engine error: drift. An HTTP error, a
    refused or reset connection, or no answer within `timeout_s` while vLLM's engine is not busy (`engine_busy`):
    drift to be confirmed from the head (`Probe.confirm`; LiveRanks does). A busy engine, a network error or a
    refused key say nothing about the ranks. Bounded by `probe_worst_case_seconds(timeout_s)`.
    """
    answer = ask_probe(endpoint, model, api_key, timeout_s=timeout_s, clock=clock, sleep=sleep)
    found = judge_probe(answer, timeout_s)
    return Probe(found.state, redact(found.seen, [api_key]), found.confirm)


# What a caller adds to a worst-case bound for its own guard (thread start, the name look-ups).
GUARD_MARGIN_S = 30.0


class VerificationTimeout(Exception):
    """The verification overran its own guard (e.g. a name look-up that sockets cannot bound)."""


def run_bounded(work: Callable[[], T], budget_s: float, what: str) -> T:
    """Run `work` in a daemon thread and give up after `budget_s`; the last-resort deadline."""
    results: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            results.append(work())
        except BaseException as error:  # re-raised in the caller's thread
            errors.append(error)

    worker = threading.Thread(target=target, name=f"bounded: {what}", daemon=True)
    worker.start()
    worker.join(budget_s)
    if worker.is_alive():
        raise VerificationTimeout(f"{what} did not finish within its {budget_s:g} s deadline")
    if errors:
        raise errors[0]
    return results[0]
