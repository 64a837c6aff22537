"""Verifier: a `pulumi.dynamic` resource, so `pulumi up` fails unless the endpoint computes (recipe step 5).

Its create and update are the verification (`components.verify.client.verify_endpoint`, bounded by
`run_bounded`); it re-verifies whenever a serving container is replaced (`rerun_on`). This module
creates no resources at import: Pulumi pickles the provider class by reference and re-imports this
module in the provider process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pulumi
import pulumi.dynamic

from components.contract import Contract, secret
from components.dynamic import StateOnlyProvider, as_set, log_progress, props_of, read_props, secret_outputs
from components.verify.client import (
    GUARD_MARGIN_S,
    Progress,
    normalize_endpoint,
    run_bounded,
    verify_endpoint,
    worst_case_seconds,
)
from components.verify.verdict import DECODE_PROBE_PROMPTS, VERIFY_EXPECTED, Failed

OUTPUT_KEYS = ("answer", "logprobs", "latency_s", "verified_at", "decode_tokens_per_second")


class VerificationFailed(Exception):
    """Raised from create/update; Pulumi shows the message under the resource."""


# ---------------------------------------------------------------------------------------------
# The boundary: what the program sends and the provider reads back (components/contract.py)


@dataclass(frozen=True, kw_only=True)
class VerifierArgs(Contract):
    """Inputs of Verifier. `rerun_on`: the ids of every serving container, so a replaced container (head or
    worker) triggers a fresh verification. Each field is a property of the resource by its name (the state of a
    deployed stack keeps these names). No defaults: the settings come from components/config."""

    endpoint: pulumi.Input[str]
    model: pulumi.Input[str]
    api_key: pulumi.Input[str] | None = secret()
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
    rerun_on: pulumi.Input[Sequence[pulumi.Input[str]]]
    rollback_command: str
    """Ends a failed verification's message (`dsv41-exl3 rollback --stack NAME`); empty: none. Not an input the
    diff compares: a new program version that adds it, or a renamed stack, re-verifies nothing."""

    def __repr__(self) -> str:  # keep the key out of tracebacks
        return f"VerifierArgs(endpoint={self.endpoint!r}, model={self.model!r}, rerun_on={self.rerun_on!r})"


# What a diff compares, and what the outputs echo: every input but the rollback command.
INPUT_KEYS = tuple(k for k in VerifierArgs.field_names() if k != "rollback_command")

# What an absent property means: state written before `expected_answer` existed meant the recipe's answer, and
# no `rerun_on` names no container.
_ABSENT: dict[str, Any] = {"expected_answer": VERIFY_EXPECTED, "rerun_on": []}


def read_inputs(props: Mapping[str, Any]) -> VerifierArgs:
    """The provider's view of the inputs: the program's VerifierArgs back from the engine, checked, and plain as
    the outputs keep them (the endpoint without a trailing slash, the key a string or None). An absent property
    reads as `_ABSENT` says."""
    given = {k: v for k, v in props.items() if v is not None}
    args = read_props(VerifierArgs, {**_ABSENT, **given})
    if not isinstance(args.endpoint, str) or not isinstance(args.model, str) or not args.model:
        raise ValueError(
            f"Verifier needs endpoint and model as strings, got endpoint={args.endpoint!r} model={args.model!r}"
        )
    if not isinstance(args.rerun_on, list | tuple):
        raise ValueError(f"Verifier rerun_on must be a list of container ids, got {args.rerun_on!r}")
    return dataclasses.replace(
        args,
        endpoint=normalize_endpoint(args.endpoint),
        api_key=str(args.api_key) if args.api_key else None,
        rerun_on=tuple(str(item) for item in args.rerun_on),
    )


def _endpoint_as_compared(value: Any) -> Any:
    return value.strip().rstrip("/") if isinstance(value, str) else value


# What makes two values of an input the same: the set of containers matters, not its order.
NORMALIZE = {"endpoint": _endpoint_as_compared, "rerun_on": as_set}


def run_verification(inputs: VerifierArgs, on_progress: Progress | None = None) -> dict[str, Any]:
    """Verify and return the resource's outputs, or raise VerificationFailed with the diagnosis."""
    endpoint, model = str(inputs.endpoint), str(inputs.model)  # plain strings in the provider (read_inputs)
    api_key = str(inputs.api_key) if inputs.api_key else None
    probe_prompts = len(DECODE_PROBE_PROMPTS) if inputs.min_decode_tokens_per_second is not None else 0
    budget = (
        worst_case_seconds(inputs.timeout_s, inputs.retry_window_s, probe_prompts, inputs.warmup_timeout_s or 0.0)
        + GUARD_MARGIN_S
    )
    outcome = run_bounded(
        lambda: verify_endpoint(
            endpoint,
            model,
            api_key,
            timeout_s=inputs.timeout_s,
            retry_window_s=inputs.retry_window_s,
            min_decode_tokens_per_second=inputs.min_decode_tokens_per_second,
            warmup_timeout_s=inputs.warmup_timeout_s,
            expected_answer=inputs.expected_answer,
            on_progress=on_progress,
        ),
        budget,
        f"verification of {endpoint}",
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
        inputs = read_inputs(props)
        echoed = {k: v for k, v in inputs.to_props().items() if k in INPUT_KEYS}
        try:
            return {**echoed, **run_verification(inputs, log_progress)}
        except VerificationFailed as failed:
            raise VerificationFailed(with_rollback_hint(str(failed), inputs.rollback_command)) from None


def with_rollback_hint(message: str, command: str) -> str:
    """A failed verification's message, ending with the way back when the program gave one."""
    if not command:
        return message
    return f"{message}. To go back to the last verified deployment: {command}"


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
        props = {**props_of(args), **dict.fromkeys(OUTPUT_KEYS)}
        secret = pulumi.ResourceOptions(additional_secret_outputs=secret_outputs(args))
        super().__init__(VerifierProvider(), name, props, pulumi.ResourceOptions.merge(secret, opts))
