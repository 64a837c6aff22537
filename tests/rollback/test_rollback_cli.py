"""`dsv41-exl3 rollback` against a recording stack: what it refuses, restores, saves and runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from components.operator import rollback

NS = "dsv41-exl3"
KEY_OLD, KEY_NOW = "old-private-key", "new-private-key"
STACK_FILE = f"""config:
  {NS}:image: img:2
  {NS}:ssh:
    user: me
    privateKey:
      secure: v1:ciphertext
"""


@dataclass
class CV:
    value: str
    secret: bool = False


@dataclass
class Summary:
    version: int | None
    kind: str
    result: str
    config: dict[str, CV]
    message: str = ""
    start_time: datetime = datetime(2026, 12, 1, 12, 0)


def config(image: str, key: str) -> dict[str, CV]:
    return {f"{NS}:image": CV(image), f"{NS}:ssh": CV(json.dumps({"user": "me", "privateKey": key}), True)}


@dataclass
class FakeStack:
    summaries: list[Summary]
    config: dict[str, CV] = field(default_factory=lambda: config("img:2", KEY_NOW))
    up_fails: bool = False
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def history(self, page_size: int | None = None, page: int | None = None, show_secrets: bool = True) -> Any:
        self.calls.append(("history", show_secrets))
        return self.summaries

    def get_all_config(self) -> Any:
        return dict(self.config)

    def remove_all_config(self, keys: list[str], path: bool = False) -> None:
        self.calls.append(("remove", sorted(keys)))
        for k in keys:
            self.config.pop(k)

    def set_all_config(self, values: Any, path: bool = False) -> None:
        self.calls.append(("set", {k: (v.value, v.secret) for k, v in values.items()}, path))

    def up(self, **kwargs: Any) -> Any:
        self.calls.append(("up", kwargs.get("message")))
        if self.up_fails:
            raise RuntimeError("stderr: error: update failed\n  verification failed (nan): NaN logprob")
        return None


def history() -> list[Summary]:
    """Newest first, as the CLI lists it; numbered by the backend (Pulumi Cloud)."""
    return [
        Summary(3, "update", "in-progress", {}),
        Summary(2, "update", "failed", config("img:2", KEY_NOW)),
        Summary(1, "update", "succeeded", config("img:1", KEY_OLD)),
    ]


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "Pulumi.dev.yaml").write_text(STACK_FILE)
    monkeypatch.setenv("DSV41_STATE_HOME", str(tmp_path / "state"))
    return tmp_path


def run(stack: FakeStack, root: Path, *args: str, answer: str = "", tty: bool = False) -> int:
    return rollback.main(
        ["--stack", "dev", *args], open_=lambda _: stack, ask=lambda _: answer, interactive=lambda: tty, root=root
    )


def test_rollback_restores_the_verified_config_leafwise_and_runs_up(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = FakeStack(history())
    assert run(stack, root, "--yes") == 0
    assert ("history", True) in stack.calls  # secrets shown: they go back encrypted, through the stack
    assert ("remove", [f"{NS}:image", f"{NS}:ssh"]) in stack.calls
    sets = [c for c in stack.calls if c[0] == "set"]
    assert sets == [
        (
            "set",
            {f"{NS}:image": ("img:1", False), f"{NS}:ssh.user": ("me", False), f"{NS}:ssh.privateKey": (KEY_OLD, True)},
            True,
        )
    ]
    assert stack.calls[-1] == ("up", "rollback to version 1")
    out = capsys.readouterr()
    assert f"{NS}:image: img:2 -> img:1" in out.out and f"{NS}:ssh.privateKey: (secret, changed)" in out.out
    assert KEY_OLD not in out.out + out.err and KEY_NOW not in out.out + out.err
    saved = list((root / "state" / "rollback").iterdir())
    assert len(saved) == 1 and saved[0].read_text() == STACK_FILE and saved[0].stat().st_mode & 0o077 == 0


def test_without_yes_off_a_terminal_nothing_changes(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stack = FakeStack(history())
    assert run(stack, root) == 2
    assert [c[0] for c in stack.calls] == ["history"]
    assert "add --yes" in capsys.readouterr().err


def test_a_no_at_the_prompt_changes_nothing(root: Path) -> None:
    stack = FakeStack(history())
    assert run(stack, root, answer="no", tty=True) == 2
    assert [c[0] for c in stack.calls] == ["history"]
    assert run(stack, root, answer="yes", tty=True) == 0


def test_no_verified_update_in_history_changes_nothing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stack = FakeStack([Summary(1, "update", "failed", config("img:1", KEY_OLD))])
    assert run(stack, root, "--yes") == 2
    assert [c[0] for c in stack.calls] == ["history"]
    assert "no verified update" in capsys.readouterr().err
    assert not (root / "state" / "rollback").exists()


def test_to_an_unverified_version_is_refused_naming_the_verified_ones(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = FakeStack(history())
    assert run(stack, root, "--yes", "--to", "2") == 2
    assert "verified versions (newest first): 1" in capsys.readouterr().err
    assert [c[0] for c in stack.calls] == ["history"]


def test_a_failed_up_keeps_the_restored_config_and_names_the_saved_file(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = FakeStack(history(), up_fails=True)
    assert run(stack, root, "--yes") == 1
    err = capsys.readouterr().err
    assert "the rollback's up failed: stderr: error: update failed" in err
    assert "cp " in err and str(root / "state" / "rollback") in err


def test_a_config_write_that_fails_puts_the_stack_file_back(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    class Broken(FakeStack):
        def set_all_config(self, values: Any, path: bool = False) -> None:
            (root / "Pulumi.dev.yaml").write_text("config: {}\n")  # the CLI wrote part of it, then failed
            raise RuntimeError("set failed")

    stack = Broken(history())
    assert run(stack, root, "--yes") == 1
    assert "could not restore the config: set failed" in capsys.readouterr().err
    assert (root / "Pulumi.dev.yaml").read_text() == STACK_FILE
    assert not any(c[0] == "up" for c in stack.calls)


def test_list_marks_the_verified_versions(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(FakeStack(history()), root, "--list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("          version 3 (update in-progress")
    assert lines[1].startswith("          version 2 (update failed")
    assert lines[2].startswith("verified  version 1 (update succeeded")


def test_a_self_managed_backends_zero_versions_are_numbered_from_the_oldest(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file or bucket backend reports version 0 for every update (seen with pulumi v3.260.0)."""
    zeros = [Summary(0, s.kind, s.result, s.config) for s in history()]
    stack = FakeStack(zeros)
    assert run(stack, root, "--yes", "--to", "2") == 2
    assert "stack 'dev' version 2 was not verified (update failed)" in capsys.readouterr().err
    assert run(stack, root, "--yes") == 0
    assert stack.calls[-1] == ("up", "rollback to version 1")
