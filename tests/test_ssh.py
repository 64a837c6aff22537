"""ssh option rendering: key by 0600 file never argv, multiplexing, agent and known-hosts choices."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from components.access.stack_keys import StackKeysProvider
from components.ssh import (
    KeyDirError,
    SshTarget,
    materialize_key,
    remove_stack_dir,
    ssh_argv,
    ssh_options,
    stack_dir,
)

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----"


def target(**kw: Any) -> SshTarget:
    """A node on port 22 with no key, agent or known_hosts file unless given."""
    return SshTarget(**{"port": 22, "private_key": None, "agent_socket": None, "known_hosts_file": None, **kw})


def test_key_reaches_ssh_as_a_private_file_never_as_argv() -> None:
    argv = ssh_argv(target(host="127.0.0.2", port=2222, user="root", private_key=KEY), "docker ps")
    assert not any("PRIVATE KEY" in a for a in argv)
    path = argv[argv.index("-i") + 1]
    assert Path(path).read_text().strip() == KEY.strip()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert argv[-2:] == ["root@127.0.0.2", "exec sh -c 'docker ps'"] and argv[argv.index("-p") + 1] == "2222"


def test_options_end_before_the_destination() -> None:
    # A user of "-oProxyCommand=x" would otherwise be read by ssh as an option on the operator's machine.
    argv = ssh_argv(target(host="127.0.0.2", port=2222, user="-oProxyCommand=x", private_key=KEY), "true")
    assert argv[-3:] == ["--", "-oProxyCommand=x@127.0.0.2", "exec sh -c true"]


def test_same_key_same_file_and_a_changed_file_is_rewritten() -> None:
    path = materialize_key(KEY)
    path.write_text("tampered")
    assert materialize_key(KEY) == path and path.read_text().strip() == KEY.strip()


def test_every_node_multiplexes_one_master_and_never_prompts() -> None:
    opts = " ".join(ssh_options(target(host="h", user="u", private_key=KEY)))
    for option in ("BatchMode=yes", "ControlMaster=auto", "ControlPersist=", "ConnectTimeout=", "IdentitiesOnly=yes"):
        assert option in opts


def test_agent_socket_and_known_hosts_file_are_passed_as_options() -> None:
    opts = ssh_options(target(host="h", user="u", agent_socket="/run/agent.sock", known_hosts_file="/k/hosts"))
    assert "IdentityAgent=/run/agent.sock" in opts and "UserKnownHostsFile=/k/hosts" in opts
    assert "-i" not in opts


def test_repr_never_shows_the_key() -> None:
    assert "PRIVATE" not in repr(target(host="h", user="u", private_key=KEY))


# --- key material only in private, owner-checked directories (issue #12, item 4) ---------------


def _run_dir_path() -> Path:
    return Path(os.environ["XDG_RUNTIME_DIR"]) / f"dsv41-exl3-{os.getuid()}"


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="d41t-"))  # short: control socket paths are limited
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_a_planted_symlink_as_key_directory_is_refused_and_nothing_written_through(
    runtime: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "world-readable"
    elsewhere.mkdir(mode=0o777)
    _run_dir_path().symlink_to(elsewhere)
    with pytest.raises(KeyDirError) as err:
        materialize_key(KEY)
    text = str(err.value)
    assert str(_run_dir_path()) in text and "is a symlink" in text and "rm -rf" in text
    assert list(elsewhere.iterdir()) == []


def test_a_key_directory_open_to_others_is_refused_with_what_was_found(runtime: Path) -> None:
    _run_dir_path().mkdir(mode=0o700)
    _run_dir_path().chmod(0o755)
    with pytest.raises(KeyDirError, match=r"has mode 0755.*found: owner uid \d+, mode 0755.*mode 0700"):
        materialize_key(KEY)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_a_key_directory_owned_by_someone_else_is_refused(runtime: Path) -> None:
    _run_dir_path().mkdir(mode=0o700)
    os.chown(_run_dir_path(), 65534, 65534)
    with pytest.raises(KeyDirError, match="is owned by uid 65534"):
        materialize_key(KEY)


def test_a_planted_symlink_at_the_key_file_name_is_replaced_not_written_through(runtime: Path, tmp_path: Path) -> None:
    first = materialize_key(KEY)
    first.unlink()
    victim = tmp_path / "victim"
    first.symlink_to(victim)
    path = materialize_key(KEY)
    assert not victim.exists(), "the key must never be written through a link"
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert path.read_text().strip() == KEY.strip()


def test_a_per_run_key_is_removed_when_its_process_exits(runtime: Path) -> None:
    code = (
        "import sys; from components.ssh import materialize_key; "
        "p = materialize_key(sys.stdin.read()); print(p, p.exists())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=KEY,
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    path, existed = done.stdout.split()
    assert existed == "True" and not Path(path).exists()


def test_per_run_keys_of_processes_that_died_without_exit_handlers_are_swept(runtime: Path) -> None:
    directory = _run_dir_path()
    directory.mkdir(mode=0o700)
    dead = 2**22 + 12345  # above the largest pid_max Linux allows: never a live process
    stale = directory / f"key-{'0' * 16}-{dead}"
    stale.write_text("old key")
    mine = materialize_key(KEY)
    assert not stale.exists() and mine.exists()


def test_a_stack_key_stays_and_only_the_stacks_destroy_removes_it(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(runtime / "st"))
    directory = stack_dir("dsv41-exl3", "dev/x")
    assert directory == runtime / "st" / "dsv41-exl3" / "keys" / "dsv41-exl3-dev_x"
    for d in (directory, directory.parent, directory.parent.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    opts = ssh_options(target(host="h", user="u", private_key=KEY, stack_dir=str(directory)))
    key = Path(opts[opts.index("-i") + 1])
    assert key.parent == directory and str(os.getpid()) not in key.name, "named by hash only: stable across runs"
    assert f"ControlPath={directory}/cm-" in " ".join(opts)
    StackKeysProvider().delete("keys-1", {"directory": str(directory)})
    assert not directory.exists()


def test_destroy_keeps_a_stack_directory_holding_foreign_files(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o700)
    (directory / f"key-{'a' * 16}").write_text("k")
    (directory / "notes.txt").write_text("mine")
    assert remove_stack_dir(directory) == ["notes.txt"]
    assert (directory / "notes.txt").exists() and not (directory / f"key-{'a' * 16}").exists()


def test_a_control_socket_path_too_long_for_ssh_is_refused_with_the_fix(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 80)
    deep.mkdir(mode=0o700)
    with pytest.raises(KeyDirError, match="shorter private directory"):
        ssh_options(target(host="h", user="u", stack_dir=str(deep)))
