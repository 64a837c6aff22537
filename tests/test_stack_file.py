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


def test_discovered_nodes_and_root_replace_the_templates_blocks_and_the_rest_stays(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.discover.test_cli import HEAD, WORKER, FakePin, FakeSsh

    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    ssh = FakeSsh({"10.0.0.1": HEAD, "10.0.0.2": WORKER})
    text = stack_file.discovered_text(
        ["nvidia@10.0.0.1", "nvidia@10.0.0.2"], None, str(repo / "kh"), repo, run=ssh, pin=FakePin()
    )
    path = stack_file.write("sparks", repo, template=text)
    loaded = yaml.safe_load(path.read_text())["config"]
    template = yaml.safe_load((repo / "Pulumi.dev.yaml").read_text())["config"]
    nodes = loaded["dsv41-exl3:nodes"]
    assert [n["host"] for n in nodes] == ["10.0.0.1", "10.0.0.2"]
    assert nodes[0]["fabricIp"] == "192.168.100.1" and nodes[0]["ibHcas"] == ["rocep1s0f1"]
    assert loaded["dsv41-exl3:weights"]["root"] == "/srv/dsv41-exl3"
    assert loaded["dsv41-exl3:ssh"] == {"knownHostsFile": str(repo / "kh")}
    for key in set(template) - {"dsv41-exl3:nodes", "dsv41-exl3:weights"}:
        assert loaded[key] == template[key], key
    assert "<" not in "".join(line for line in path.read_text().splitlines() if not line.startswith("#"))
    assert "# node 1 (head): nvidia@10.0.0.1" in capsys.readouterr().err


def test_an_unreachable_host_writes_nothing(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.discover.test_cli import HEAD, UNREACHABLE, FakePin, FakeSsh, done

    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    ssh = FakeSsh({"10.0.0.1": HEAD, "10.0.0.2": done(stderr=UNREACHABLE, returncode=255)})
    with pytest.raises(
        StackFileError, match=r"node 2 \(worker\) nvidia@10\.0\.0\.2: ssh: connect.*Nothing was written"
    ):
        stack_file.discovered_text(["nvidia@10.0.0.1", "nvidia@10.0.0.2"], None, None, repo, run=ssh, pin=FakePin())
    assert sorted(p.name for p in repo.iterdir()) == ["Pulumi.dev.yaml"]
