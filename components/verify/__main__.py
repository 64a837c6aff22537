"""`python -m components.verify --endpoint URL --model NAME`: the operator's one-line check (exit 0 verified)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
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
from components.verify.verdict import DECODE_PROBE_PROMPTS, Failed

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
    parser.add_argument("--endpoint", required=True, help="OpenAI base URL, e.g. http://HEAD:8888/v1")
    parser.add_argument("--model", required=True, help="served model name")
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


def main(argv: Sequence[str] | None = None) -> int:
    try:
        options = _parser().parse_args(argv)
        api_key: str | None = None
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
