"""The streams the gates watch: components/gates/rank_stream.sh run with `sh` against a fake `docker`, and
StreamRankSource through a fake `ssh` on PATH (drops, refusals, a missed event, the polling fallback, a flood)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from components import scripts
from components.gates import decisions, observations, stream_source
from components.gates.decisions import ModelsProbeResult, ReadySettings
from components.gates.observations import (
    ContainerState,
    GateFailure,
    LineSeen,
    LogEnded,
    Notice,
    RankSpec,
    StateSeen,
    SystemClock,
    Unobservable,
    UsageSeen,
)
from components.gates.stream_source import StreamRankSource
from components.ssh import SshAccess
from tests.support.bounds import bounds
from tests.support.fake_ssh import KEY, install_fake_ssh

HEAD = RankSpec(rank=0, node="spark-a", host="127.0.0.2", port=2222, user="root", container="dsv41-rank0")
STARTED = "2026-09-22T10:00:00Z"
STATS = (
    '{"BlockIO":"1.1GB / 0B","CPUPerc":"98.2%","Container":"dsv41-rank0","ID":"4f1c","MemPerc":"10.4%",'
    '"MemUsage":"12.5GiB / 119.7GiB","Name":"dsv41-rank0","NetIO":"0B / 0B","PIDs":"212"}'
)
LISTED = ModelsProbeResult("listed", ids=("m",))


def stamp(i: int) -> str:
    return f"2026-09-22T10:{i // 6000 % 60:02d}:{i // 100 % 60:02d}.{i % 100:02d}0000000Z"


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = install_fake_ssh(tmp_path, monkeypatch)
    (d / "state").write_text(f"running 0 {STARTED} false\n")
    (d / "log").write_text("")
    (d / "events").write_text("")
    yield d
    # the readers of this test's watches end before the next test changes PATH and FAKE_SSH_DIR under them
    for thread in threading.enumerate():
        if thread.name.startswith("rank-stream-"):
            thread.join(timeout=10)
            assert not thread.is_alive(), f"{thread.name} outlived its test"
    for pid in _pids(d):  # nothing the fakes started outlives a test (only our fake docker, by its pid)
        try:
            ours = str(tmp_path) in Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        if ours:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def _docker_calls(d: Path) -> str:
    path = d / "docker.log"
    return path.read_text() if path.exists() else ""


def _pids(d: Path) -> list[int]:
    path = d / "docker.pids"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def log(d: Path, *lines: str) -> None:
    with open(d / "log", "a") as f:
        f.writelines(line + "\n" for line in lines)


def event(d: Path, action: str, **attrs: str) -> None:
    ev = {
        "Type": "container",
        "Action": action,
        "status": action,
        "time": 1790000000,
        "timeNano": 1790000000123456789,
        "Actor": {"ID": "abc", "Attributes": {"name": HEAD.container, **attrs}},
    }
    with open(d / "events", "a") as f:
        f.write(json.dumps(ev) + "\n")


def collect(src: StreamRankSource, until: Any, timeout_s: float = 10.0) -> list[observations.Observation]:
    """Items until `until(items)` holds, within `timeout_s` (real time)."""
    got: list[observations.Observation] = []
    deadline = time.monotonic() + timeout_s
    while not until(got):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; got {got[-5:]}"
        got.extend(src.next_items(min(left, 0.5), 5.0))
    return got


def texts(items: list[observations.Observation]) -> list[str]:
    return [i.line.text for i in items if isinstance(i, LineSeen)]


def _wait_for(cond: Any, timeout_s: float = 10.0, what: Any = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.02)


# --- the node script ---------------------------------------------------------------------------------------


def _run_script(d: Path, watch: str) -> subprocess.Popen[bytes]:
    text = stream_source.stream_script(watch)
    env = {**os.environ, "PATH": f"{os.environ['FAKE_DOCKER_BIN']}:{os.environ['PATH']}", "FAKE_DOCKER_DIR": str(d)}
    return subprocess.Popen(["sh", "-c", text], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)


class _Records:
    """The script's stdout, read by a thread: records as they come, waited for with a bound."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.got: list[str] = []
        assert proc.stdout is not None
        out = proc.stdout
        self.thread = threading.Thread(
            target=lambda: self.got.extend(r.decode().rstrip("\n") for r in out), daemon=True
        )
        self.thread.start()

    def until(self, cond: Any) -> list[str]:
        _wait_for(lambda: cond(self.got), what=lambda: f"records so far: {self.got}")
        return list(self.got)


class TestScript:
    def test_state_then_resumed_log_then_events_each_one_record(self, fake: Path) -> None:
        log(
            fake,
            f"{stamp(1)} before",
            f"{stamp(2)} at the resume point",
            f"{stamp(3)} after",
            f"{stamp(4)} " + "x" * 5000,
        )
        proc = _run_script(fake, f"{HEAD.container}={stamp(2)}")
        records = _Records(proc)
        try:
            got = records.until(lambda g: "R" in g and len([r for r in g if r.startswith("L ")]) == 3)
            assert got[0] == f"S {HEAD.container} running 0 {STARTED} false"
            lines = [r for r in got if r.startswith("L ")]
            assert lines[0] == f"L {HEAD.container} {stamp(2)} at the resume point"  # --since is inclusive
            assert lines[1] == f"L {HEAD.container} {stamp(3)} after"
            assert (
                len(lines[2].encode()) == len(f"L {HEAD.container} ") + stream_source.STREAM_MAX_LINE
            )  # cut: one write
            _wait_for(lambda: (fake / "events.ready").exists())
            event(fake, "die", exitCode="137")
            (fake / "state").write_text(f"exited 137 {STARTED} false\n")
            after = records.until(lambda g: len(g) == len(got) + 3)[len(got) :]
            die = next(r for r in after if r.startswith("E "))
            assert json.loads(die[2:])["Action"] == "die"
            ended = [r for r in after if not r.startswith("E ")]  # the log's end, then the state read after it
            assert ended == [f"X {HEAD.container}", f"S {HEAD.container} exited 137 {STARTED} false"]
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            assert proc.wait(timeout=10) == 0
        docker = (fake / "docker.log").read_text().splitlines()
        assert "events --filter container=dsv41-rank0 --format {{json .}}" in docker
        assert f"logs -f --timestamps --since {stamp(2)} {HEAD.container}" in docker
        _wait_for(lambda: not any(_alive(p) for p in _pids(fake)))  # its docker clients stopped with it

    def test_a_usage_request_on_stdin_answers_with_docker_stats_records(self, fake: Path) -> None:
        proc = _run_script(fake, f"{HEAD.container}=")
        records = _Records(proc)
        assert proc.stdin is not None
        try:
            records.until(lambda g: "R" in g)
            (fake / "stats").write_text(STATS + "\n")
            proc.stdin.write(b"U\n")
            proc.stdin.flush()
            got = records.until(lambda g: any(r.startswith("U ") for r in g))
            assert f"U {STATS}" in got
            (fake / "stats").unlink()
            (fake / "stats.fail").write_text("permission denied while trying to connect to the Docker daemon")
            _wait_for(lambda: _docker_calls(fake).count("stats --no-stream") == 1)
            time.sleep(0.2)  # the first sample's job has ended: the next one is not skipped
            proc.stdin.write(b"U\n")
            proc.stdin.flush()
            failed = records.until(lambda g: any(r.startswith("u ") for r in g))
            assert "u permission denied while trying to connect to the Docker daemon" in failed
        finally:
            proc.stdin.close()
            assert proc.wait(timeout=10) == 0
        assert f"stats --no-stream --format {{{{json .}}}} {HEAD.container}" in _docker_calls(fake)
        _wait_for(lambda: not any(_alive(p) for p in _pids(fake)))

    def test_a_usage_sample_starts_with_the_nodes_own_counters(
        self, fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # GB10: the node's counters are what moves while a worker loads with its container flat
        (tmp_path / "meminfo").write_text("MemTotal: 125000000 kB\nMemAvailable:   100000000 kB\n")
        (tmp_path / "mountstats").write_text(
            "device rootfs mounted on / with fstype rootfs\n"
            "device 10.0.0.1:/srv/dsv41 mounted on /var/lib/docker/volumes/v1/_data with fstype nfs4 statvers=1.1\n"
            "\tbytes:\t5 0 0 0 1000 0 2 0\n"
            "device 10.0.0.1:/srv/dsv41 mounted on /var/lib/docker/volumes/v2/_data with fstype nfs4 statvers=1.1\n"
            "\tbytes:\t5 0 0 0 234 0 2 0\n"
            "device 10.0.0.9:/backup mounted on /mnt/backup with fstype nfs statvers=1.1\n"
            "\tbytes:\t5 0 0 0 999999 0 2 0\n"
        )
        for name, flags, rx in (("enp1s0f1np1", "0x1003", "777"), ("lo", "0x9", "555")):
            (tmp_path / "class" / "net" / name / "statistics").mkdir(parents=True)
            (tmp_path / "class" / "net" / name / "flags").write_text(flags + "\n")
            (tmp_path / "class" / "net" / name / "statistics" / "rx_bytes").write_text(rx + "\n")
        monkeypatch.setenv("DSV41_MEMINFO", str(tmp_path / "meminfo"))
        monkeypatch.setenv("DSV41_MOUNTSTATS", str(tmp_path / "mountstats"))
        monkeypatch.setenv("DSV41_SYSFS_ROOT", str(tmp_path))
        (fake / "stats").write_text(STATS + "\n")
        got = {}
        for interface, server in (("enp1s0f1np1", "10.0.0.1"), ("lo", ""), ("eth9", "10.0.0.2")):
            node = RankSpec(
                rank=1,
                node="spark-b",
                host="h",
                user="u",
                container=HEAD.container,
                fabric_interface=interface,
                nfs_server=server,
            )
            text = stream_source.stream_script(f"{HEAD.container}=", node)
            env = {
                **os.environ,
                "PATH": f"{os.environ['FAKE_DOCKER_BIN']}:{os.environ['PATH']}",
                "FAKE_DOCKER_DIR": str(fake),
            }
            proc = subprocess.Popen(["sh", "-c", text], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            records = _Records(proc)
            assert proc.stdin is not None
            try:
                records.until(lambda g: "R" in g)
                proc.stdin.write(b"U\n")
                proc.stdin.flush()
                out = records.until(lambda g: any(r.startswith("U ") for r in g))
            finally:
                proc.stdin.close()
                assert proc.wait(timeout=10) == 0
            samples = [r for r in out if r[:2] in ("N ", "U ")]
            assert samples[0].startswith("N ") and samples[1].startswith("U "), out
            got[interface] = samples[0]
        # MemAvailable in bytes; only the weights' server's mounts, summed (serverreadbytes); rx, not on loopback
        assert got["enp1s0f1np1"] == f"N {100000000 * 1024} 1234 777"
        assert got["lo"] == f"N {100000000 * 1024} - -", (
            "no NFS server given, and lo is the machine's, not the fabric's"
        )
        assert got["eth9"] == f"N {100000000 * 1024} - -", "no mount of that server, no such interface"
        seen = observations.parse_node_counters(got["enp1s0f1np1"][2:])
        assert seen == observations.NodeCounters(100000000 * 1024, 1234, 777)
        assert observations.parse_node_counters("- - -") == observations.NodeCounters()

    def test_from_the_container_start_when_no_resume_point(self, fake: Path) -> None:
        proc = _run_script(fake, f"{HEAD.container}=")
        try:
            _Records(proc).until(lambda g: "R" in g)
            _wait_for(lambda: "logs -f" in _docker_calls(fake))
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=10)
        # a second before StartedAt (unix seconds): docker stamps a line written at once before its StartedAt
        since = int(datetime.fromisoformat(STARTED.replace("Z", "+00:00")).timestamp()) - 1
        assert f"logs -f --timestamps --since {since} {HEAD.container}" in (fake / "docker.log").read_text()
        _wait_for(lambda: not any(_alive(p) for p in _pids(fake)))

    def test_missing_container_and_missing_tools(self, fake: Path) -> None:
        (fake / "state").unlink()
        (fake / "inspect.out").write_text("")
        (fake / "inspect.err").write_text("Error: No such object: dsv41-rank0\n")
        (fake / "inspect.rc").write_text("1")
        proc = _run_script(fake, f"{HEAD.container}=")
        assert _Records(proc).until(lambda g: "R" in g) == [f"S {HEAD.container} missing", "R"]
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
        bare = fake.parent / "bare"
        bare.mkdir()
        (bare / "docker").symlink_to(Path(os.environ["FAKE_DOCKER_BIN"]) / "docker")
        text = scripts.render("gates/rank_stream.sh", {"WATCH": "c=", "MAX_LINE": 10})
        sh = subprocess.run(["sh", "-c", "command -v sh"], capture_output=True, text=True, check=True).stdout.strip()
        done = subprocess.run(
            [sh, "-c", text], env={"PATH": str(bare)}, capture_output=True, text=True, timeout=10, check=False
        )
        assert done.returncode == 0 and done.stdout.startswith("F awk is not installed on "), done


# --- the source through a fake ssh ---------------------------------------------------------------------------


class TestStreamRankSource:
    def test_one_session_per_node_with_the_master_options_and_no_key_in_argv(self, fake: Path) -> None:
        log(fake, f"{stamp(1)} one", f"{stamp(2)} two")
        src = StreamRankSource([HEAD], SshAccess(private_key=KEY))
        try:
            got = collect(src, lambda g: len(texts(g)) == 2)
            assert isinstance(got[0], StateSeen) and got[0].state == ContainerState("running", 0, STARTED)
            log(fake, f"{stamp(3)} three")
            assert texts(collect(src, lambda g: len(texts(g)) == 1)) == ["three"]
        finally:
            src.close()
        assert (fake / "stream.n").read_text().strip() == "1", "one ssh session for the whole watch"
        argv = (fake / "argv.log").read_text()
        assert "ControlMaster=auto" in argv and "ControlPath=" in argv and "SECRETKEYMATERIAL" not in argv
        assert (
            f"WATCH={HEAD.container}=; MAX_LINE=2000; FABRIC_IF=" in (fake / "remote.log").read_text().splitlines()[0]
        )

    def test_a_usage_request_reaches_the_gate_through_the_session(
        self, fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        (fake / "stats").write_text(STATS + "\n")
        (tmp_path / "meminfo").write_text("MemAvailable: 2048 kB\n")
        monkeypatch.setenv("DSV41_MEMINFO", str(tmp_path / "meminfo"))
        src = StreamRankSource([HEAD])
        try:
            collect(src, lambda g: any(isinstance(i, StateSeen) for i in g))
            _wait_for(lambda: "logs -f" in _docker_calls(fake))
            src.request_usage()
            got = collect(src, lambda g: any(isinstance(i, UsageSeen) for i in g))
        finally:
            src.close()
        seen = next(i for i in got if isinstance(i, UsageSeen))
        assert seen.rank == 0 and seen.usage is not None and seen.usage.memory_bytes == 12.5 * 2**30
        assert seen.usage.node == observations.NodeCounters(2048 * 1024, None, None), "the node's counters ride along"
        assert (fake / "stream.n").read_text().strip() == "1", "asked over the open session, no new ssh"

    def test_a_dropped_session_reconnects_and_resumes_without_losing_or_repeating_a_line(self, fake: Path) -> None:
        log(fake, *(f"{stamp(i)} line {i}" for i in range(1, 51)))
        log(fake, f"{stamp(50)} same instant")
        src = StreamRankSource([HEAD])
        try:
            got = collect(src, lambda g: len(texts(g)) == 51)
            (fake / "drop").touch()
            got = collect(src, lambda g: any(isinstance(i, Notice) for i in g))
            assert "ended" in next(i.text for i in got if isinstance(i, Notice))
            # written while disconnected or after: one more at the last instant, then later ones
            log(fake, f"{stamp(50)} also at that instant", *(f"{stamp(i)} line {i}" for i in range(51, 101)))
            got += collect(src, lambda g: "line 100" in texts(g))
            after = texts(got)
            assert after == ["also at that instant", *(f"line {i}" for i in range(51, 101))]
        finally:
            src.close()
        remote = (fake / "remote.log").read_text().splitlines()
        assert len(remote) == 2 and f"WATCH={HEAD.container}={stamp(50)}; MAX_LINE=2000;" in remote[1]

    def test_a_die_missed_while_disconnected_is_recovered_from_the_state_read(
        self, fake: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(stream_source, "RECONNECT_BACKOFF_S", (1.0,))
        log(fake, f"{stamp(1)} loading")
        src = StreamRankSource([HEAD])
        try:
            collect(src, lambda g: "loading" in texts(g))
            (fake / "refuse").write_text("1")  # the first reconnect fails: a window with no stream at all
            (fake / "drop").touch()
            got = collect(src, lambda g: any(isinstance(i, Unobservable) for i in g))
            # the rank dies in the window; no event of it will ever arrive
            log(fake, f"{stamp(2)} Killed")
            (fake / "state").write_text(f"exited 137 {STARTED} true\n")
            got = collect(src, lambda g: any(isinstance(i, StateSeen) for i in g))
            seen = next(i for i in got if isinstance(i, StateSeen))
            assert seen.state == ContainerState("exited", 137, STARTED, oom_killed=True)
            got += collect(src, lambda g: any(isinstance(i, LogEnded) for i in g))
            assert "Killed" in texts(got)
        finally:
            src.close()

    def test_the_gate_fails_on_the_die_event_with_the_exit_code(self, fake: Path) -> None:
        log(fake, f"{stamp(1)} loading")
        src = StreamRankSource([HEAD])
        settings = ReadySettings(bounds=bounds(ready_timeout_s=30, stall_s=30))

        def die_soon() -> None:
            _wait_for(lambda: "logs -f" in _docker_calls(fake))
            time.sleep(0.3)
            _wait_for(lambda: (fake / "events.ready").exists())
            log(fake, f"{stamp(2)} RuntimeError: CUDA error")
            event(fake, "oom")
            event(fake, "die", exitCode="137")
            (fake / "state").write_text(f"exited 137 {STARTED} true\n")

        killer = threading.Thread(target=die_soon)
        killer.start()
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready([HEAD], src, settings, SystemClock(), lambda _: None, lambda: LISTED, "m")
        killer.join()
        msg = str(err.value)
        assert msg.startswith("rank 0 (node spark-a, container dsv41-rank0) is exited with exit code 137")
        assert "OOM killer" in msg and "RuntimeError: CUDA error" in msg

    def test_a_drop_mid_boot_does_not_fail_a_healthy_boot(self, fake: Path) -> None:
        log(fake, f"{stamp(1)} Starting to load model /model...")
        src = StreamRankSource([HEAD])
        said: list[str] = []
        settings = ReadySettings(bounds=bounds(ready_timeout_s=30, stall_s=30))

        def boot() -> None:
            _wait_for(lambda: "logs -f" in _docker_calls(fake))
            (fake / "drop").touch()
            _wait_for(lambda: (fake / "stream.n").read_text().strip() == "2")
            log(fake, f"{stamp(2)} (APIServer pid=1) INFO:     Application startup complete.")

        booter = threading.Thread(target=boot)
        booter.start()
        res = decisions.wait_for_ready([HEAD], src, settings, SystemClock(), said.append, lambda: LISTED, "m")
        booter.join()
        assert res.phases["ready"] == stamp(2)
        assert any("reconnecting" in m for m in said)

    def test_a_watch_closed_at_once_leaves_no_docker_client_behind(self, fake: Path) -> None:
        log(fake, f"{stamp(1)} the whole boot, read at once")  # a gate re-run over a server that is up
        for _ in range(4):
            src = StreamRankSource([HEAD])
            collect(src, lambda g: bool(texts(g)))
            src.close()
        _wait_for(
            lambda: not any(_alive(p) for p in _pids(fake)),
            what=lambda: f"still running: {[p for p in _pids(fake) if _alive(p)]}",
        )

    def test_three_refused_connections_in_a_row_fail_the_gate(
        self, fake: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(stream_source, "RECONNECT_BACKOFF_S", (0.1,))
        (fake / "refuse").write_text("3")
        with pytest.raises(GateFailure, match=r"cannot observe rank 0 .* 3 failures in a row.*Connection refused"):
            decisions.wait_for_rendezvous(
                [HEAD],
                StreamRankSource([HEAD]),
                decisions.RendezvousSettings(bounds=bounds(rendezvous_timeout_s=20)),
                SystemClock(),
                lambda _: None,
            )

    def test_a_log_that_keeps_ending_while_the_rank_runs_falls_back_to_polling(
        self, fake: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(stream_source, "RECONNECT_BACKOFF_S", (0.1,))
        (fake / "logs.end").touch()  # e.g. a log driver docker cannot follow
        log(fake, f"{stamp(1)} one line")
        src = StreamRankSource([HEAD])
        try:
            got = collect(src, lambda g: any(isinstance(i, Notice) and "polling" in i.text for i in g))
        finally:
            src.close()
        notice = next(i.text for i in got if isinstance(i, Notice) and "polling" in i.text)
        assert "ended within 5 s (the log of dsv41-rank0 ended while it runs)" in notice
        assert (fake / "stream.n").read_text().strip() == str(stream_source.STREAM_START_FAILURES)
        assert texts(got).count("one line") == 1, "resumed, not read again"

    def test_a_node_that_cannot_stream_is_polled_and_the_progress_says_so(self, fake: Path) -> None:
        (fake / "nostream").touch()
        for name in ("state", "log", "events"):
            (fake / name).unlink()
        (fake / "inspect.out").write_text(f"running 0 {STARTED}\n")
        (fake / "inspect.rc").write_text("0")
        (fake / "logs.1.out").write_text(
            f"{stamp(1)} (Worker_TP0 pid=1) rank 0 in world size 1 is assigned as DP rank 0, PP rank 0, TP rank 0\n"
        )
        (fake / "logs.1.rc").write_text("0")
        said: list[str] = []
        res = decisions.wait_for_rendezvous(
            [HEAD],
            StreamRankSource([HEAD]),
            decisions.RendezvousSettings(bounds=bounds(rendezvous_timeout_s=20), poll_interval_s=0.1),
            SystemClock(),
            said.append,
        )
        assert res.world_size == 1
        assert any("cannot stream: awk is not installed" in m and "polling node spark-a instead" in m for m in said)
        remote = (fake / "remote.log").read_text()
        assert "docker inspect" in remote and "docker logs --timestamps --since" in remote

    def test_a_polled_node_answers_usage_requests_with_docker_stats(self, fake: Path) -> None:
        (fake / "nostream").touch()
        for name in ("state", "log", "events"):
            (fake / name).unlink()
        (fake / "inspect.out").write_text(f"running 0 {STARTED}\n")
        (fake / "inspect.rc").write_text("0")
        (fake / "logs.out").write_text("")
        (fake / "logs.rc").write_text("0")
        (fake / "stats.out").write_text(STATS + "\n")
        (fake / "stats.rc").write_text("0")
        src = StreamRankSource([HEAD])
        try:
            collect(src, lambda g: any(isinstance(i, Notice) and "polling" in i.text for i in g))
            src.request_usage()
            got = collect(src, lambda g: any(isinstance(i, UsageSeen) for i in g))
        finally:
            src.close()
        seen = next(i for i in got if isinstance(i, UsageSeen))
        assert seen.usage is not None and seen.usage.block_read_bytes == 1.1e9


# --- a flood of lines ------------------------------------------------------------------------------------------


class _FloodProc:
    """A Popen stand-in whose stdout is the stream script's records: `n` log lines, then a die. `at_die` is
    called when the reader takes the die record off the pipe."""

    def __init__(self, n: int, at_die: Any) -> None:
        self.n, self.at_die = n, at_die
        self.returncode: int | None = None
        self.stdin = None
        self.stdout = self._records()

    def _records(self) -> Iterator[bytes]:
        yield f"S {HEAD.container} running 0 {STARTED} false\n".encode()
        yield b"R\n"
        for i in range(self.n):
            yield f"L {HEAD.container} {stamp(i)} (Worker_TP0 pid=1) WARNING flood line {i} {'x' * 80}\n".encode()
        die = {"Action": "die", "Actor": {"Attributes": {"name": HEAD.container, "exitCode": "1"}}}
        self.at_die()
        yield f"E {json.dumps(die)}\n".encode()
        yield f"X {HEAD.container}\n".encode()
        while True:  # the session stays open, as a real one does until it is closed
            time.sleep(0.05)
            if self.returncode is not None:
                return

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.returncode = -15

    def kill(self) -> None:
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode or 0


def test_a_flood_of_100k_lines_keeps_memory_bounded_and_does_not_delay_the_die(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 100_000
    seen = {"lines": 0, "max_batch": 0, "max_queued": 0, "die_read": -1, "die_decided": -1, "calls": 0, "max_alive": 0}
    procs: list[_FloodProc] = []

    def die_read() -> None:
        seen["die_read"] = seen["lines"]

    def popen(argv: list[str], **_: Any) -> _FloodProc:
        procs.append(_FloodProc(n, die_read))
        return procs[-1]

    src = StreamRankSource([HEAD], popen=popen)  # type: ignore[arg-type]
    real_next = src.next_items

    def counting(timeout_s: float, pace_s: float) -> list[observations.Observation]:
        items = real_next(timeout_s, pace_s)
        if seen["die_decided"] < 0 and any(isinstance(i, StateSeen) and not i.state.running for i in items):
            seen["die_decided"] = seen["lines"]
        seen["lines"] += sum(isinstance(i, LineSeen) for i in items)
        seen["max_batch"] = max(seen["max_batch"], len(items))
        seen["max_queued"] = max(seen["max_queued"], src._queue.qsize())
        seen["calls"] += 1
        if seen["calls"] % 20 == 0 or seen["die_decided"] >= 0:  # log lines alive anywhere in the process
            seen["max_alive"] = max(
                seen["max_alive"], sum(isinstance(o, observations.LogLine) for o in gc.get_objects())
            )
        return items

    monkeypatch.setattr(src, "next_items", counting)
    settings = ReadySettings(bounds=bounds(ready_timeout_s=120, stall_s=60))
    with pytest.raises(GateFailure) as err:
        decisions.wait_for_ready([HEAD], src, settings, SystemClock(), lambda _: None, lambda: LISTED, "m")
    msg = str(err.value)
    assert msg.startswith("rank 0 (node spark-a, container dsv41-rank0) is exited with exit code 1")
    assert seen["lines"] == n, "every line reached the gate, none dropped"
    assert f"flood line {n - 1} " in msg and f"flood line {n - 21} " not in msg  # the tail: the last 20 only
    # Detection: once the reader has the die, the gate decides on it with the next batch it takes, however many
    # lines are still queued behind (bounded by the queue): the flood never stands between the two.
    assert 0 <= seen["die_decided"] - seen["die_read"] <= stream_source.STREAM_BATCH_ITEMS
    assert n - seen["die_read"] <= stream_source.STREAM_QUEUE_ITEMS + stream_source.STREAM_BATCH_ITEMS + 1
    assert (
        seen["max_batch"] <= stream_source.STREAM_BATCH_ITEMS + 10
        and seen["max_queued"] <= stream_source.STREAM_QUEUE_ITEMS
    )
    # Memory: what is held at any time is the queue, one batch and the tails, never the flood (counted: the log
    # lines alive in the whole process, sampled while it ran).
    assert (
        0
        < seen["max_alive"]
        <= stream_source.STREAM_QUEUE_ITEMS + 2 * stream_source.STREAM_BATCH_ITEMS + settings.tail_lines
    )
    assert len(procs) == 1
