"""Where the stacks' state lives: outside the clone by default, an older clone's stacks kept until moved."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A copy of the toolchain scripts in a clone of its own, so the real .state is never touched."""
    root = tmp_path / "clone"
    shutil.copytree(REPO / "toolchain", root / "toolchain", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def env_of(clone: Path, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PULUMI_", "DSV41_", "XDG_"))}
    env.update(HOME=str(home), **extra)
    out = subprocess.run(
        ["bash", str(clone / "toolchain" / "env.sh"), "--print"], env=env, capture_output=True, text=True, check=True
    )
    printed = subprocess.run(
        ["bash", "-c", out.stdout + '\nprintf "%s\\n" "$PULUMI_BACKEND_URL" "$PULUMI_CONFIG_PASSPHRASE_FILE"'],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return {"backend": printed[0], "passphrase": printed[1], "stderr": out.stderr}


def test_state_lives_outside_the_clone(clone: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    found = env_of(clone, home)
    assert found["backend"] == f"file://{home}/.local/state/dsv41-exl3/backend"
    passphrase = Path(found["passphrase"])
    assert passphrase == home / ".local/state/dsv41-exl3/passphrase"
    assert passphrase.stat().st_mode & 0o077 == 0
    assert (home / ".local/state/dsv41-exl3/backend").is_dir()
    assert not (clone / ".state" / "backend").exists()
    # A second source keeps the same passphrase: the secrets stay readable.
    before = passphrase.read_text()
    env_of(clone, home)
    assert passphrase.read_text() == before


def test_xdg_state_home_and_an_explicit_backend_are_respected(clone: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    found = env_of(clone, home, XDG_STATE_HOME=str(tmp_path / "xdg"))
    assert found["backend"] == f"file://{tmp_path}/xdg/dsv41-exl3/backend"
    shared = env_of(clone, home, PULUMI_BACKEND_URL="s3://team-bucket/dsv41")
    assert shared["backend"] == "s3://team-bucket/dsv41"


def test_an_older_clone_keeps_its_stacks_until_moved(clone: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    old = clone / ".state"
    (old / "backend" / ".pulumi" / "stacks" / "dsv41-exl3").mkdir(parents=True)
    (old / "backend" / ".pulumi" / "stacks" / "dsv41-exl3" / "dev.json").write_text("{}")
    (old / "passphrase").write_text("old-passphrase\n")
    found = env_of(clone, home)
    assert found["backend"] == f"file://{old}/backend"
    assert found["passphrase"] == str(old / "passphrase")
    assert "make move-state" in found["stderr"]

    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    moved = subprocess.run(
        ["bash", str(clone / "toolchain" / "move_state.sh")], env=env, capture_output=True, text=True, check=True
    )
    new = home / ".local/state/dsv41-exl3"
    assert "moved" in moved.stdout
    assert (new / "backend/.pulumi/stacks/dsv41-exl3/dev.json").read_text() == "{}"
    assert (new / "passphrase").read_text() == "old-passphrase\n"
    after = env_of(clone, home)
    assert after["backend"] == f"file://{new}/backend"
    assert after["passphrase"] == str(new / "passphrase")


def test_move_state_refuses_to_merge_into_existing_stacks(clone: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    new = home / ".local/state/dsv41-exl3"
    (new / "backend/.pulumi/stacks").mkdir(parents=True)
    (clone / ".state/backend/.pulumi/stacks").mkdir(parents=True)
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    proc = subprocess.run(["bash", str(clone / "toolchain" / "move_state.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "refusing to merge" in proc.stderr
    assert (clone / ".state/backend/.pulumi/stacks").is_dir()
