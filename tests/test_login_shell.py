"""Every command the program sends a node runs under `sh`, whatever the SSH user's login shell (issue 22, item 3).

sshd runs a remote command as `$SHELL -c <command>`. These tests run what the program sends through zsh the
same way (zsh does not split an unquoted `$VAR` into words, which the node scripts rely on), and check that it
behaves exactly as under sh; the bare script, without `sh_command`, does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from components import scripts
from components.config import parse
from components.deployment import deploy
from components.dynamic import read_props
from components.gates import stream_source
from components.ssh import SshTarget, ssh_argv
from components.weights import manifest as wm
from components.weights import worker_copy as wc
from tests.support import recording
from tests.support.fake_docker import install_fake_docker
from tests.support.fake_ssh import install_fake_ssh
from tests.support.graph import COMMAND, FIXTURES, config

ZSH = shutil.which("zsh")
needs_zsh = pytest.mark.skipif(ZSH is None, reason="zsh is not installed (apt-get install -y zsh)")
SHELLS = ["sh", "bash", *(s for s in ("zsh", "fish") if shutil.which(s))]


def login_shell(shell: str, command: str, env: dict[str, str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    """What sshd does with a remote command for a user whose login shell is `shell` (bytes as they are: no
    newline translation)."""
    done = subprocess.run(
        [shell, "-c", command], env=env, input=stdin.encode(), capture_output=True, timeout=60, check=False
    )
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


# --- the mechanism: one quoting every shell reads back, one wrapper -----------------------------------------------

NASTY = [
    "plain",
    "",
    "it's",
    "a\\b",
    "\\\\",
    "\\'",
    "'\\",
    "line 1\nline 2\n",
    '$HOME `id` $(id) "q"',
    "printf '%b' \"$T\" \\n \\\\n",
    "trailing\\",
    "!bang ~tilde *glob ?[x] {a,b} #hash ; & | < >",
]


@pytest.mark.parametrize("shell", SHELLS)
def test_a_quoted_word_reads_back_byte_for_byte_in_every_login_shell(shell: str) -> None:
    for text in NASTY:
        done = login_shell(shell, f"printf %s {scripts.quote(text)}", dict(os.environ))
        assert done.returncode == 0 and done.stdout == text, f"{shell} read {text!r} back as {done.stdout!r}"


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=40))
def test_sh_command_runs_any_script_text_unchanged_under_zsh(text: str) -> None:
    shell = ZSH or "sh"
    done = login_shell(shell, scripts.sh_command('printf %s "$1"', text), dict(os.environ))
    assert done.returncode == 0 and done.stdout == text


def test_sh_command_bounds_and_passes_arguments() -> None:
    command = scripts.sh_command('echo "$0:$1:$2"', "a b", "c", timeout_s=5, kill_after_s=2, name="x.sh")
    assert command == "exec timeout -k 2 5 sh -c 'echo \"$0:$1:$2\"' x.sh 'a b' c"
    assert login_shell("sh", command, dict(os.environ)).stdout == "x.sh:a b:c\n"


# --- the program: every remote command it registers or runs is wrapped ---------------------------------------------


def test_every_ssh_the_program_runs_hands_its_script_to_sh() -> None:
    # The gates' streams and polls, and both ends of a worker's copy, reach a node through ssh_argv.
    target = SshTarget(host="127.0.0.2", port=22, user="me", private_key=None, agent_socket=None, known_hosts_file=None)
    script = 'for w in $WATCH; do echo "$w"; done'
    assert ssh_argv(target, script)[-1] == scripts.sh_command(script)


def _sent_to_nodes(share: str) -> dict[str, str]:
    raw = config(2)
    raw["weights"] = {"share": share, **({"copyRoot": "/nvme/{node}/dsv41"} if share == "copy" else {})}
    rec = recording.run(lambda: deploy(parse(raw), "dev"), FIXTURES)
    sent = {
        f"{c.name}.{action}": c.inputs[action]
        for c in rec.of_type(COMMAND)
        for action in ("create", "update", "delete")
        if c.inputs.get(action)
    }
    assert any(k.startswith("weights-stage.") for k in sent) and any(k.startswith("preflight-") for k in sent)
    return sent


@pytest.mark.parametrize("share", ["bind", "nfs", "copy"])
def test_every_remote_command_the_program_registers_runs_under_sh(share: str) -> None:
    for key, command in _sent_to_nodes(share).items():
        words = shlex.split(command)
        assert words[0] == "exec", f"{key} is not handed to sh: {command[:100]!r}"
        at = words.index("sh")
        assert words[at + 1] == "-c" and all(w == "timeout" or w.startswith("-") or w.isdigit() for w in words[1:at]), (
            f"{key}: {command[:100]!r}"
        )


# --- the node scripts through zsh as the login shell --------------------------------------------------------------


@pytest.fixture
def fake_head(tmp_path: Path) -> dict[str, str]:
    """exportfs that logs its argv, systemctl that says active, sudo that just runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("exportfs", f'echo "exportfs $*" >> {tmp_path / "calls"}\n'),
        ("systemctl", "exit 0\n"),
        ("sudo", '[ "$1" = -n ] && shift\nexec "$@"\n'),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "home").mkdir()
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path / "home")}


def _calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return lines


@needs_zsh
def test_the_export_under_zsh_exports_to_each_worker_as_under_sh(fake_head: dict[str, str], tmp_path: Path) -> None:
    root = tmp_path / "w"
    root.mkdir()
    script = wm.render_export_command(
        head_name="head",
        abs_root=str(root),
        worker_ips=["10.0.0.2", "10.0.0.3"],
        stack_prefix="dsv41-exl3-dev",
        exports_dir=str(tmp_path / "exports.d"),
    )
    assert login_shell("sh", scripts.sh_command(script), fake_head).returncode == 0
    under_sh = _calls(tmp_path)
    assert under_sh == [f"exportfs -o ro,sync,no_subtree_check {ip}:{root}" for ip in ("10.0.0.2", "10.0.0.3")]
    done = login_shell(str(ZSH), scripts.sh_command(script), fake_head)
    assert done.returncode == 0, done.stderr
    assert _calls(tmp_path) == under_sh
    # The control: zsh running the script itself exports one bogus entry ("10.0.0.2 10.0.0.3:<root>").
    login_shell(str(ZSH), script, fake_head)
    assert _calls(tmp_path) != under_sh


def _stream_docker_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shell: str, wrapped: bool) -> list[str]:
    where = tmp_path / f"{Path(shell).name}-{'wrapped' if wrapped else 'bare'}"
    where.mkdir()
    fake = install_fake_ssh(where, monkeypatch)
    (fake / "state").write_text("running 0 2026-09-22T10:00:00Z false\n")
    (fake / "log").write_text("")
    (fake / "events").write_text("")
    text = stream_source.stream_script("dsv41-rank0= dsv41-rank1=")
    env = {**os.environ, "PATH": f"{os.environ['FAKE_DOCKER_BIN']}:{os.environ['PATH']}", "FAKE_DOCKER_DIR": str(fake)}
    proc = subprocess.Popen(
        [shell, "-c", scripts.sh_command(text) if wrapped else text],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # its own group: the control's broken script leaves `docker events` running
    )
    log = fake / "docker.log"
    try:
        deadline = time.monotonic() + 10
        while not (log.exists() and "events" in log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the stream never subscribed to events"
            time.sleep(0.02)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the script left behind
    return sorted(ln for ln in log.read_text().splitlines() if ln.startswith("events"))


@needs_zsh
def test_the_rank_stream_under_zsh_filters_each_rank_as_under_sh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    under_sh = _stream_docker_calls(tmp_path, monkeypatch, "sh", wrapped=True)
    assert under_sh == ["events --filter container=dsv41-rank0 --filter container=dsv41-rank1 --format {{json .}}"]
    assert _stream_docker_calls(tmp_path, monkeypatch, str(ZSH), wrapped=True) == under_sh
    assert _stream_docker_calls(tmp_path, monkeypatch, str(ZSH), wrapped=False) != under_sh, "the control"


LOGIN_SSH = """#!/bin/sh
# sshd's part: the remote command (the last argument) run by the user's login shell, stdin and all.
for last in "$@"; do :; done
exec "$FAKE_LOGIN_SHELL" -c "$last"
"""


@pytest.mark.parametrize("shell", ["sh", *(["zsh"] if ZSH else [])])
def test_a_workers_copy_runs_end_to_end_through_the_login_shell(
    shell: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WorkerCopy's real provider code over a stand-in ssh that hands each command to the login shell: the head's
    source.sh and copy_source.py, the worker's copy.sh and copy_weights.py (a stand-in docker runs them here), the
    per-run token, the heartbeats, and the copy check afterwards."""
    head = tmp_path / "head"
    files = {
        f"{wm.MODEL_DIR}/model-00001-of-00002.safetensors": os.urandom(700_000),
        f"{wm.MODEL_DIR}/config.json": b'{"a": 1}\n',
        f"{wm.ENGRAM_VLLM_DIR}/config.json": b"{}\n",  # what a worker copies: the slim Engram directory
    }
    for rel, data in files.items():
        (head / rel).parent.mkdir(parents=True, exist_ok=True)
        (head / rel).write_bytes(data)
    bin_dir = tmp_path / "ssh-bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(LOGIN_SSH)
    (bin_dir / "ssh").chmod(0o755)
    install_fake_docker(tmp_path / "docker-bin", tmp_path / "docker.log")
    monkeypatch.setenv("PATH", f"{bin_dir}:{tmp_path / 'docker-bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOGIN_SHELL", shell)
    monkeypatch.setenv("HOME", str(tmp_path))
    props = {
        "worker": "spark-1",
        "worker_host": "127.0.0.3",
        "worker_port": 22,
        "worker_user": "me",
        "worker_fabric_ip": "127.0.0.1",
        "head": "spark-0",
        "head_host": "127.0.0.2",
        "head_port": 22,
        "head_user": "me",
        "head_fabric_ip": "127.0.0.1",
        "ssh_private_key": None,
        "ssh_agent_socket": None,
        "ssh_known_hosts_file": None,
        "head_root": str(head),
        "head_image": "img",
        "worker_image": "img",
        "copy_root": str(tmp_path / "copy"),
        "files": {p: len(d) for p, d in files.items()},
        "sha256": {p: hashlib.sha256(d).hexdigest() for p, d in files.items()},
        "streams": 2,
        "timeout_s": 120,
        "stack_prefix": "dsv41-exl3-dev",
    }
    outs = wc.run_copy(props, log=lambda _m: None)
    assert outs["copied_files"] == len(files) and outs["root"] == str((tmp_path / "copy").resolve())
    assert {p: (tmp_path / "copy" / p).read_bytes() for p in files} == files
    assert wc.check_copy(read_props(wc.WorkerCopyArgs, props)) == {}, "the copy check reads the copy as verified"
