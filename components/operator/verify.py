"""`dsv41-exl3 verify`: the recipe's logprobs request, in one line (exit 0 verified):

    dsv41-exl3 verify [--stack NAME] [--json]     # endpoint, model, API key and expected answer from the stack
    dsv41-exl3 verify --endpoint URL --model NAME [--api-key-env VAR] [--expected-answer WORD]

Without `--endpoint` and `--model`, they, the API key (the `apiKey` output: the generated key, or yours) and
`gates.expectedAnswer` come from the stack (the selected one unless `--stack` names another; read only: nothing
is changed); an explicit flag wins over the stack's value.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from components.operator.exits import Exit
from components.operator.stack_view import OperatorError, api_key_of, read_stack
from components.verify.client import (
    GUARD_MARGIN_S,
    Passed,
    VerificationTimeout,
    normalize_endpoint,
    run_bounded,
    verify_endpoint,
    worst_case_seconds,
)
from components.verify.verdict import DECODE_PROBE_PROMPTS, VERIFY_EXPECTED, Failed, Reason


class _UsageError(Exception):
    pass


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's default prints the whole usage block
        if message.startswith("unrecognized arguments"):
            # never echo stray arguments: one of them may be a key typed on the command line
            message = "unrecognized arguments (not shown); the API key is read only via --api-key-env VAR"
        raise _UsageError(message)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=prog,
        allow_abbrev=False,  # `--api-key SECRET` must not be taken for `--api-key-env`
        description="Send the recipe's logprobs request and say in one line whether the endpoint computes.",
    )
    parser.add_argument(
        "--stack",
        metavar="NAME",
        help="read endpoint, model, API key and expected answer from this stack (default: the selected one; "
        'run in the project\'s environment: eval "$(make -s env)")',
    )
    parser.add_argument("--json", action="store_true", help="the verdict as one JSON object on stdout")
    parser.add_argument("--endpoint", help="OpenAI base URL, e.g. http://HEAD:8888/v1")
    parser.add_argument("--model", help="served model name")
    parser.add_argument(
        "--expected-answer",
        metavar="WORD",
        help=f"what the answer must say (default: the stack's gates.expectedAnswer, else "
        f"{VERIFY_EXPECTED!r}; empty: logprobs only)",
    )
    parser.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS", help="per-request timeout")
    parser.add_argument(
        "--retry-window", type=float, default=0.0, metavar="SECONDS", help="keep retrying while the API starts"
    )
    parser.add_argument(
        "--min-decode-tokens-per-second", type=float, metavar="RATE", help="also run the decode-speed probe"
    )
    return parser


def _format_passed(endpoint: str, model: str, passed: Passed) -> str:
    pairs = json.dumps([[item.token, item.logprob] for item in passed.logprobs], ensure_ascii=False)
    line = (
        f"verified {endpoint} model {model!r}: answer {json.dumps(passed.answer, ensure_ascii=False)} "
        f"logprobs {pairs} latency {passed.latency_s:.2f}s"
    )
    if passed.decode_tokens_per_second is not None:
        line += f" decode {passed.decode_tokens_per_second:.1f} tok/s"
    return line


@dataclass(frozen=True)
class Target:
    """What the check needs from a deployed stack."""

    endpoint: str | None
    model: str | None
    api_key: str | None
    expected_answer: str | None


def read_target(name: str | None) -> Target:
    """The stack's endpoint, model and key outputs and its `gates.expectedAnswer` (components/operator/stack_view)."""
    view = read_stack(name)
    endpoint, model = view.outputs.get("endpoint"), view.outputs.get("model")
    return Target(
        endpoint=str(endpoint) if endpoint else None,
        model=str(model) if model else None,
        api_key=api_key_of(view),
        expected_answer=view.settings.gates.expected_answer,
    )


def _as_json(endpoint: str, model: str, outcome: Passed | Failed) -> str:
    data: dict[str, Any] = {"verified": isinstance(outcome, Passed), "endpoint": endpoint, "model": model}
    if isinstance(outcome, Passed):
        data.update(
            answer=outcome.answer,
            logprobs=[[item.token, item.logprob] for item in outcome.logprobs],
            latency_s=round(outcome.latency_s, 3),
            decode_tokens_per_second=outcome.decode_tokens_per_second,
        )
    else:
        data.update(reason=outcome.reason, message=outcome.message)
    return json.dumps(data, ensure_ascii=False, sort_keys=True)


def main(
    argv: Sequence[str] | None = None,
    read: Callable[[str | None], Target] = read_target,
    prog: str = "dsv41-exl3 verify",
) -> int:
    try:
        options = _parser(prog).parse_args(argv)
        # The stack is read when named, or when no endpoint is given; `--endpoint` alone checks any server.
        from_stack = options.stack or not options.endpoint
        if not from_stack and not options.model:
            raise _UsageError("--endpoint needs --model (or --stack NAME to read both from a stack)")
        view = read(options.stack) if from_stack else Target(None, None, None, None)
        options.endpoint = options.endpoint or view.endpoint
        options.model = options.model or view.model
        if not options.endpoint or not options.model:
            raise _UsageError(
                f"stack {options.stack or '(selected)'} has no endpoint/model output yet (run `pulumi up`)"
            )
        expected = options.expected_answer
        if expected is None:
            expected = view.expected_answer if view.expected_answer is not None else VERIFY_EXPECTED
        api_key: str | None = view.api_key
        if options.api_key_env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", options.api_key_env):
                raise _UsageError("--api-key-env takes an environment variable NAME (value not shown), not a key")
            api_key = os.environ.get(options.api_key_env)
            if not api_key:
                raise _UsageError(f"--api-key-env names {options.api_key_env}, which is not set or empty")
        if options.timeout <= 0 or options.retry_window < 0:
            raise _UsageError(f"--timeout must be > 0 and --retry-window >= 0, got {options.timeout:g}")
        endpoint = normalize_endpoint(options.endpoint)
    except (_UsageError, OperatorError, ValueError) as error:
        print(f"usage error: {error} (see --help)", file=sys.stderr)
        return Exit.USAGE
    probe_prompts = len(DECODE_PROBE_PROMPTS) if options.min_decode_tokens_per_second is not None else 0
    budget = worst_case_seconds(options.timeout, options.retry_window, probe_prompts) + GUARD_MARGIN_S
    try:
        outcome = run_bounded(
            lambda: verify_endpoint(
                endpoint,
                options.model,
                api_key,
                timeout_s=options.timeout,
                retry_window_s=options.retry_window,
                min_decode_tokens_per_second=options.min_decode_tokens_per_second,
                expected_answer=expected,
            ),
            budget,
            f"verification of {endpoint}",
        )
    except VerificationTimeout as error:
        outcome = Failed(Reason.TIMEOUT, str(error))
    if options.json:
        print(_as_json(endpoint, options.model, outcome))
    elif isinstance(outcome, Failed):
        print(f"NOT verified ({outcome.reason}): {outcome.message}", file=sys.stderr)
    else:
        print(_format_passed(endpoint, options.model, outcome))
    return Exit.OK if isinstance(outcome, Passed) else Exit.FAILED
