"""The memory watchdog: rendering, the script itself run with sh against a fake meminfo / docker / sleep,
the install and remove commands run locally, and the component's wiring."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pulumi_command import remote

from components.config import Watchdog
from components.watchdog.watchdog import (
    MemoryWatchdog,
    MemoryWatchdogArgs,
    WatchdogPeer,
    WatchdogSettings,
    authorized_key_line,
    from_pattern,
    parse_public_key,
    render_install_command,
    render_key_command,
    render_key_remove_command,
    render_peer_stop_script,
    render_remove_command,
    render_watchdog_script,
)
from tests.support import recording
from tests.support.host_keys import fake_host_key
from tests.support.scripts import header_value, sent_script

GIB_KIB = 1024 * 1024
FLOOR_KIB = 5 * GIB_KIB
LOW, HIGH = FLOOR_KIB - 1, 80 * GIB_KIB
PREFIX = "dsv41-exl3-dev"
LOG_PATH = f"~/.local/state/{PREFIX}/watchdog.log"

FAKE_SLEEP = """#!/bin/sh
# Each sleep moves the fake clock one sample on: the next MemAvailable value from the queue.
# Queue empty: end the watchdog under test (it is our parent) with TERM, as `pulumi destroy` would.
q="$WD_TEST_DIR/queue"
if [ ! -s "$q" ]; then kill -TERM "$PPID"; exit 0; fi
next=$(head -n 1 "$q"); tail -n +2 "$q" > "$q.tmp"; mv "$q.tmp" "$q"
printf 'MemTotal:       127535264 kB\\nMemFree:          1000 kB\\nMemAvailable:   %s kB\\n' "$next" \\
  > "$WD_TEST_DIR/meminfo.tmp"
mv "$WD_TEST_DIR/meminfo.tmp" "$WD_TEST_DIR/meminfo"
"""
FAKE_DOCKER = '#!/bin/sh\necho "$*" >> "$WD_TEST_DIR/docker.calls"\n'
FAKE_LOGGER = '#!/bin/sh\necho "$*" >> "$WD_TEST_DIR/logger.calls"\n'


def _watchdog(floor_gib: float = 5.0, **kw: Any) -> Watchdog:
    """The stack's `watchdog` section; what is not given keeps components/config's default."""
    return Watchdog(mem_available_floor_gib=floor_gib, **kw)


def _settings(
    *,
    floor_gib: float = 5.0,
    consecutive_samples: int | None = None,
    sample_interval_s: int | None = None,
    **kw: object,
) -> WatchdogSettings:
    given = {
        k: v
        for k, v in (("consecutive_samples", consecutive_samples), ("sample_seconds", sample_interval_s))
        if v is not None
    }
    return WatchdogSettings(
        **{
            "node_name": "spark-b",
            "container_name": "dsv41-rank1",
            "stack_prefix": PREFIX,
            "watchdog": _watchdog(floor_gib, **given),
            **kw,
        }
    )  # type: ignore[arg-type]


# --- pure rendering -------------------------------------------------------------------------------------


class TestRendering:
    def test_floor_is_converted_to_kib(self) -> None:
        assert _settings().floor_kib == FLOOR_KIB
        assert _settings(floor_gib=0.5).floor_kib == 524288

    def test_script_guards_on_memavailable_never_used(self) -> None:
        script = render_watchdog_script(_settings(consecutive_samples=4, sample_interval_s=7))
        assert '$1 == "MemAvailable:"' in script
        assert "MemFree" not in script and "free -" not in script and "used" not in script.replace('"used"', "")
        assert header_value(script, "FLOOR_KIB") == str(FLOOR_KIB) and header_value(script, "SAMPLES") == "4"
        assert header_value(script, "SAMPLE_INTERVAL_S") == "7"
        assert 'INTERVAL="${DSV41_WATCHDOG_INTERVAL_S:-$SAMPLE_INTERVAL_S}"' in script
        assert header_value(script, "CONTAINER") == "dsv41-rank1"
        assert header_value(script, "SYSLOG_TAG") == "dsv41-exl3-watchdog" and 'logger -t "$SYSLOG_TAG"' in script

    def test_every_remote_command_is_bounded_by_timeout(self) -> None:
        assert render_install_command(_settings()).startswith("exec timeout 60 sh -c ")
        assert render_remove_command(_settings()).startswith("exec timeout 30 sh -c ")
        assert 'timeout "$STOP_TIMEOUT" $DOCKER kill' in render_watchdog_script(_settings())

    @pytest.mark.parametrize(
        ("kw", "message"),
        [
            # A floor, interval or count out of range is refused by the config (tests/config/test_config.py).
            ({"container_name": "a b"}, "container_name 'a b' on spark-b is not a valid docker container name"),
            ({"node_name": "../x"}, "node_name '../x' must match"),
            ({"meminfo_path": "proc/meminfo"}, "must be an absolute path"),
        ],
    )
    def test_bad_settings_are_named(self, kw: dict[str, object], message: str) -> None:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            _settings(**kw)


# --- the script, run with sh ------------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> dict[str, str]:
    """A fake node: HOME, a bin dir with fake sleep/docker/logger first on PATH, a fake meminfo."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("sleep", FAKE_SLEEP), ("docker", FAKE_DOCKER), ("logger", FAKE_LOGGER)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    return {
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),
        "WD_TEST_DIR": str(tmp_path),
        "DSV41_WATCHDOG_MEMINFO": str(tmp_path / "meminfo"),
    }


def _run_samples(node: dict[str, str], values: list[int | str], samples: int = 3) -> tuple[list[str], str]:
    """Run the watchdog over `values` (one per sample); return docker calls and the log."""
    d = Path(node["WD_TEST_DIR"])
    (d / "meminfo").write_text(f"MemTotal: 127535264 kB\nMemAvailable: {values[0]} kB\n")
    (d / "queue").write_text("".join(f"{v}\n" for v in values[1:]))
    script = d / "watchdog.sh"
    script.write_text(render_watchdog_script(_settings(consecutive_samples=samples)))
    done = subprocess.run(["sh", str(script)], env=node, capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 0, done.stderr
    state = Path(node["HOME"]) / ".local/state/dsv41-exl3-dev"
    assert not (state / "memory-watchdog-spark-b.pid").exists(), "the TERM trap removes the pidfile"
    calls = (d / "docker.calls").read_text().splitlines() if (d / "docker.calls").exists() else []
    return calls, (state / "watchdog.log").read_text()


class TestScript:
    def test_stops_after_k_low_samples_and_records_why(self, node: dict[str, str]) -> None:
        calls, log = _run_samples(node, [HIGH, LOW, LOW - 5, LOW - 9])
        assert calls == ["kill dsv41-rank1"]
        stop = [ln for ln in log.splitlines() if "STOP" in ln]
        assert len(stop) == 1
        assert "node=spark-b container=dsv41-rank1" in stop[0]
        assert f"(KiB: {LOW} {LOW - 5} {LOW - 9})" in stop[0] and f"below {FLOOR_KIB} KiB" in stop[0]
        assert stop[0][:4].isdigit() and stop[0][10] == "T"  # starts with a UTC timestamp
        assert "killed dsv41-rank1" in log
        logger = (Path(node["WD_TEST_DIR"]) / "logger.calls").read_text()
        assert "-t dsv41-exl3-watchdog" in logger and "STOP" in logger

    def test_k_minus_1_low_samples_do_nothing(self, node: dict[str, str]) -> None:
        calls, log = _run_samples(node, [LOW, LOW, HIGH, HIGH])
        assert calls == [] and "STOP" not in log

    def test_a_high_sample_resets_the_count(self, node: dict[str, str]) -> None:
        calls, _ = _run_samples(node, [LOW, LOW, HIGH, LOW, LOW, HIGH])
        assert calls == []

    def test_never_on_high_values_and_exactly_the_floor_is_not_low(self, node: dict[str, str]) -> None:
        calls, _ = _run_samples(node, [HIGH, FLOOR_KIB, FLOOR_KIB, FLOOR_KIB, FLOOR_KIB + 1, HIGH])
        assert calls == []

    def test_keeps_guarding_after_a_stop(self, node: dict[str, str]) -> None:
        calls, _ = _run_samples(node, [LOW] * 6)
        assert calls == ["kill dsv41-rank1", "kill dsv41-rank1"]

    def test_k_is_configurable(self, node: dict[str, str]) -> None:
        calls, _ = _run_samples(node, [LOW] * 4, samples=5)
        assert calls == []

    def test_unreadable_meminfo_never_stops(self, node: dict[str, str]) -> None:
        calls, log = _run_samples(node, ["garbage", "", LOW, "x", LOW])
        assert calls == [] and log.count("cannot read MemAvailable") == 2  # once per unreadable stretch


# --- install / remove, run locally -------------------------------------------------------------------------


@pytest.fixture
def installed(node: dict[str, str], tmp_path: Path) -> Iterator[tuple[dict[str, str], WatchdogSettings]]:
    env = {k: v for k, v in node.items() if k != "DSV41_WATCHDOG_MEMINFO"}
    env["PATH"] = node["PATH"].split(os.pathsep, 1)[1]  # the real sleep: install waits on it
    docker_bin = tmp_path / "dockerbin"
    docker_bin.mkdir()
    (docker_bin / "docker").write_text(FAKE_DOCKER)
    (docker_bin / "docker").chmod(0o755)
    env["PATH"] = f"{docker_bin}{os.pathsep}{env['PATH']}"
    meminfo = tmp_path / "node-meminfo"
    meminfo.write_text(f"MemAvailable: {HIGH} kB\n")
    settings = _settings(meminfo_path=str(meminfo), sample_interval_s=1)
    pidfile = Path(env["HOME"]) / ".local/state/dsv41-exl3-dev/memory-watchdog-spark-b.pid"
    yield env, settings
    if pidfile.exists():  # only the watchdog this test started
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def _sh(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True, timeout=30, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


class TestInstall:
    def test_install_is_idempotent_and_remove_keeps_the_log(
        self, installed: tuple[dict[str, str], WatchdogSettings]
    ) -> None:
        env, settings = installed
        home = Path(env["HOME"])
        pidfile = home / ".local/state/dsv41-exl3-dev/memory-watchdog-spark-b.pid"
        script = home / ".local/share/dsv41-exl3-dev/memory-watchdog-spark-b.sh"
        log = home / ".local/state/dsv41-exl3-dev/watchdog.log"

        first = _sh(render_install_command(settings), env)
        assert first.returncode == 0, first.stderr
        assert "running on spark-b" in first.stdout and LOG_PATH in first.stdout
        pid1 = int(pidfile.read_text())
        assert _alive(pid1) and script.read_text() == render_watchdog_script(settings)

        again = _sh(render_install_command(settings), env)  # create/update re-install and restart
        assert again.returncode == 0, again.stderr
        pid2 = int(pidfile.read_text())
        assert pid2 != pid1 and _alive(pid2)
        deadline = time.monotonic() + 5
        while _alive(pid1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid1), "the old copy must be stopped, not left running beside the new one"

        removed = _sh(render_remove_command(settings), env)
        assert removed.returncode == 0, removed.stderr
        assert "log kept" in removed.stdout
        time.sleep(0.2)
        assert not _alive(pid2) and not script.exists() and not pidfile.exists()
        text = log.read_text()
        assert text.count("watchdog started") == 2 and "watchdog stopping (signal)" in text
        assert not (Path(env["WD_TEST_DIR"]) / "docker.calls").exists()  # memory was high throughout

        assert _sh(render_remove_command(settings), env).returncode == 0  # removing twice is fine


class TestTwoStacksOnOneNode:
    """Issue 12 item 10: a second stack on the same node (same node name) has its own script, pidfile, key
    and log; installing or removing one never stops the other's watchdog."""

    def test_each_stack_keeps_its_own_watchdog(self, installed: tuple[dict[str, str], WatchdogSettings]) -> None:
        env, a = installed
        b = WatchdogSettings(
            **{**a.__dict__, "stack_prefix": "dsv41-exl3-prod", "container_name": "dsv41-exl3-prod-spark-b"}
        )
        home = Path(env["HOME"])
        pid_b_file = home / ".local/state/dsv41-exl3-prod/memory-watchdog-spark-b.pid"
        try:
            assert _sh(render_install_command(a), env).returncode == 0
            pid_a = int((home / ".local/state/dsv41-exl3-dev/memory-watchdog-spark-b.pid").read_text())
            installed_b = _sh(render_install_command(b), env)
            assert installed_b.returncode == 0, installed_b.stderr
            assert "~/.local/state/dsv41-exl3-prod/watchdog.log" in installed_b.stdout
            pid_b = int(pid_b_file.read_text())
            assert pid_a != pid_b and _alive(pid_a) and _alive(pid_b), "installing B must not stop A's watchdog"
            assert _sh(render_remove_command(a), env).returncode == 0
            time.sleep(0.2)
            assert not _alive(pid_a) and _alive(pid_b), "removing A must not stop B's watchdog"
            assert (home / ".local/share/dsv41-exl3-prod/memory-watchdog-spark-b.sh").exists()
        finally:
            if pid_b_file.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_b_file.read_text()), signal.SIGKILL)

    def test_keys_and_forced_commands_are_per_stack(self, tmp_path: Path) -> None:
        a, b = _settings(), _settings(stack_prefix="dsv41-exl3-prod")
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
        if shutil.which("ssh-keygen") is None:
            pytest.skip("ssh-keygen not installed")
        key_a = tmp_path / ".local/state/dsv41-exl3-dev/watchdog-key-dsv41-exl3-dev-spark-b"
        key_b = tmp_path / ".local/state/dsv41-exl3-prod/watchdog-key-dsv41-exl3-prod-spark-b"
        made = _sh(render_key_command(a), env)
        assert made.returncode == 0, made.stderr
        made_b = _sh(render_key_command(b), env)
        assert made_b.returncode == 0, made_b.stderr
        assert parse_public_key(made.stdout, "spark-b") != parse_public_key(made_b.stdout, "spark-b")
        assert header_value(render_key_command(a), "STATE_DIR") == ".local/state/dsv41-exl3-dev"
        assert _sh(render_key_remove_command(b), env).returncode == 0
        assert not key_b.exists() and key_a.exists(), "removing B's key must leave A's"
        key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOperatorKeyForTests"
        assert (
            'command="sh .local/share/dsv41-exl3-prod/memory-watchdog-spark-b-peer-stop.sh spark-a"'
            in authorized_key_line(b, PEERS[0], key)
        )

    @pytest.mark.parametrize("owner", ["this stack", "another stack"])
    def test_install_retires_the_old_fixed_path_copy_only_of_this_container(
        self, owner: str, installed: tuple[dict[str, str], WatchdogSettings]
    ) -> None:
        env, settings = installed
        home = Path(env["HOME"])
        share, state = home / ".local/share/dsv41-exl3", home / ".local/state/dsv41-exl3"
        share.mkdir(parents=True)
        state.mkdir(parents=True)
        container = settings.container_name if owner == "this stack" else "dsv41-exl3-prod-spark-b"
        legacy = share / "memory-watchdog-spark-b.sh"
        legacy.write_text(f"CONTAINER='{container}'\nwhile :; do sleep 1; done\n")
        old = subprocess.Popen(["sh", str(legacy)], env=env, start_new_session=True)
        try:
            (state / "memory-watchdog-spark-b.pid").write_text(f"{old.pid}\n")
            time.sleep(0.1)
            done = _sh(render_install_command(settings), env)
            assert done.returncode == 0, done.stderr
            if owner == "this stack":
                assert old.wait(timeout=5) is not None and not legacy.exists(), "the old copy keeps guarding"
            else:
                assert old.poll() is None and legacy.exists(), "another stack's old copy was stopped"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.pid, signal.SIGKILL)
            old.wait(timeout=5)


# --- component wiring ------------------------------------------------------------------------------------


def test_component_installs_with_one_remote_command() -> None:
    def program() -> dict[str, object]:
        wd = MemoryWatchdog(
            "wd-spark-b",
            MemoryWatchdogArgs(
                node_name="spark-b",
                connection=remote.ConnectionArgs(host="127.0.0.3", port=2222, user="root"),
                container_name="dsv41-rank1",
                stack_prefix=PREFIX,
                watchdog=_watchdog(5.0),
                rerun_on=["cid-worker-1"],
            ),
        )
        return {"log": wd.log_path, "status": wd.status}

    rec = recording.run(program)
    (cmd,) = rec.of_type("command:remote:Command")
    assert rec.registrations == [cmd], "one command, no component of its own (issue 36)"
    settings = _settings()
    assert cmd.name == "wd-spark-b-install"
    assert cmd.delete_before_replace, "the old copy's delete would kill the new copy (same pidfile)"
    assert cmd.inputs["create"] == cmd.inputs["update"] == render_install_command(settings)
    assert cmd.inputs["delete"] == render_remove_command(settings)
    assert cmd.inputs["triggers"] == ["cid-worker-1"]
    assert cmd.inputs["addPreviousOutputInEnv"] is False
    assert "connection" in cmd.secret_paths()  # the provider marks the whole connection secret
    assert "127.0.0.3" in str(cmd.inputs["connection"])
    assert rec.outputs["log"] == LOG_PATH


def test_args_validate_at_program_time() -> None:
    with pytest.raises(ValueError, match="container_name 'a b' on spark-b"):
        MemoryWatchdogArgs(
            node_name="spark-b",
            connection=remote.ConnectionArgs(host="127.0.0.3"),
            container_name="a b",
            stack_prefix=PREFIX,
            watchdog=_watchdog(),
            rerun_on=[],
        )


# --- issue 10: a trip stops every rank and records the memory holders --------------------------------------

HOST_KEY_A = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKeyOfSparkA"
HOST_KEY_C = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYHostKeyOfSparkC="
PEERS = (
    WatchdogPeer(node_name="spark-a", host="10.0.0.1", port=2201, user="me", host_key=HOST_KEY_A),
    WatchdogPeer(node_name="spark-c", host="10.0.0.3", port=22, user="ops", host_key=HOST_KEY_C),
)
FAKE_SSH = (
    '#!/bin/sh\necho "$*" >> "$WD_TEST_DIR/ssh.calls"\n[ -z "${WD_SSH_FAIL:-}" ] || exit 255\necho "stopped rank"\n'
)
PEER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPeerKeyOfSparkA"


def _trip(node: dict[str, str], *, key: bool = True, ssh_fails: bool = False) -> tuple[list[str], list[str], str]:
    d = Path(node["WD_TEST_DIR"])
    (d / "bin" / "ssh").write_text(FAKE_SSH)
    (d / "bin" / "ssh").chmod(0o755)
    state = Path(node["HOME"]) / ".local/state/dsv41-exl3-dev"
    state.mkdir(parents=True, exist_ok=True)
    if key:
        (state / "watchdog-key-dsv41-exl3-dev-spark-b").write_text("private key stand-in\n")
    (d / "meminfo").write_text(f"MemTotal: 127535264 kB\nMemAvailable: {LOW} kB\n")
    (d / "queue").write_text(f"{LOW}\n{LOW}\n")
    script = d / "watchdog.sh"
    script.write_text(render_watchdog_script(_settings(consecutive_samples=3, peers=PEERS)))
    env = {**node, **({"WD_SSH_FAIL": "1"} if ssh_fails else {})}
    done = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 0, done.stderr
    read = lambda name: (d / name).read_text().splitlines() if (d / name).exists() else []  # noqa: E731
    return read("docker.calls"), read("ssh.calls"), (state / "watchdog.log").read_text()


class TestStopsEveryRank:
    def test_a_trip_stops_this_rank_then_every_peer_through_its_key(self, node: dict[str, str]) -> None:
        docker_calls, ssh_calls, log = _trip(node)
        assert docker_calls == ["kill dsv41-rank1"]
        key = f"{node['HOME']}/.local/state/dsv41-exl3-dev/watchdog-key-dsv41-exl3-dev-spark-b"
        assert len(ssh_calls) == 2
        for call, (port, target) in zip(ssh_calls, (("2201", "me@10.0.0.1"), ("22", "ops@10.0.0.3")), strict=True):
            assert call.startswith(f"-i {key} -p {port} -o BatchMode=yes -o IdentitiesOnly=yes")
            # Only the key the operator pinned: a node never trusts a peer's key on first use.
            assert "StrictHostKeyChecking=yes" in call and "accept-new" not in call
            # Per node: two nodes sharing one home (NFS homes, the simulated cluster) keep their own.
            assert f"UserKnownHostsFile={node['HOME']}/.local/state/dsv41-exl3-dev/watchdog-known_hosts-spark-b" in call
            assert call.endswith(f"{target} stop-from spark-b")
        lines = log.splitlines()
        stopped = next(i for i, ln in enumerate(lines) if "killed dsv41-rank1" in ln)
        peer_a = next(i for i, ln in enumerate(lines) if "peer spark-a (me@10.0.0.1:2201): stopped rank" in ln)
        assert stopped < peer_a and any("peer spark-c (ops@10.0.0.3:22): stopped rank" in ln for ln in lines)

    def test_the_watchdog_trusts_exactly_the_peers_pinned_host_keys(self, node: dict[str, str]) -> None:
        _trip(node)
        known = Path(node["HOME"]) / ".local/state/dsv41-exl3-dev/watchdog-known_hosts-spark-b"
        assert known.read_text().splitlines() == [f"[10.0.0.1]:2201 {HOST_KEY_A}", f"10.0.0.3 {HOST_KEY_C}"]

    def test_a_trip_records_memavailable_and_the_top_memory_holders(self, node: dict[str, str]) -> None:
        _, _, log = _trip(node)
        assert f"memory at stop: MemTotal: 127535264 kB; MemAvailable: {LOW} kB;" in log
        holders = [ln for ln in log.splitlines() if "holder (pid rss_kib command):" in ln]
        assert 2 <= len(holders) <= 11, "the header and the top processes by RSS"
        assert "PID" in holders[0] and "RSS" in holders[0]
        rss = [int(ln.split(": ", 1)[1].split()[1]) for ln in holders[1:]]
        assert rss == sorted(rss, reverse=True)

    def test_a_peer_that_cannot_be_reached_is_logged_and_the_others_are_still_stopped(
        self, node: dict[str, str]
    ) -> None:
        docker_calls, ssh_calls, log = _trip(node, ssh_fails=True)
        assert docker_calls == ["kill dsv41-rank1"] and len(ssh_calls) == 2
        assert log.count("stop FAILED (exit 255)") == 2 and "stop it by hand" in log

    def test_without_a_key_the_peers_are_named_not_skipped_silently(self, node: dict[str, str]) -> None:
        docker_calls, ssh_calls, log = _trip(node, key=False)
        assert docker_calls == ["kill dsv41-rank1"] and ssh_calls == []
        assert "cannot stop rank on spark-a: no watchdog key" in log and "cannot stop rank on spark-c" in log


class TestPeerAuthorization:
    def test_install_authorizes_peer_keys_for_the_stop_only_and_remove_revokes(
        self, installed: tuple[dict[str, str], WatchdogSettings]
    ) -> None:
        env, base = installed
        settings = WatchdogSettings(**{**base.__dict__, "peers": PEERS})
        home = Path(env["HOME"])
        ak = home / ".ssh" / "authorized_keys"
        ak.parent.mkdir(mode=0o700)
        ak.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOperator me@laptop\n")
        for _ in range(2):  # idempotent: the lines are replaced, not appended again
            done = _sh(render_install_command(settings, peer_keys=[("spark-a", PEER_KEY + " old-comment")]), env)
            assert done.returncode == 0, done.stderr
        lines = ak.read_text().splitlines()
        assert lines[0].endswith("me@laptop"), "other keys are kept"
        (line,) = [ln for ln in lines if "dsv41-exl3-watchdog:dsv41-rank1:" in ln]
        assert line == (
            'restrict,from="10.0.0.1",'
            'command="sh .local/share/dsv41-exl3-dev/memory-watchdog-spark-b-peer-stop.sh '
            f'spark-a" {PEER_KEY} dsv41-exl3-watchdog:dsv41-rank1:from-spark-a'
        )
        assert oct(ak.stat().st_mode & 0o777) == "0o600"
        # what sshd runs for that key: from the home directory, the forced command, whatever was asked
        command = line.split('command="', 1)[1].split('"', 1)[0]
        forced = subprocess.run(
            ["sh", "-c", command],
            cwd=home,
            env={**env, "SSH_ORIGINAL_COMMAND": "rm -rf /"},
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout.strip() == "killed dsv41-rank1 on spark-b"
        assert (Path(env["WD_TEST_DIR"]) / "docker.calls").read_text().splitlines()[-1] == "kill dsv41-rank1"
        log = (home / ".local/state/dsv41-exl3-dev/watchdog.log").read_text()
        assert "STOP requested by the watchdog of spark-a" in log and "killed (asked by spark-a)" in log
        removed = _sh(render_remove_command(settings), env)
        assert removed.returncode == 0, removed.stderr
        assert ak.read_text().splitlines() == lines[:1]
        assert not (home / ".local/share/dsv41-exl3-dev/memory-watchdog-spark-b-peer-stop.sh").exists()

    def test_a_key_that_is_not_an_ed25519_line_is_refused(self) -> None:
        with pytest.raises(ValueError, match="is not an ssh-ed25519 key line"):
            authorized_key_line(_settings(), PEERS[0], 'ssh-ed25519 AAAA" ,command="evil')

    def test_key_command_makes_one_key_and_prints_the_public_half(self, tmp_path: Path) -> None:
        if shutil.which("ssh-keygen") is None:
            pytest.skip("ssh-keygen not installed")
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
        first = _sh(render_key_command(_settings()), env)
        again = _sh(render_key_command(_settings()), env)
        assert first.returncode == 0, first.stderr
        key = parse_public_key(first.stdout, "spark-b")
        assert key.startswith("ssh-ed25519 ") and parse_public_key(again.stdout, "spark-b") == key
        private = tmp_path / ".local/state/dsv41-exl3-dev/watchdog-key-dsv41-exl3-dev-spark-b"
        assert private.stat().st_mode & 0o077 == 0
        assert _sh(render_key_remove_command(_settings()), env).returncode == 0
        assert not private.exists()


def test_deployment_gives_every_watchdog_the_other_ranks_and_their_keys() -> None:
    from components.config import parse
    from components.deployment import deploy
    from tests.support.graph import FIXTURES, config

    rec = recording.run(lambda: deploy(parse(config(4)), "dev"), FIXTURES)
    assert len([c for c in rec.of_type("command:remote:Command") if c.name.endswith("-keygen")]) == 4
    commands = rec.of_type("command:remote:Command")
    installs = {c.name: c.inputs["create"] for c in commands if c.name.endswith("-install")}
    for i in range(4):
        create = installs[f"watchdog-spark-{i}-install"]
        install = sent_script(create)  # exec timeout N sh -c <the rendered install.sh>
        watchdog = header_value(install, "WATCHDOG", as_text=True)
        stopped = header_value(watchdog, "PEERS", as_text=True).splitlines()
        assert sorted(stopped) == [f"spark-{j} me 10.0.0.{j + 1} 22" for j in sorted({0, 1, 2, 3} - {i})], (
            "every other rank, through its SSH address; a node does not ssh to itself"
        )
        authorized = header_value(install, "AUTHORIZED_KEYS", as_text=True)
        for j in {0, 1, 2, 3} - {i}:
            assert f"dsv41-exl3-watchdog:dsv41-exl3-dev-spark-{i}:from-spark-{j}" in authorized
        pinned = [f"10.0.0.{j + 1} {fake_host_key(f'10.0.0.{j + 1}', 22).line()}" for j in {0, 1, 2, 3} - {i}]
        known = header_value(watchdog, "KNOWN_HOSTS", as_text=True).splitlines()
        assert sorted(known) == sorted(pinned), "each peer's pinned host key, as the operator's machine saw it"


def test_a_peer_login_name_is_checked_as_config_checks_it() -> None:
    """A login name the config admits (a leading '_', as useradd's) is a valid peer; a leading '-' (an ssh option)
    or a shell character never is."""
    ok = WatchdogPeer(node_name="spark-a", host="10.0.0.1", port=22, user="_ops", host_key=HOST_KEY_A)
    assert ok.user == "_ops"
    for user in ("-oProxyCommand=x", "me;rm", "a b", "me:x"):
        with pytest.raises(ValueError, match="is not a plain host or user name"):
            WatchdogPeer(node_name="spark-a", host="10.0.0.1", port=22, user=user, host_key=HOST_KEY_A)


# --- issue 21 item 5.1: authorized_keys is never replaced from an incomplete copy, and edits are locked -------

OPERATOR_LINES = "".join(
    f"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOperatorKey{i:04d} operator-{i}@laptop\n" for i in range(300)
)


def _with_our_lines(settings: WatchdogSettings) -> str:
    """The operator's lines with two of this container's peer lines among them (what a remove takes out)."""
    ours = "".join(f"{authorized_key_line(settings, peer, PEER_KEY)}\n" for peer in PEERS)
    return OPERATOR_LINES[:5000] + ours + OPERATOR_LINES[5000:]


def _no_temp_copies(ak: Path) -> None:
    left = [p.name for p in ak.parent.iterdir() if p.name.startswith("authorized_keys.") and p.suffix != ".lock"]
    assert left == [], f"temp copies left beside authorized_keys: {left}"


class TestAuthorizedKeysSafety:
    def test_a_grep_that_fails_midway_leaves_the_file_unchanged_and_fails_naming_it(
        self, installed: tuple[dict[str, str], WatchdogSettings], tmp_path: Path
    ) -> None:
        env, base = installed
        settings = WatchdogSettings(**{**base.__dict__, "peers": PEERS})
        real_grep = shutil.which("grep")
        fake = tmp_path / "badgrep"
        fake.mkdir()
        # The copying grep (-v) writes one line, then fails as on a write error (exit 2); every other grep is real.
        (fake / "grep").write_text(
            f'#!/bin/sh\ncase " $* " in *" -v "*) {real_grep} "$@" | head -n 1; exit 2 ;; esac\nexec {real_grep} "$@"\n'
        )
        (fake / "grep").chmod(0o755)
        env = {**env, "PATH": f"{fake}{os.pathsep}{env['PATH']}"}
        ak = Path(env["HOME"]) / ".ssh" / "authorized_keys"
        ak.parent.mkdir(mode=0o700)
        before = _with_our_lines(settings)
        ak.write_text(before)
        for command in (
            render_remove_command(settings),
            render_install_command(settings, peer_keys=[("spark-a", PEER_KEY)]),
        ):
            done = _sh(command, env)
            assert done.returncode != 0, f"a failed copy must fail the command:\n{done.stdout}"
            assert f"{ak} on spark-b: grep exited 2" in done.stderr and "left unchanged" in done.stderr, done.stderr
            assert ak.read_text() == before, "authorized_keys must stay as it was"
            _no_temp_copies(ak)

    def test_a_full_filesystem_leaves_the_file_unchanged(
        self, installed: tuple[dict[str, str], WatchdogSettings], tmp_path: Path
    ) -> None:
        """The reported case: a 64 KiB tmpfs home, full; `remove` used to return 0 and leave the file empty."""
        env, base = installed
        settings = WatchdogSettings(**{**base.__dict__, "peers": PEERS})
        home = tmp_path / "tinyhome"
        home.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(home)],
            capture_output=True,
            text=True,
            check=False,
        )
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
        try:
            ak = home / ".ssh" / "authorized_keys"
            ak.parent.mkdir(mode=0o700)
            before = _with_our_lines(settings)
            ak.write_text(before)
            with contextlib.suppress(OSError), (home / "filler").open("wb") as f:
                while True:  # fill the filesystem to the last block
                    f.write(b"x" * 1024)
                    f.flush()
            done = _sh(render_remove_command(settings), {**env, "HOME": str(home)})
            assert done.returncode != 0, done.stdout
            assert f"{ak} on spark-b:" in done.stderr and "left unchanged" in done.stderr, done.stderr
            assert ak.read_text() == before
            _no_temp_copies(ak)
        finally:
            subprocess.run(["umount", str(home)], check=False)

    def test_concurrent_installs_lose_no_line(self, installed: tuple[dict[str, str], WatchdogSettings]) -> None:
        """Ten stacks' installs rewriting one authorized_keys at once (before the lock, 5 of 10 such trials
        lost a line): every install's peer line and every operator line is there afterwards."""
        env, base = installed
        home = Path(env["HOME"])
        ak = home / ".ssh" / "authorized_keys"
        ak.parent.mkdir(mode=0o700)
        ak.write_text(OPERATOR_LINES)
        stacks = [
            WatchdogSettings(
                **{
                    **base.__dict__,
                    "peers": PEERS,
                    "stack_prefix": f"dsv41-exl3-t{i}",
                    "container_name": f"dsv41-exl3-t{i}-spark-b",
                }
            )
            for i in range(10)
        ]
        keys = [f"{PEER_KEY}{i}" for i in range(10)]
        try:
            running = [
                subprocess.Popen(
                    ["sh", "-c", render_install_command(s, peer_keys=[("spark-a", k)])],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for s, k in zip(stacks, keys, strict=True)
            ]
            for p in running:
                _, err = p.communicate(timeout=60)
                assert p.returncode == 0, err
            lines = ak.read_text().splitlines()
            assert lines[:300] == OPERATOR_LINES.splitlines(), "the operator's lines are kept, in order"
            for s, k in zip(stacks, keys, strict=True):
                assert sum(f" {k} {s.key_tag}:from-spark-a" in ln for ln in lines) == 1, f"{s.stack_prefix}'s line"
            assert len(lines) == 310
            _no_temp_copies(ak)
        finally:
            for s in stacks:
                pidfile = home / s.state_dir / s.pid_name
                with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
                    os.kill(int(pidfile.read_text()), signal.SIGKILL)


# --- issue 21 item 5.3: as fast as the launcher's guard -------------------------------------------------------


def test_defaults_kill_the_container_within_3_s_of_memory_dropping_below_the_floor(node: dict[str, str]) -> None:
    """The launcher's guard samples every second, acts on the second low sample and kills; ours, with the
    config defaults and the real sleep, must record `docker kill` within 3 s of MemAvailable falling below the
    floor (it used to need 3 samples 5 s apart, then a docker stop with a 60 s grace)."""
    d = Path(node["WD_TEST_DIR"])
    env = {**node, "PATH": node["PATH"].split(os.pathsep, 1)[1]}  # the real sleep: real time
    docker_bin = d / "dockerbin"
    docker_bin.mkdir()
    (docker_bin / "docker").write_text(FAKE_DOCKER)
    (docker_bin / "docker").chmod(0o755)
    env["PATH"] = f"{docker_bin}{os.pathsep}{env['PATH']}"
    meminfo, calls = d / "meminfo", d / "docker.calls"
    meminfo.write_text(f"MemTotal: 127535264 kB\nMemAvailable: {HIGH} kB\n")
    script = d / "watchdog.sh"
    script.write_text(render_watchdog_script(_settings()))  # components/config's sample interval and count
    running = subprocess.Popen(["sh", str(script)], env=env, start_new_session=True)
    try:
        time.sleep(1.5)  # guarding at a high reading
        assert not calls.exists()
        (d / "meminfo.tmp").write_text(f"MemTotal: 127535264 kB\nMemAvailable: {LOW} kB\n")
        (d / "meminfo.tmp").replace(meminfo)
        dropped = time.monotonic()
        while not calls.exists() and time.monotonic() - dropped < 10:
            time.sleep(0.05)
        took = time.monotonic() - dropped
        assert calls.exists(), "no docker call within 10 s of the drop"
        assert calls.read_text().splitlines()[0] == "kill dsv41-rank1", "kill, not a stop that waits out a grace"
        assert took <= 3.0, f"the container was killed {took:.1f} s after MemAvailable fell below the floor"
    finally:
        os.killpg(running.pid, signal.SIGKILL)
        running.wait(timeout=5)


# --- issue 21 item 5.2: nodes sharing one home (NFS homes, the simulated cluster) -----------------------------


def _node_settings(name: str, base: WatchdogSettings, peers: tuple[WatchdogPeer, ...]) -> WatchdogSettings:
    return WatchdogSettings(
        **{**base.__dict__, "node_name": name, "container_name": f"dsv41-exl3-dev-{name}", "peers": peers}
    )


def _peer(name: str, host: str) -> WatchdogPeer:
    return WatchdogPeer(node_name=name, host=host, port=22, user="me", host_key=HOST_KEY_A)


# A node's docker: `ps` with this stack's rank filters lists WD_RUNNING (the ranks on this node), every call recorded.
NODE_DOCKER = """#!/bin/sh
echo "$*" >> "$WD_TEST_DIR/docker.calls"
case "$*" in
  "ps --filter label=dsv41-exl3.stack=dev --filter label=dsv41-exl3.rank --format {{.Names}}")
    for name in $WD_RUNNING; do echo "$name"; done ;;
  ps*) ;;
esac
"""


def _line_parts(line: str) -> tuple[str, str]:
    """(options, key `type blob`) of an authorized_keys line; options end at the first space outside quotes."""
    quoted = False
    for i, ch in enumerate(line):
        if ch == '"':
            quoted = not quoted
        elif ch == " " and not quoted:
            return line[:i], " ".join(line[i + 1 :].split()[:2])
    return "", " ".join(line.split()[:2])


def _option(options: str, name: str) -> str | None:
    m = re.search(rf'(?:^|,){name}="([^"]*)"', options)
    return m.group(1) if m else None


def sshd_first_match(lines: list[str], key: str, source: str) -> str:
    """The line sshd authorizes `key` by for a connection from `source`: the first whose key matches and whose
    from= (if any) admits the address (OpenSSH's auth_check_authkey_line: a line failing from= is skipped)."""
    for line in lines:
        options, blob = _line_parts(line)
        if blob != key:
            continue
        allowed = _option(options, "from")
        if allowed is None or ipaddress.ip_address(source) in ipaddress.ip_network(allowed, strict=False):
            return line
    raise AssertionError(f"no line authorizes {key[:30]}... from {source}")


def forced_command(line: str) -> str:
    command = _option(_line_parts(line)[0], "command")
    assert command is not None, line
    return command


class TestSharedHome:
    def test_two_nodes_sharing_one_home_get_their_own_key_source_and_forced_command(
        self, installed: tuple[dict[str, str], WatchdogSettings]
    ) -> None:
        if shutil.which("ssh-keygen") is None:
            pytest.skip("ssh-keygen not installed")
        env, base = installed
        home = Path(env["HOME"])
        a = _node_settings("spark-a", base, (_peer("spark-b", "10.0.0.2"),))
        b = _node_settings("spark-b", base, (_peer("spark-a", "10.0.0.1"),))
        keys = {}
        for s in (a, b):
            made = _sh(render_key_command(s), env)
            assert made.returncode == 0, made.stderr
            keys[s.node_name] = parse_public_key(made.stdout, s.node_name)
        assert keys["spark-a"] != keys["spark-b"], "one home, still one key per node"
        try:
            for s, peer in ((a, "spark-b"), (b, "spark-a")):
                done = _sh(render_install_command(s, peer_keys=[(peer, keys[peer])]), env)
                assert done.returncode == 0, done.stderr
            lines = (home / ".ssh" / "authorized_keys").read_text().splitlines()
            for peer, node, address in (("spark-a", "spark-b", "10.0.0.1"), ("spark-b", "spark-a", "10.0.0.2")):
                (line,) = [ln for ln in lines if keys[peer] in ln]  # a key in one line only: no first-match mixup
                assert line.startswith(
                    f'restrict,from="{address}",command="sh .local/share/{PREFIX}/memory-watchdog-{node}-peer-stop.sh '
                    f'{peer}" {keys[peer]} '
                ), line
            for s in (a, b):  # each watchdog uses its own key
                script = (home / s.share_dir / s.script_name).read_text()
                assert header_value(script, "KEY_NAME") == f"watchdog-key-{PREFIX}-{s.node_name}"
        finally:
            for s in (a, b):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
                    os.kill(int((home / s.state_dir / s.pid_name).read_text()), signal.SIGKILL)

    def test_three_nodes_sharing_one_home_each_stop_lands_on_the_node_asked_whatever_line_sshd_picks(
        self, installed: tuple[dict[str, str], WatchdogSettings]
    ) -> None:
        """With three nodes on one home a key is authorized once per node it may stop, every line with the same
        from= (the asker's address): sshd runs the first matching line, another node's. The forced command must
        still kill the rank of the host it runs on."""
        if shutil.which("ssh-keygen") is None:
            pytest.skip("ssh-keygen not installed")
        env, base = installed
        home = Path(env["HOME"])
        address = {"spark-a": "10.0.0.1", "spark-b": "10.0.0.2", "spark-c": "10.0.0.3"}
        nodes = {n: _node_settings(n, base, tuple(_peer(p, address[p]) for p in address if p != n)) for n in address}
        assert {s.stack_label for s in nodes.values()} == {"dev"}, "the stack, from the ranks' names"
        keys = {}
        for n, s in nodes.items():
            made = _sh(render_key_command(s), env)
            assert made.returncode == 0, made.stderr
            keys[n] = parse_public_key(made.stdout, n)
        try:
            for s in nodes.values():
                peer_keys = [(p.node_name, keys[p.node_name]) for p in s.peers]
                done = _sh(render_install_command(s, peer_keys=peer_keys), env)
                assert done.returncode == 0, done.stderr
            lines = (home / ".ssh" / "authorized_keys").read_text().splitlines()
            assert sum(keys["spark-a"] in ln for ln in lines) == 2, "spark-a's key once per node it may stop"
            docker = Path(env["WD_TEST_DIR"]) / "dockerbin" / "docker"
            docker.write_text(NODE_DOCKER)
            calls = Path(env["WD_TEST_DIR"]) / "docker.calls"
            picked_another = False
            for asker in address:
                for target in address:
                    if asker == target:
                        continue
                    line = sshd_first_match(lines, keys[asker], address[asker])
                    picked_another |= f"memory-watchdog-{target}-peer-stop.sh" not in line
                    calls.unlink(missing_ok=True)
                    forced = subprocess.run(
                        ["sh", "-c", forced_command(line)],
                        cwd=home,
                        # on the target node: its docker runs its own rank only
                        env={**env, "WD_RUNNING": f"dsv41-exl3-dev-{target}", "SSH_ORIGINAL_COMMAND": "stop-from x"},
                        capture_output=True,
                        text=True,
                        timeout=20,
                        check=False,
                    )
                    assert forced.returncode == 0, forced.stdout + forced.stderr
                    kills = [c for c in calls.read_text().splitlines() if c.startswith("kill ")]
                    assert kills == [f"kill dsv41-exl3-dev-{target}"], (
                        f"{asker} stopping {target} through the line sshd picks ({line[:100]}...) killed {kills}"
                    )
                    assert forced.stdout.startswith(f"killed dsv41-exl3-dev-{target}"), forced.stdout
            assert picked_another, "the situation under test: sshd picked a line naming another node's script"
            log = (home / base.state_dir / "watchdog.log").read_text()
            assert "container=dsv41-exl3-dev-spark-c killed (asked by spark-a)" in log, log[-2000:]
        finally:
            for s in nodes.values():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
                    os.kill(int((home / s.state_dir / s.pid_name).read_text()), signal.SIGKILL)

    def test_the_peer_stop_with_nothing_of_the_stack_running_here_stops_nothing_and_says_so(
        self, installed: tuple[dict[str, str], WatchdogSettings]
    ) -> None:
        env, base = installed
        s = _node_settings("spark-b", base, (_peer("spark-a", "10.0.0.1"),))
        script = Path(env["WD_TEST_DIR"]) / "peer-stop.sh"
        script.write_text(render_peer_stop_script(s))
        (Path(env["WD_TEST_DIR"]) / "dockerbin" / "docker").write_text(NODE_DOCKER)
        done = subprocess.run(
            ["sh", str(script), "spark-a"], env={**env, "WD_RUNNING": ""}, capture_output=True, text=True, timeout=20
        )
        assert done.returncode == 0 and "nothing to stop" in done.stdout, done.stdout + done.stderr
        calls = (Path(env["WD_TEST_DIR"]) / "docker.calls").read_text().splitlines()
        assert not [c for c in calls if c.startswith("kill")], calls

    def test_parallel_key_generation_never_fails(self, tmp_path: Path) -> None:
        """Three nodes of one home (and a second run for one of them) at once, ten rounds: it used to fail 3 of 30
        times on ssh-keygen's `Overwrite (y/n)?`. Every run succeeds, nodes differ, two runs of a node agree."""
        if shutil.which("ssh-keygen") is None:
            pytest.skip("ssh-keygen not installed")
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
        nodes = [_settings(node_name=f"spark-{i}") for i in range(3)]
        for _ in range(10):
            for s in nodes:
                assert _sh(render_key_remove_command(s), env).returncode == 0
            runs = [
                subprocess.Popen(
                    ["sh", "-c", render_key_command(s)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for s in (*nodes, nodes[0])
            ]
            out = []
            for p in runs:
                stdout, stderr = p.communicate(timeout=30)
                assert p.returncode == 0, stderr
                out.append(parse_public_key(stdout, "spark"))
            assert len(set(out[:3])) == 3 and out[3] == out[0], out
            state = tmp_path / nodes[0].state_dir
            assert not [p.name for p in state.iterdir() if p.name.startswith(".")], "temp dirs left behind"


@pytest.mark.parametrize(
    ("host", "pattern"),
    [
        ("10.0.0.1", "10.0.0.1"),
        # the simulated nodes share one kernel: a connection to 127.0.0.N comes from 127.0.0.1
        ("127.0.0.3", "127.0.0.0/8"),
        ("::1", "::1"),
        # sshd matches names only with UseDNS (off by default): a name would refuse every stop
        ("spark-a.lan", None),
    ],
)
def test_from_pattern_is_the_address_the_peer_connects_from(host: str, pattern: str | None) -> None:
    assert from_pattern(host) == pattern
