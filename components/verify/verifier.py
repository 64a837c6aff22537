"""Verifier: a `pulumi.dynamic` resource, so `pulumi up` fails unless the endpoint computes (recipe step 5).

Its create and update are the verification (`components.verify.client.verify_endpoint`, bounded by
`run_bounded`); it re-verifies whenever a serving container is replaced (`rerun_on`). This module
creates no resources at import: Pulumi pickles the provider class by reference and re-imports this
module in the provider process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pulumi
import pulumi.dynamic

from components.dynamic import StateOnlyProvider, as_set, log_progress, plain, secret_or_none
from components.verify.client import (
    GUARD_MARGIN_S,
    Progress,
    normalize_endpoint,
    run_bounded,
    verify_endpoint,
    worst_case_seconds,
)
from components.verify.verdict import DECODE_PROBE_PROMPTS, VERIFY_EXPECTED, Failed

INPUT_KEYS = (
    "endpoint",
    "model",
    "api_key",
    "timeout_s",
    "retry_window_s",
    "min_decode_tokens_per_second",
    "warmup_timeout_s",
    "expected_answer",
    "rerun_on",
)
# The command that rolls the stack back, named at the end of a failed verification's message. Not an input
# the diff compares: a new program version that adds it, or a renamed stack, re-verifies nothing.
ROLLBACK_KEY = "rollback_command"
OUTPUT_KEYS = ("answer", "logprobs", "latency_s", "verified_at", "decode_tokens_per_second")


class VerificationFailed(Exception):
    """Raised from create/update; Pulumi shows the message under the resource."""


@dataclass(frozen=True, kw_only=True)
class VerifierInputs:
    """The provider's view of the inputs: plain, validated values."""

    endpoint: str
    model: str
    api_key: str | None
    timeout_s: float
    retry_window_s: float
    min_decode_tokens_per_second: float | None
    warmup_timeout_s: float | None
    expected_answer: str
    rerun_on: tuple[str, ...]

    def __repr__(self) -> str:  # keep the key out of tracebacks
        return f"VerifierInputs(endpoint={self.endpoint!r}, model={self.model!r}, rerun_on={self.rerun_on!r})"

    @classmethod
    def from_props(cls, props: Mapping[str, Any]) -> VerifierInputs:
        values = plain(INPUT_KEYS, props)
        if not isinstance(values["endpoint"], str) or not isinstance(values["model"], str) or not values["model"]:
            raise ValueError(
                f"Verifier needs endpoint and model as strings, got endpoint={values['endpoint']!r} "
                f"model={values['model']!r}"
            )
        rerun_on = values["rerun_on"] or []
        if not isinstance(rerun_on, list | tuple):
            raise ValueError(f"Verifier rerun_on must be a list of container ids, got {rerun_on!r}")
        # The settings come from components/config through the program: none is invented here. Pulumi
        # drops None inputs, so an optional one (no threshold, no warm-up) may be absent.
        missing = [key for key in ("timeout_s", "retry_window_s") if values[key] is None]
        if missing:
            raise ValueError(f"Verifier needs {' and '.join(missing)}: the program sends every setting")
        api_key = values["api_key"]
        minimum = values["min_decode_tokens_per_second"]
        warmup = values["warmup_timeout_s"]
        return cls(
            endpoint=normalize_endpoint(values["endpoint"]),
            model=values["model"],
            api_key=str(api_key) if api_key else None,
            timeout_s=float(values["timeout_s"]),
            retry_window_s=float(values["retry_window_s"]),
            min_decode_tokens_per_second=float(minimum) if minimum is not None else None,
            warmup_timeout_s=float(warmup) if warmup is not None else None,
            # Absent in a state written before the setting existed: the recipe's answer then.
            expected_answer=str(values["expected_answer"])
            if values["expected_answer"] is not None
            else VERIFY_EXPECTED,
            rerun_on=tuple(str(item) for item in rerun_on),
        )

    def to_props(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "model": self.model,
            "api_key": self.api_key,
            "timeout_s": self.timeout_s,
            "retry_window_s": self.retry_window_s,
            "min_decode_tokens_per_second": self.min_decode_tokens_per_second,
            "warmup_timeout_s": self.warmup_timeout_s,
            "expected_answer": self.expected_answer,
            "rerun_on": list(self.rerun_on),
        }


def _endpoint_as_compared(value: Any) -> Any:
    return value.strip().rstrip("/") if isinstance(value, str) else value


# What makes two values of an input the same: the set of containers matters, not its order.
NORMALIZE = {"endpoint": _endpoint_as_compared, "rerun_on": as_set}


def run_verification(inputs: VerifierInputs, on_progress: Progress | None = None) -> dict[str, Any]:
    """Verify and return the resource's outputs, or raise VerificationFailed with the diagnosis."""
    probe_prompts = len(DECODE_PROBE_PROMPTS) if inputs.min_decode_tokens_per_second is not None else 0
    budget = (
        worst_case_seconds(inputs.timeout_s, inputs.retry_window_s, probe_prompts, inputs.warmup_timeout_s or 0.0)
        + GUARD_MARGIN_S
    )
    outcome = run_bounded(
        lambda: verify_endpoint(
            inputs.endpoint,
            inputs.model,
            inputs.api_key,
            timeout_s=inputs.timeout_s,
            retry_window_s=inputs.retry_window_s,
            min_decode_tokens_per_second=inputs.min_decode_tokens_per_second,
            warmup_timeout_s=inputs.warmup_timeout_s,
            expected_answer=inputs.expected_answer,
            on_progress=on_progress,
        ),
        budget,
        f"verification of {inputs.endpoint}",
    )
    if isinstance(outcome, Failed):
        raise VerificationFailed(f"verification failed ({outcome.reason}): {outcome.message}")
    return {
        "answer": outcome.answer,
        "logprobs": [{"token": item.token, "logprob": item.logprob} for item in outcome.logprobs],
        "latency_s": outcome.latency_s,
        "verified_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "decode_tokens_per_second": outcome.decode_tokens_per_second,
    }


class VerifierProvider(StateOnlyProvider):
    """CRUD for Verifier: create and update are the verification. Any input change re-runs it in place."""

    input_keys = INPUT_KEYS
    normalize = NORMALIZE
    id_prefix = "verifier"

    def outputs(self, props: Mapping[str, Any]) -> dict[str, Any]:
        inputs = VerifierInputs.from_props(props)
        try:
            return {**inputs.to_props(), **run_verification(inputs, log_progress)}
        except VerificationFailed as failed:
            raise VerificationFailed(with_rollback_hint(str(failed), props.get(ROLLBACK_KEY))) from None


def with_rollback_hint(message: str, command: Any) -> str:
    """A failed verification's message, ending with the way back when the program gave one."""
    if not isinstance(command, str) or not command:
        return message
    return f"{message}. To go back to the last verified deployment: {command}"


@dataclass(frozen=True, kw_only=True)
class VerifierArgs:
    """Inputs of Verifier. `rerun_on`: the ids of every serving container, so a replaced
    container (head or worker) triggers a fresh verification."""

    endpoint: pulumi.Input[str]
    model: pulumi.Input[str]
    rerun_on: pulumi.Input[Sequence[pulumi.Input[str]]]
    api_key: pulumi.Input[str] | None
    timeout_s: float
    """Each judged request's bound."""
    retry_window_s: float
    """How long connection refused and 503 are retried while the API starts."""
    min_decode_tokens_per_second: float | None
    """None: no decode-speed probe."""
    warmup_timeout_s: float | None
    """The first answered request may take this long after the start (JIT after a boot); the next is judged."""
    expected_answer: str
    """What the judged answer must say (`gates.expectedAnswer`); empty: any answer with real logprobs."""
    rollback_command: str
    """Ends a failed verification's message (`dsv41-exl3 rollback --stack NAME`); empty: none."""


class Verifier(pulumi.dynamic.Resource, module="verify", name="Verifier"):
    """Fails the deployment unless the endpoint returns real logprobs for the recipe's request."""

    answer: pulumi.Output[str]
    """The model's answer to the capital-of-France question."""
    logprobs: pulumi.Output[list[dict[str, Any]]]
    """Every generated token with its (finite, <= 0) log-probability."""
    latency_s: pulumi.Output[float]
    """Wall time of the verifying request, in seconds."""
    verified_at: pulumi.Output[str]
    """When the endpoint last verified (ISO-8601, UTC)."""
    decode_tokens_per_second: pulumi.Output[float | None]
    """Median decode speed from the probe, or None when no threshold was set."""

    def __init__(self, name: str, args: VerifierArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        props: dict[str, Any] = {
            "endpoint": args.endpoint,
            "model": args.model,
            "rerun_on": args.rerun_on,
            "api_key": secret_or_none(args.api_key),
            "timeout_s": args.timeout_s,
            "retry_window_s": args.retry_window_s,
            "min_decode_tokens_per_second": args.min_decode_tokens_per_second,
            "warmup_timeout_s": args.warmup_timeout_s,
            "expected_answer": args.expected_answer,
            ROLLBACK_KEY: args.rollback_command,
            **dict.fromkeys(OUTPUT_KEYS),
        }
        secret = pulumi.ResourceOptions(additional_secret_outputs=["api_key"])
        super().__init__(VerifierProvider(), name, props, pulumi.ResourceOptions.merge(secret, opts))
