"""`dsv41-exl3 logs`: the docker logs command each flag builds, node aliases, refused values, exit codes."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from components import scripts
from components.operator.logs import docker_logs_script, main
from components.operator.stack_view import OperatorError, StackView
from tests.operator import stacks
from tests.operator.stacks import HEAD_CONTAINER, SSH_KEY_BODY, WORKER_CONTAINER

ROOT = Path(__file__).resolve().parents[2]


class FakeExec:
    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> int:
        self.calls.append(argv)
        return self.code


def _logs(
    capsys: pytest.CaptureFixture[str], *args: str, view: StackView | None = None, code: int = 0
) -> tuple[int, list[list[str]], str]:
    the_view = view or stacks.view()
    fake = FakeExec(code)
    rc = main(["--stack", stacks.STACK, *args], read=lambda name: the_view, exec_=fake)
    _, err = capsys.readouterr()
    return rc, fake.calls, err


def _remote(argv: list[str]) -> str:
    """The script ssh hands the node (ssh_argv wraps it as `exec sh -c <script>`, components/scripts.py)."""
    words = shlex.split(argv[-1])
    assert words[:3] == ["exec", "sh", "-c"] and argv[-1] == scripts.sh_command(words[3]), argv[-1]
    return words[3]


@pytest.mark.parametrize(
    "flags, command",
    [
        ([], f"docker logs --timestamps {HEAD_CONTAINER}"),
        (["--follow"], f"docker logs --follow --timestamps {HEAD_CONTAINER}"),
        (["-f"], f"docker logs --follow --timestamps {HEAD_CONTAINER}"),
        (["--since", "10m"], f"docker logs --since 10m --timestamps {HEAD_CONTAINER}"),
        (
            ["--since", "2025-01-31T12:00:00Z"],
            f"docker logs --since 2025-01-31T12:00:00Z --timestamps {HEAD_CONTAINER}",
        ),
        (
            ["--since", "2025-01-31T12:00:00.5+01:00"],
            f"docker logs --since 2025-01-31T12:00:00.5+01:00 --timestamps {HEAD_CONTAINER}",
        ),
        (["--tail", "200"], f"docker logs --tail 200 --timestamps {HEAD_CONTAINER}"),
        (["--tail", "0"], f"docker logs --tail 0 --timestamps {HEAD_CONTAINER}"),
        (["--tail", "all"], f"docker logs --tail all --timestamps {HEAD_CONTAINER}"),
        (
            ["--tail", "50", "--since", "2h", "--follow"],
            f"docker logs --follow --since 2h --tail 50 --timestamps {HEAD_CONTAINER}",
        ),
    ],
)
def test_each_flag_reaches_docker_logs_on_the_node(
    capsys: pytest.CaptureFixture[str], flags: list[str], command: str
) -> None:
    rc, calls, err = _logs(capsys, "spark-head", *flags)
    assert (rc, err) == (0, "")
    (argv,) = calls
    assert _remote(argv) == command


def test_logs_go_over_the_stacks_ssh_options_to_the_node(capsys: pytest.CaptureFixture[str]) -> None:
    view = stacks.view()
    _, (argv,), _ = _logs(capsys, "spark-worker", view=view)
    assert argv[0] == "ssh" and argv[-2] == "me@10.0.0.2"
    assert argv[-1] == scripts.sh_command(f"docker logs --timestamps {WORKER_CONTAINER}")
    assert argv[argv.index("-i") + 1].startswith(view.stack_dir + "/")
    assert SSH_KEY_BODY not in " ".join(argv)


@pytest.mark.parametrize(
    "alias, host, container", [("head", "10.0.0.1", HEAD_CONTAINER), ("worker", "10.0.0.2", WORKER_CONTAINER)]
)
def test_head_and_worker_name_the_first_and_second_node(
    capsys: pytest.CaptureFixture[str], alias: str, host: str, container: str
) -> None:
    _, (argv,), _ = _logs(capsys, alias)
    assert argv[-2] == f"me@{host}" and _remote(argv).endswith(container)


def test_the_container_is_the_stacks_output(capsys: pytest.CaptureFixture[str]) -> None:
    view = stacks.view(stacks.outputs(containers={"spark-head": "renamed-head", "spark-worker": "renamed-worker"}))
    _, (argv,), _ = _logs(capsys, "worker", view=view)
    assert _remote(argv) == "docker logs --timestamps renamed-worker"


def test_an_unknown_node_exits_2_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    rc, calls, err = _logs(capsys, "spark-third")
    assert (rc, calls) == (2, [])
    assert err == (
        "error: stack 'opstest' has no node 'spark-third': its nodes are spark-head, spark-worker (or head, worker)\n"
    )


def test_worker_on_a_one_node_stack_is_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    two = stacks.view()
    # Config refuses one node (tensor parallel needs 2, 4 or 8): a view with the head alone, built past it.
    view = dataclasses.replace(two, settings=two.settings.model_copy(update={"nodes": two.settings.nodes[:1]}))
    rc, calls, err = _logs(capsys, "worker", view=view)
    assert (rc, calls) == (2, [])
    assert "its nodes are spark-head (or head)" in err


@pytest.mark.parametrize("since", ["5 minutes", "10", "1d", "-1h", "10m; reboot", "2025-01-31", "yesterday"])
def test_a_bad_since_is_refused_with_the_value_and_the_fix(capsys: pytest.CaptureFixture[str], since: str) -> None:
    rc, calls, err = _logs(capsys, "head", f"--since={since}")
    assert (rc, calls) == (2, [])
    assert f"--since {since!r} is not a docker duration" in err
    assert "e.g. 30s, 10m, 2h" in err and "2025-01-31T12:00:00Z" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("tail", ["-1", "ten", "1.5", "all; id"])
def test_a_bad_tail_is_refused(capsys: pytest.CaptureFixture[str], tail: str) -> None:
    rc, calls, err = _logs(capsys, "head", f"--tail={tail}")
    assert (rc, calls) == (2, [])
    assert f"--tail {tail!r} is not a line count" in err and "`all`" in err


def test_a_bad_flag_is_refused_before_the_stack_is_read(capsys: pytest.CaptureFixture[str]) -> None:
    def read(name: str) -> StackView:
        raise AssertionError("read")

    assert main(["--stack", "s", "head", "--since", "soon"], read=read, exec_=FakeExec()) == 2


def test_values_are_quoted_for_the_shell() -> None:
    assert docker_logs_script("c", follow=False, since=None, tail=None) == "docker logs --timestamps c"
    with pytest.raises(OperatorError):
        docker_logs_script("c", follow=False, since="1h && reboot", tail=None)
    assert docker_logs_script("odd name", follow=False, since=None, tail=None).endswith("'odd name'")


def test_the_remote_exit_code_is_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert _logs(capsys, "head", code=1)[0] == 1
    assert _logs(capsys, "head", code=255)[0] == 255


def test_an_unknown_stack_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def read(name: str) -> StackView:
        raise OperatorError(f"cannot read stack {name!r}: error: no stack named '{name}' found")

    fake = FakeExec()
    assert main(["--stack", "nope", "head"], read=read, exec_=fake) == 2
    assert fake.calls == []
    assert capsys.readouterr().err == "error: cannot read stack 'nope': error: no stack named 'nope' found\n"


def test_missing_node_argument_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--stack", "s"], read=lambda n: stacks.view(), exec_=FakeExec()) == 2
    assert "NODE" in capsys.readouterr().err


def test_no_ssh_on_path_and_ctrl_c_are_handled(capsys: pytest.CaptureFixture[str]) -> None:
    def absent(argv: list[str]) -> int:
        raise FileNotFoundError(2, "No such file or directory", "ssh")

    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt

    view = stacks.view()
    assert main(["--stack", "s", "head"], read=lambda n: view, exec_=absent) == 1
    assert "no `ssh` on PATH" in capsys.readouterr().err
    assert main(["--stack", "s", "head", "-f"], read=lambda n: view, exec_=interrupted) == 130
