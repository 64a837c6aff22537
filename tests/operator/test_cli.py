"""`dsv41-exl3 VERB`: every verb's parsing through the one command, its `--json` shape, the exit codes, the selected
stack as the default, the installed script, and the old module paths for one release."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pulumi import automation as auto

from components.operator import cli, rollback, stack_view, supervisor
from components.operator import verify as verify_verb
from components.operator.exits import MEANING, Exit
from components.operator.stack_view import OperatorError
from tests.operator import stacks
from tests.rollback.test_rollback_cli import FakeStack, history
from tests.support.fake_vllm import NAN_STREAM_ERROR, FakeVllm, Reply, chat_body, good_items

ROOT = Path(__file__).resolve().parents[2]


def _help_of(verb: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([verb, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("verb", list(cli.VERBS))
def test_every_verb_parses_its_own_flags_under_the_one_commands_name(
    verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _help_of(verb, capsys)
    assert text.startswith(f"usage: dsv41-exl3 {verb} ")
    # A verb that prints state has --json; every verb but discover (no stack yet) reads --stack, optional.
    if verb != "logs":
        assert "--json" in text
    if verb != "discover":
        assert "[--stack NAME]" in text or "--stack STACK" in text, text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["status", "--interval", "0"], "--interval 0 must be"),
        (["logs"], "the following arguments are required: NODE"),
        (["logs", "head", "--since", "soon"], "soon"),
        (["verify", "--endpoint", "http://x/v1", "--model", "m", "--timeout", "0"], "--timeout must be > 0"),
        (["rollback", "--json"], "--json goes with --list"),
        (["supervisor", "reboot"], "invalid choice: 'reboot'"),
        (["discover"], "the following arguments are required"),
        (["discover", "10.0.0.1"], "has no user"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2_before_any_stack_is_read(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_stack(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a bad flag must be refused before the stack is read")

    monkeypatch.setattr(auto, "select_stack", no_stack)
    monkeypatch.setattr(auto, "LocalWorkspace", no_stack)
    assert cli.main(argv) == Exit.USAGE == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_no_verb_or_an_unknown_one_shows_the_verbs_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == Exit.USAGE
    text = capsys.readouterr().out
    assert all(f"dsv41-exl3 {verb} " in text for verb in cli.VERBS)
    assert all(f"{code.value:<3} {MEANING[code]}" in text for code in Exit)
    assert cli.main(["--help"]) == Exit.OK
    assert cli.main(["stauts"]) == Exit.USAGE
    assert "has no verb 'stauts': one of status, logs, verify" in capsys.readouterr().err


class Picked(Exception):
    pass


def test_every_stack_verb_reads_the_selected_stack_when_no_stack_is_given() -> None:
    seen: list[str | None] = []

    def read(name: str | None) -> Any:
        seen.append(name)
        raise OperatorError("stop here")

    from components.operator import logs, status

    assert status.main(["--json"], read=read) == Exit.USAGE
    assert logs.main(["head"], read=read) == Exit.USAGE
    assert verify_verb.main([], read=read) == Exit.USAGE
    assert supervisor.main(["status"], read=read) == Exit.USAGE
    assert seen == [None, None, None, None]

    opened: list[str] = []

    def open_(name: str) -> Any:
        opened.append(name)
        raise OperatorError("stop here")

    assert rollback.main(["--list"], open_=open_, selected=lambda: "picked") == Exit.USAGE
    assert opened == ["picked"]


def test_no_stack_name_resolves_to_the_one_pulumi_stack_select_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    class Workspace:
        current: Any = auto.StackSummary("sparks", None, True, None, None, None)

        def __init__(self, work_dir: str) -> None:
            assert work_dir == str(stack_view.REPO_ROOT)

        def stack(self) -> Any:
            return self.current

    monkeypatch.setattr(auto, "LocalWorkspace", Workspace)
    assert stack_view.selected_stack() == "sparks"
    Workspace.current = None
    with pytest.raises(OperatorError, match=r"no stack is selected: give --stack NAME, or run `pulumi stack select"):
        stack_view.selected_stack()


# --- --json shapes ------------------------------------------------------------------------------------------------


def test_verify_json_is_one_object_passed_or_failed(capsys: pytest.CaptureFixture[str]) -> None:
    target = verify_verb.Target(endpoint=None, model="m", api_key=None, expected_answer="")
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as server:
        # The endpoint from the flag, the model and the expected answer (none) from the stack.
        argv = ["--json", "--stack", "dev", "--endpoint", server.url, "--timeout", "3"]
        assert verify_verb.main(argv, read=lambda _: target) == Exit.OK
    passed = json.loads(capsys.readouterr().out)
    assert set(passed) == {
        "verified",
        "endpoint",
        "model",
        "answer",
        "logprobs",
        "latency_s",
        "decode_tokens_per_second",
    }
    assert passed["verified"] is True and passed["model"] == "m" and passed["logprobs"][0][1] < 0
    with FakeVllm(Reply(body=NAN_STREAM_ERROR.encode())) as server:
        argv = ["--json", "--endpoint", server.url, "--model", "m", "--timeout", "3"]
        assert verify_verb.main(argv) == Exit.FAILED
    failed = json.loads(capsys.readouterr().out)
    assert set(failed) == {"verified", "endpoint", "model", "reason", "message"} and failed["verified"] is False


def test_rollback_list_json_is_the_history_newest_first(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = rollback.main(["--stack", "dev", "--list", "--json"], open_=lambda _: FakeStack(history()), root=tmp_path)
    assert code == Exit.OK
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["verified"]) for r in rows] == [(3, False), (2, False), (1, True)]
    assert set(rows[0]) == {"version", "kind", "result", "started", "message", "verified"}


class Session:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body, self.calls = body, []

    def _reply(self, method: str, url: str, **kwargs: Any) -> Any:
        self.calls.append((method, url, kwargs["headers"]))
        body = self.body

        class Reply:
            status_code = 200

            def json(self) -> dict[str, Any]:
                return body

        return Reply()

    def get(self, url: str, **kwargs: Any) -> Any:
        return self._reply("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> Any:
        return self._reply("POST", url, **kwargs)


def test_supervisor_json_is_the_agents_answer_for_every_action(capsys: pytest.CaptureFixture[str]) -> None:
    read = lambda _: (stacks.SUPERVISOR_URL, stacks.SUPERVISOR_TOKEN)  # noqa: E731
    http = Session({"paused": True, "node": "spark-head"})
    assert supervisor.main(["pause", "--json"], read=read, session=http) == Exit.OK  # type: ignore[arg-type]
    assert json.loads(capsys.readouterr().out) == {"paused": True, "node": "spark-head"}
    assert http.calls == [
        ("POST", f"{stacks.SUPERVISOR_URL}/pause", {"Authorization": f"Bearer {stacks.SUPERVISOR_TOKEN}"})
    ]
    assert supervisor.main(["status", "--json"], read=read, session=http) == Exit.OK  # type: ignore[arg-type]
    assert json.loads(capsys.readouterr().out)["node"] == "spark-head"


# --- the installed command and the old paths ----------------------------------------------------------------------


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


def test_the_venv_installs_the_command_and_python_dash_m_components_is_the_same() -> None:
    script = Path(sys.executable).with_name("dsv41-exl3")
    assert script.is_file(), "make venv installs the project editable, which makes the script"
    installed, module = _run(str(script), "--help"), _run(sys.executable, "-m", "components", "--help")
    assert installed.returncode == module.returncode == 0, installed.stderr + module.stderr
    assert installed.stdout == module.stdout and "verbs:" in installed.stdout


@pytest.mark.parametrize(
    "old, verb", [("status", "status"), ("logs", "logs"), ("verify", "verify"), ("rollback", "rollback"),
                  ("supervisor", "supervisor"), ("discover", "discover")],
)  # fmt: skip
def test_an_old_module_path_says_what_replaced_it_then_runs_the_verb(old: str, verb: str) -> None:
    done = _run(sys.executable, "-m", f"components.{old}", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(f"note: `python -m components.{old}` is now `dsv41-exl3 {verb}`")
    assert done.stdout.startswith(f"usage: dsv41-exl3 {verb} ")
