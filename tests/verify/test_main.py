"""The operators' command `dsv41-exl3 verify`: one line, exit 0/1/2, the key only from the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_vllm import (
    NAN_STREAM_ERROR,
    FakeVllm,
    Reply,
    chat_body,
    free_port,
    good_items,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "fake-model"
pytestmark = pytest.mark.timeout(10)


# --- operator command ---------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "components", "verify", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, **(env or {})},
    )


def _lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return (done.stdout + done.stderr).splitlines()


def test_cli_verified_prints_one_line_and_reads_the_key_from_the_environment() -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as server:
        done = _cli(
            "--endpoint",
            server.url,
            "--model",
            MODEL,
            "--api-key-env",
            "TEST_VLLM_KEY",
            "--timeout",
            "3",
            env={"TEST_VLLM_KEY": "k-env-42"},
        )
        (request,) = server.completion_requests()
    assert done.returncode == 0, done.stderr
    (line,) = _lines(done)
    assert line.startswith(f"verified {server.url} model 'fake-model': answer \"Paris.\"")
    assert '[["Paris", -0.00012], [".", -0.3817]]' in line
    assert request.headers["Authorization"] == "Bearer k-env-42"
    assert "k-env-42" not in line


def test_cli_failure_exits_1_with_one_line() -> None:
    with FakeVllm(Reply(status=500, body=NAN_STREAM_ERROR.encode(), content_type="text/plain")) as server:
        done = _cli("--endpoint", server.url, "--model", MODEL, "--timeout", "3")
    assert done.returncode == 1
    (line,) = _lines(done)
    assert line.startswith("NOT verified (nan): ") and "the model produced NaN" in line


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--endpoint", "http://127.0.0.1:9/v1"], {}, "--model"),
        (["--endpoint", "http://127.0.0.1:9", "--model", MODEL], {}, "/v1"),
        (["--endpoint", "http://127.0.0.1:9/v1", "--model", MODEL, "--api-key-env", "UNSET_KEY_VAR_X"], {}, "not set"),
        (
            ["--endpoint", "http://127.0.0.1:9/v1", "--model", MODEL, "--api-key", "sk-live-77-0123456789abcdef01234"],
            {},
            "unrecognized",
        ),
        (
            [
                "--endpoint",
                "http://127.0.0.1:9/v1",
                "--model",
                MODEL,
                "--api-key-env",
                "sk-live-77-0123456789abcdef01234",
            ],
            {},
            "NAME",
        ),
        (["--endpoint", "http://127.0.0.1:9/v1", "--model", MODEL, "--timeout", "0"], {}, "--timeout"),
    ],
    ids=[
        "missing-model",
        "endpoint-without-v1",
        "key-variable-unset",
        "key-in-argv-refused",
        "key-as-variable-name",
        "zero-timeout",
    ],
)
def test_cli_usage_errors_exit_2_with_one_line(args: list[str], env: dict[str, str], words: str) -> None:
    done = _cli(*args, env=env)
    assert done.returncode == 2
    (line,) = _lines(done)
    assert line.startswith("usage error: ") and words in line
    assert "sk-live-77-0123456789abcdef01234" not in line, "a key typed on the command line is never echoed"


def test_cli_unreachable_endpoint_exits_1() -> None:
    done = _cli("--endpoint", f"http://127.0.0.1:{free_port()}/v1", "--model", MODEL, "--timeout", "1")
    assert done.returncode == 1
    (line,) = _lines(done)
    assert line.startswith("NOT verified (unreachable): ") and "connection refused" in line


# --- --stack: the stack's endpoint, model, key and expected answer ------------------------------


def test_stack_gives_endpoint_model_key_and_expected_answer(capsys: pytest.CaptureFixture[str]) -> None:
    from components.operator import verify as cli

    with FakeVllm(Reply(body=chat_body(good_items(), content="Lyon").encode())) as server:
        view = cli.Target(endpoint=server.url, model=MODEL, api_key="k-stack-7", expected_answer="Lyon")
        code = cli.main(["--stack", "sim", "--timeout", "3"], read=lambda name: view)
        (request,) = server.completion_requests()
    assert code == cli.Exit.OK, capsys.readouterr()
    assert request.headers.get("Authorization") == "Bearer k-stack-7"
    assert request.body["model"] == MODEL
    assert "k-stack-7" not in capsys.readouterr().out


def test_stack_with_the_recipes_answer_refuses_another_and_an_explicit_flag_wins(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from components.operator import verify as cli

    with FakeVllm(Reply(body=chat_body(good_items(), content="Lyon").encode())) as server:
        view = cli.Target(endpoint=server.url, model=MODEL, api_key=None, expected_answer=None)
        assert cli.main(["--stack", "dev", "--timeout", "3"], read=lambda name: view) == cli.Exit.FAILED
        assert "does not say Paris" in capsys.readouterr().err
        assert (
            cli.main(["--stack", "dev", "--timeout", "3", "--expected-answer", "Lyon"], read=lambda name: view)
            == cli.Exit.OK
        )


def test_stack_without_outputs_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from components.operator import verify as cli

    view = cli.Target(endpoint=None, model=None, api_key=None, expected_answer=None)
    assert cli.main(["--stack", "new"], read=lambda name: view) == cli.Exit.USAGE
    assert "no endpoint/model output yet" in capsys.readouterr().err
