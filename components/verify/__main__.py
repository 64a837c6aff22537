"""The operator's one-line check (exit 0 verified):

    python -m components.verify --stack NAME            # endpoint, model, API key and expected answer from the stack
    python -m components.verify --endpoint URL --model NAME [--api-key-env VAR] [--expected-answer WORD]

With `--stack`, the endpoint, model and API key (the `apiKey` output: the generated key, or yours) come from the
stack's outputs and `gates.expectedAnswer`
from its config (Automation API, read only: nothing is changed); an explicit flag wins over the stack's value.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.verify.client import (
    GUARD_MARGIN_S,
    Passed,
    VerificationTimeout,
    normalize_endpoint,
    run_bounded,
    verify_endpoint,
    worst_case_seconds,
)
from components.verify.verdict import DECODE_PROBE_PROMPTS, VERIFY_EXPECTED, Failed

EXIT_VERIFIED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class _UsageError(Exception):
    pass


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's default prints the whole usage block
        if message.startswith("unrecognized arguments"):
            # never echo stray arguments: one of them may be a key typed on the command line
            message = "unrecognized arguments (not shown); the API key is read only via --api-key-env VAR"
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m components.verify",
        allow_abbrev=False,  # `--api-key SECRET` must not be taken for `--api-key-env`
        description="Send the recipe's logprobs request and say in one line whether the endpoint computes.",
    )
    parser.add_argument(
        "--stack",
        metavar="NAME",
        help="read endpoint, model, API key and expected answer from "
        'this stack of the project (run in the project\'s environment: eval "$(make -s env)")',
    )
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
class StackView:
    """What the check needs from a deployed stack."""

    endpoint: str | None
    model: str | None
    api_key: str | None
    expected_answer: str | None


def read_stack(name: str) -> StackView:
    """The stack's outputs and the two config values, read through the Automation API (never written)."""
    from pulumi import automation as auto

    from components.config import NAMESPACE, OPEN_ENDPOINT

    work_dir = str(Path(__file__).resolve().parents[2])
    try:
        stack = auto.select_stack(name, work_dir=work_dir)
        outputs = stack.outputs()
        config = stack.get_all_config()
    except auto.errors.CommandError as error:
        first = next((line for line in str(error).splitlines() if "error:" in line), str(error).splitlines()[0])
        raise _UsageError(f"cannot read stack {name!r}: {first.strip()}") from None

    def output(key: str) -> str | None:
        value = outputs.get(key)
        return str(value.value) if value is not None and value.value is not None else None

    def setting(path: str, leaf: str) -> Any:
        whole = config.get(f"{NAMESPACE}:{path}")
        if whole is not None:  # a section set as one JSON value
            try:
                return json.loads(whole.value).get(leaf)
            except (ValueError, AttributeError):
                return None
        item = config.get(f"{NAMESPACE}:{path}.{leaf}")
        return item.value if item is not None else None

    # The deployed key (the generated one when the config has none); `none` in the config: an open endpoint.
    configured = setting("serve", "apiKey")
    key = None if configured == OPEN_ENDPOINT else output("apiKey") or configured
    answer = setting("gates", "expectedAnswer")
    return StackView(
        endpoint=output("endpoint"),
        model=output("model"),
        api_key=str(key) if key else None,
        expected_answer=None if answer is None else str(answer),
    )


def main(argv: Sequence[str] | None = None, read: Callable[[str], StackView] = read_stack) -> int:
    try:
        options = _parser().parse_args(argv)
        view = read(options.stack) if options.stack else StackView(None, None, None, None)
        options.endpoint = options.endpoint or view.endpoint
        options.model = options.model or view.model
        if not options.endpoint or not options.model:
            where = (
                f"stack {options.stack!r} has no endpoint/model output yet (run `pulumi up`)"
                if options.stack
                else "give --stack NAME, or --endpoint and --model"
            )
            raise _UsageError(where)
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
    except (_UsageError, ValueError) as error:
        print(f"usage error: {error} (see --help)", file=sys.stderr)
        return EXIT_USAGE
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
        print(f"NOT verified (timeout): {error}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(outcome, Failed):
        print(f"NOT verified ({outcome.reason}): {outcome.message}", file=sys.stderr)
        return EXIT_FAILED
    print(_format_passed(endpoint, options.model, outcome))
    return EXIT_VERIFIED


if __name__ == "__main__":
    sys.exit(main())
