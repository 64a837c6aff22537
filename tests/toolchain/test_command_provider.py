"""Our command provider through the real engine: Automation API, inline programs, a throwaway sshd."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pulumi
import pytest
from conftest import Sshd
from pulumi import automation as auto
from pulumi_command import local, remote

pytestmark = pytest.mark.engine

SECRET_STDIN = "stdin-" + uuid.uuid4().hex
SECRET_ENV = "env-" + uuid.uuid4().hex
ENGINE_RPC_TRACE = re.compile(r'"msg":"(Unm|M)arshaling property for RPC\[.*\]: \w+=\{')


def conn(sshd: Sshd, **extra: object) -> remote.ConnectionArgs:
    return remote.ConnectionArgs(
        host=sshd.host,
        port=sshd.port,
        user=sshd.user,
        private_key=sshd.private_key,
        host_key=sshd.host_public_key,
        **extra,
    )  # type: ignore[arg-type]


@pytest.fixture
def make_stack(pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., auto.Stack]]:
    """make_stack(program) -> a fresh stack; the program can be swapped with stack.workspace.program."""
    stacks: list[auto.Stack] = []

    def make(program: Callable[[], None]) -> auto.Stack:
        work = tmp_path / f"work-{len(stacks)}"
        work.mkdir()
        stack = auto.create_stack(
            f"cmd-{uuid.uuid4().hex[:8]}",
            project_name="command-provider-test",
            program=program,
            opts=auto.LocalWorkspaceOptions(
                work_dir=str(work), env_vars=engine_env, pulumi_command=auto.PulumiCommand(root=str(pulumi_root))
            ),
        )
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        with contextlib.suppress(auto.CommandError):
            stack.destroy(on_output=lambda _l: None)
        stack.workspace.remove_stack(stack.name, force=True)


def up(stack: auto.Stack, program: Callable[[], None] | None = None, **kw: object) -> auto.UpResult:
    if program is not None:
        stack.workspace.program = program
    lines: list[str] = []
    try:
        return stack.up(on_output=lines.append, **kw)  # type: ignore[arg-type]
    except auto.CommandError as e:
        raise AssertionError(f"up failed:\n{''.join(lines)}\n{e}") from e


def test_remote_create_update_delete_with_env_and_stdin(
    make_stack: Callable[..., auto.Stack], sshd: Sshd, tmp_path: Path
) -> None:
    d = tmp_path / "remote"
    d.mkdir()

    def program(version: str) -> Callable[[], None]:
        def p() -> None:
            c = remote.Command(
                "c",
                connection=conn(sshd),
                environment={"DSV41_VERSION": version, "DSV41_DIR": str(d)},
                stdin=f"stdin-{version}\n",
                create='echo "create $DSV41_VERSION" >> "$DSV41_DIR/log"; '
                'cat > "$DSV41_DIR/stdin"; echo made-$DSV41_VERSION',
                update='echo "update $DSV41_VERSION prev=$PULUMI_COMMAND_STDOUT" >> "$DSV41_DIR/log"; '
                'cat > "$DSV41_DIR/stdin"; echo updated-$DSV41_VERSION',
                delete='echo "delete prev=$PULUMI_COMMAND_STDOUT" >> "$DSV41_DIR/log"',
            )
            pulumi.export("stdout", c.stdout)

        return p

    stack = make_stack(program("v1"))
    first = up(stack)
    assert first.outputs["stdout"].value == "made-v1"
    assert (d / "log").read_text() == "create v1\n"
    assert (d / "stdin").read_text() == "stdin-v1\n"

    second = up(stack, program("v2"))
    assert second.summary.resource_changes == {"update": 1, "same": 1}
    assert second.outputs["stdout"].value == "updated-v2"
    assert (d / "log").read_text() == "create v1\nupdate v2 prev=made-v1\n"
    assert (d / "stdin").read_text() == "stdin-v2\n"

    stack.destroy(on_output=lambda _l: None)
    assert (d / "log").read_text().splitlines()[-1] == "delete prev=updated-v2"


def test_failing_command_fails_with_its_stderr(make_stack: Callable[..., auto.Stack], sshd: Sshd) -> None:
    def program(update: str) -> Callable[[], None]:
        def p() -> None:
            remote.Command("c", connection=conn(sshd), create="true", update=update, environment={"DSV41_X": update})

        return p

    stack = make_stack(program("true"))
    up(stack)
    marker = "boom-" + uuid.uuid4().hex[:8]
    stack.workspace.program = program(f"echo {marker} >&2; exit 3")
    with pytest.raises(auto.CommandError) as failed:
        stack.up(on_output=lambda _l: None)
    assert marker in str(failed.value)
    assert "exit status 3" in str(failed.value)


def test_triggers_change_replaces_and_reruns_create(
    make_stack: Callable[..., auto.Stack], sshd: Sshd, tmp_path: Path
) -> None:
    log = tmp_path / "creates"

    def program(trigger: str) -> Callable[[], None]:
        def p() -> None:
            remote.Command("c", connection=conn(sshd), triggers=[trigger], create=f"echo {trigger} >> {log}")

        return p

    stack = make_stack(program("one"))
    up(stack)
    stack.workspace.program = program("two")
    preview = stack.preview(diff=True, on_output=lambda _l: None)
    assert preview.change_summary.get("replace") == 1, preview.change_summary
    result = up(stack)
    assert result.summary.resource_changes.get("replace") == 1
    assert log.read_text() == "one\ntwo\n"


def export_without_secrets(stack: auto.Stack, pulumi_root: Path, env: dict[str, str]) -> str:
    """`pulumi stack export` as a user runs it (the Automation API's export_stack adds --show-secrets)."""
    out = subprocess.run(
        [str(pulumi_root / "bin" / "pulumi"), "stack", "export", "--stack", stack.name],
        cwd=stack.workspace.work_dir,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_secret_stdin_and_environment_never_plain(
    make_stack: Callable[..., auto.Stack], sshd: Sshd, tmp_path: Path, pulumi_root: Path, engine_env: dict[str, str]
) -> None:
    d = tmp_path / "secret"
    d.mkdir()

    def program() -> None:
        remote.Command(
            "c",
            connection=conn(sshd),
            stdin=pulumi.Output.secret(SECRET_STDIN),
            environment={"DSV41_TOKEN": pulumi.Output.secret(SECRET_ENV), "DSV41_DIR": str(d)},
            create='cat > "$DSV41_DIR/stdin"; printf %s "$DSV41_TOKEN" > "$DSV41_DIR/env"; echo done',
        )
        local.Command("l", stdin=pulumi.Output.secret(SECRET_STDIN), create="wc -c")

    stack = make_stack(program)
    lines: list[str] = []
    result = stack.up(on_output=lines.append, log_verbosity=9, log_to_std_err=True, debug=True)
    # Delivered ...
    assert (d / "stdin").read_text() == SECRET_STDIN
    assert (d / "env").read_text() == SECRET_ENV
    # ... but never in plain text in the state or the engine's verbose log.
    exported = export_without_secrets(stack, pulumi_root, engine_env)
    log = "".join(lines) + result.stderr
    assert "Provider[command" in log or "command:remote:Command" in log, "the verbose engine log is missing"
    assert len(log) > 20_000, f"the engine log is not verbose ({len(log)} chars)"
    for secret in (SECRET_STDIN, SECRET_ENV):
        assert secret not in exported, _context(exported, secret)
        # The engine's own gRPC trace (-v=9 only) prints every property it marshals, secrets' plaintext
        # included, before and after any provider sees them; that is the engine's, not the provider's.
        leaks = [line for line in log.splitlines() if secret in line and not ENGINE_RPC_TRACE.search(line)]
        assert not leaks, _context("\n".join(leaks), secret)
    resources = {r["urn"].rsplit("::", 1)[-1]: r for r in json.loads(exported)["deployment"]["resources"]}
    secret_sig = "1b47061264138c4ac30d75fd1eb44270"
    assert resources["c"]["outputs"]["stdin"].get("4dabf18193072939515e22adb298388d") == secret_sig
    assert resources["c"]["outputs"]["environment"]["DSV41_TOKEN"].get("4dabf18193072939515e22adb298388d") == secret_sig
    assert resources["c"]["outputs"]["connection"].get("4dabf18193072939515e22adb298388d") == secret_sig
    assert "done" in json.dumps(resources["c"]["outputs"]["stdout"])


def _context(text: str, secret: str) -> str:
    i = text.index(secret)
    return f"{secret!r} in plain text: ...{text[max(0, i - 400) : i + 100]}..."


def test_wrong_host_key_is_refused(make_stack: Callable[..., auto.Stack], sshd: Sshd, tmp_path: Path) -> None:
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = " ".join((tmp_path / "other.pub").read_text().split()[:2])

    def program() -> None:
        c = remote.ConnectionArgs(
            host=sshd.host,
            port=sshd.port,
            user=sshd.user,
            private_key=sshd.private_key,
            host_key=wrong,
            dial_error_limit=0,
        )
        remote.Command("c", connection=c, create="true")

    stack = make_stack(program)
    with pytest.raises(auto.CommandError) as failed:
        stack.up(on_output=lambda _l: None)
    assert "host key mismatch" in str(failed.value)


def test_local_command_create(make_stack: Callable[..., auto.Stack], tmp_path: Path) -> None:
    d = tmp_path / "local"
    d.mkdir()

    def program() -> None:
        c = local.Command(
            "l",
            dir=str(d),
            environment={"DSV41_WHO": "local"},
            stdin="in",
            create='cat > stdin.txt; echo "$DSV41_WHO" > who.txt; pwd',
            asset_paths=["*.txt"],
        )
        pulumi.export("stdout", c.stdout)
        pulumi.export("assets", c.assets.apply(lambda a: sorted(a or {})))

    result = up(make_stack(program))
    assert result.outputs["stdout"].value == str(d)
    assert (d / "who.txt").read_text() == "local\n"
    assert (d / "stdin.txt").read_text() == "in"
    assert result.outputs["assets"].value == ["stdin.txt", "who.txt"]


def test_copy_to_remote_string_and_file(make_stack: Callable[..., auto.Stack], sshd: Sshd, tmp_path: Path) -> None:
    src = tmp_path / "payload.txt"
    src.write_text("file payload\n")
    dest = tmp_path / "copied"

    def program() -> None:
        remote.CopyToRemote(
            "s",
            connection=conn(sshd),
            source=pulumi.StringAsset("string payload"),
            remote_path=str(dest / "sub" / "s.txt"),
        )
        remote.CopyToRemote(
            "f", connection=conn(sshd), source=pulumi.FileAsset(str(src)), remote_path=str(dest / "f.txt")
        )

    up(make_stack(program))
    assert (dest / "sub" / "s.txt").read_text() == "string payload"
    assert (dest / "f.txt").read_text() == "file payload\n"
