"""`make stack STACK=name`: the user's stack file from the template, never tracked, never the template."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from components import stack_file
from components.stack_file import StackFileError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    shutil.copy(REPO / "Pulumi.dev.yaml", tmp_path / "Pulumi.dev.yaml")
    return tmp_path


def test_the_stack_file_is_the_template_addressed_to_the_stack(repo: Path) -> None:
    path = stack_file.write("sparks", repo)
    assert path == repo / "Pulumi.sparks.yaml"
    text = path.read_text()
    assert "--stack sparks" in text and "--stack dev" not in text
    assert yaml.safe_load(text) == yaml.safe_load((repo / "Pulumi.dev.yaml").read_text())


def test_an_existing_stack_file_is_kept_unless_forced(repo: Path) -> None:
    path = stack_file.write("sparks", repo)
    path.write_text("filled in by the user\n")
    with pytest.raises(StackFileError, match="Pulumi.sparks.yaml exists.*FORCE=1"):
        stack_file.write("sparks", repo)
    assert path.read_text() == "filled in by the user\n"
    stack_file.write("sparks", repo, force=True)
    assert "--stack sparks" in path.read_text()


@pytest.mark.parametrize(
    ("name", "message"),
    [("dev", "committed template"), ("../x", "not a stack name"), ("", "not a stack name"), ("a b", "not a stack")],
)
def test_bad_names_are_refused_and_nothing_is_written(repo: Path, name: str, message: str) -> None:
    with pytest.raises(StackFileError, match=message):
        stack_file.write(name, repo)
    assert sorted(p.name for p in repo.iterdir()) == ["Pulumi.dev.yaml"]


def test_user_stack_files_are_ignored_by_git_and_the_template_is_not() -> None:
    def ignored(name: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", name], cwd=REPO).returncode == 0

    assert ignored("Pulumi.sparks.yaml")
    assert ignored("Pulumi.my-lab.yaml")
    assert not ignored("Pulumi.dev.yaml")
    assert not ignored("Pulumi.yaml")


def test_the_cli_reports_a_refusal_in_one_line(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert stack_file.main(["--stack", "dev"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("make stack: STACK='dev' is the committed template") and err.count("\n") == 1
