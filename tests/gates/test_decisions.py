"""Gate decisions against scripted ranks (fake clock), the models probe, and the SSH poll source."""

from __future__ import annotations

import socket
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from components.config import Gates
from components.gates import decisions, observations, poll_source
from components.gates.decisions import GateBounds, ModelsEndpoint, ModelsProbeResult, ReadySettings, RendezvousSettings
from components.gates.observations import (
    ContainerState,
    ContainerUsage,
    GateFailure,
    LogLine,
    NodeCounters,
    RankSpec,
    SourceError,
    SystemClock,
)
from components.gates.poll_source import SshRankSource
from components.ssh import SshAccess
from tests.support.bounds import bounds
from tests.support.fake_ssh import KEY, ModelsServer, canned, install_fake_ssh, serve_models
from tests.support.scripts import sent_script

HEAD = RankSpec(rank=0, node="spark-a", host="127.0.0.2", port=2222, user="root", container="dsv41-rank0")
WORKER = RankSpec(rank=1, node="spark-b", host="127.0.0.3", port=2222, user="root", container="dsv41-rank1")
RANKS = [HEAD, WORKER]

# --- realistic vLLM lines (0.33 wording, plus older releases where they differ) -------------------
L_HEADLESS = (
    "INFO 09-22 10:00:01 [api_server.py:1234] Launching vLLM (v0.33.0) headless multiproc executor, "
    "with head node address 10.0.0.1 for torch.distributed process group."
)
L_INIT = (
    "(Worker_TP0 pid=211) INFO 09-22 10:00:05 [parallel_state.py:1208] world_size=2 rank=0 local_rank=0 "
    "distributed_init_method=tcp://10.0.0.1:29521 backend=nccl"
)
L_INIT_W = L_INIT.replace("rank=0 local_rank", "rank=1 local_rank").replace("TP0", "TP1")
L_LEADER = (
    "(EngineCore_DP0 pid=180) INFO 09-22 10:00:04 [core.py:700] DP group leader: node_rank=0, node_rank_within_dp=0"
)
L_ASSIGNED_0 = (
    "(Worker_TP0 pid=211) INFO 09-22 10:00:40 [parallel_state.py:1611] rank 0 in world size 2 is assigned "
    "as DP rank 0, PP rank 0, PCP rank 0, TP rank 0, EP rank 0, EPLB rank N/A"
)
L_ASSIGNED_1 = L_ASSIGNED_0.replace("rank 0 in world size", "rank 1 in world size").replace("TP rank 0", "TP rank 1")
L_ASSIGNED_OLD = (
    "(VllmWorker rank=1 pid=99) INFO 03-01 08:00:00 [parallel_state.py:1004] rank 1 in world size 2 "
    "is assigned as DP rank 0, PP rank 0, TP rank 1"
)
L_NCCL = "(Worker_TP1 pid=88) INFO 09-22 10:00:41 [pynccl.py:103] vLLM is using nccl==2.27.7"
L_DIST_STORE = "torch.distributed.DistStoreError: Timed out after 601 seconds waiting for clients. 1/2 clients joined."
L_LOAD = "(Worker_TP0 pid=211) INFO 09-22 10:01:00 [gpu_model_runner.py:2930] Starting to load model /model..."
L_LOADED = (
    "(Worker_TP0 pid=211) INFO 09-22 10:05:10 [gpu_model_runner.py:2990] Model loading took 99.52 GiB "
    "memory and 250.123456 seconds"
)
L_WEIGHTS_OLD = "INFO 03-01 08:05:00 [default_loader.py:262] Loading weights took 245.10 seconds"
L_KV = "(Worker_TP0 pid=211) INFO 09-22 10:20:00 [gpu_worker.py:390] Available KV cache memory: 2.5 GiB"
L_KV_SIZE = (
    "(EngineCore_DP0 pid=180) INFO 09-22 10:20:01 [kv_cache_utils.py:1087] GPU KV cache size: 612,480 "
    "tokens, Maximum concurrency for 600,000 tokens per request: 1.02x"
)
L_KV_OLD = "INFO 03-01 08:10:00 [kv_cache_utils.py:716] Maximum concurrency for 600000 tokens per request: 1.02x"
L_GRAPH = (
    "(Worker_TP0 pid=211) INFO 09-22 10:21:00 [gpu_model_runner.py:3800] Capturing CUDA graphs "
    "(decode, FULL): 100%|##########| 9/9 [00:03<00:00,  2.61it/s]"
)
L_GRAPH_DONE = (
    "(Worker_TP0 pid=211) INFO 09-22 10:21:05 [gpu_model_runner.py:3900] Graph capturing finished in "
    "5 secs, took 0.12 GiB"
)
L_WARM = (
    "(EngineCore_DP0 pid=180) INFO 09-22 10:30:00 [core.py:250] init engine (profile, create kv cache, "
    "warmup model) took 1712.35 seconds"
)
L_SERVER = "(APIServer pid=1) INFO 09-22 10:30:05 [api_server.py:1900] Starting vLLM server on http://0.0.0.0:8888"
L_SERVER_OLD = "INFO 03-01 08:20:00 [api_server.py:1351] Starting vLLM API server 0 on http://0.0.0.0:8888"
L_COMPLETE = "(APIServer pid=1) INFO:     Application startup complete."
L_SHM = (
    "(EngineCore_DP0 pid=180) INFO 09-22 10:10:00 [shm_broadcast.py:466] No available shared memory "
    "broadcast block found in 60 seconds. This typically happens when some processes are hanging."
)
# What real vLLM 0.32 printed when the worker was killed after ready (../shared/notes/vllm-real.md).
L_WORKER_PROC = "(EngineCore_DP0 pid=180) ERROR 12-02 10:40:01 [multiproc_executor.py:240] WorkerProc hit an exception."
L_GLOO_CLOSED = (
    "(EngineCore_DP0 pid=180) RuntimeError: Worker failed with error '[../third_party/gloo/gloo/transport/"
    "tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:40061'"
)
L_KV_WORKER = (
    "(Worker_TP1 pid=90) INFO 12-02 10:39:00 [gpu_worker.py:400] Explicitly set (1.0/15.96) GiB for KV cache on node 0."
)
L_ARGS_WITH_KEY = (
    "(APIServer pid=1) INFO 09-22 10:00:00 [utils.py:250] non-default args: {'model': '/model', "
    "'api_key': 'sk-live-very-secret-0123456789ab', 'port': 8888}"
)


# --- fakes ---------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.t += seconds

    def now(self) -> datetime:
        return datetime(2026, 9, 22, 10, 0, tzinfo=UTC) + timedelta(seconds=self.t)


def usage(memory_gib: float, read_gb: float = 0.0) -> ContainerUsage:
    """A docker stats sample as the gate gets it (memory binary units, block I/O decimal, as docker prints)."""
    return ContainerUsage(
        memory_gib * 2**30, read_gb * 1e9, 0.0, f"memory {memory_gib:.4g}GiB, block I/O {read_gb:.3g}GB / 0B"
    )


def FROZEN(_t: float) -> ContainerUsage:  # noqa: N802 - a constant: a container whose counters never move
    return usage(3.5)


def loading(start: float, end: float, gib: float, then: float | None = None) -> Callable[[float], ContainerUsage]:
    """Memory growing linearly from `start` to `end` (the weights arriving: page cache and tensors), flat after;
    `then`: the time it stops growing early (a rank that hangs mid-load)."""
    stop = end if then is None else then

    def at(t: float) -> ContainerUsage:
        done = min(max(t, start), stop) - start
        return usage(2.0 + gib * done / (end - start))

    return at


@dataclass
class ScriptedRank:
    lines: list[tuple[float, str]] = field(default_factory=list)  # (time it appears, text)
    exits_at: float | None = None
    exit_code: int = 1
    errors_at: set[int] = field(default_factory=set)  # state() call numbers that fail
    restarted_at: float | None = None
    delivered: int = 0
    state_calls: int = 0
    usage: Callable[[float], ContainerUsage] = FROZEN  # its container's counters at a time
    usage_calls: int = 0


class ScriptedPoller:
    """Lines appear and containers exit at scripted times on the fake clock, looked at by polling."""

    def __init__(self, clock: FakeClock, ranks: dict[int, ScriptedRank]) -> None:
        self.clock, self.ranks = clock, ranks

    def new_lines(self, rank: int) -> list[LogLine]:
        r = self.ranks[rank]
        due = [(t, x) for t, x in r.lines if t <= self.clock.t]
        fresh, r.delivered = due[r.delivered :], len(due)
        return [LogLine(text=x, at=f"ts+{t:g}") for t, x in fresh]

    def state(self, rank: int) -> ContainerState:
        r = self.ranks[rank]
        r.state_calls += 1
        if r.state_calls in r.errors_at:
            raise SourceError("ssh root@127.0.0.3:2222 failed: Connection refused")
        if r.exits_at is not None and self.clock.t >= r.exits_at:
            return ContainerState("exited", r.exit_code, "2026-09-22T10:00:00Z")
        started = "2026-09-22T10:00:00Z"
        if r.restarted_at is not None and self.clock.t >= r.restarted_at:
            started = "2026-09-22T10:05:00Z"
        return ContainerState("running", 0, started)

    def usage(self, rank: int) -> ContainerUsage:
        r = self.ranks[rank]
        r.usage_calls += 1
        return r.usage(self.clock.t)


def ScriptedSource(
    clock: FakeClock,
    ranks: dict[int, ScriptedRank],  # noqa: N802 - stands for the old class
    wait_clock: observations.Clock | None = None,
) -> observations.PollingRankSource:
    """The scripted ranks polled as the gates used to poll (and still do for a node that cannot stream); the
    polls wait on `wait_clock` (default: the fake clock)."""
    return observations.PollingRankSource(ScriptedPoller(clock, ranks), sorted(ranks), wait_clock or clock)


def _cumulative(sleeps: list[float]) -> list[float]:
    """The clock time at which each sleep started."""
    out, t = [], 0.0
    for seconds in sleeps:
        out.append(t)
        t += seconds
    return out


BOUNDS = GateBounds.field_names()


def _rdv(**kw: float) -> RendezvousSettings:
    rest = {k: v for k, v in kw.items() if k not in BOUNDS}
    limits = bounds(**{k: v for k, v in kw.items() if k in BOUNDS})
    return RendezvousSettings(**{"bounds": limits, "poll_interval_s": 5.0, **rest})  # type: ignore[arg-type]


def _ready(**kw: Any) -> ReadySettings:
    rest = {k: v for k, v in kw.items() if k not in BOUNDS}
    limits = bounds(**{k: v for k, v in kw.items() if k in BOUNDS})
    base = {"bounds": limits, "poll_interval_s": 5.0, "progress_interval_s": 30.0}
    return ReadySettings(**{**base, **rest})


class Probe:
    def __init__(self, result: ModelsProbeResult) -> None:
        self.result, self.calls = result, 0

    def __call__(self) -> ModelsProbeResult:
        self.calls += 1
        return self.result


LISTED = ModelsProbeResult("listed", ids=("DeepSeek-v4.1-Flash-EXL3",))


def _noop(_: str) -> None:
    pass


# --- rendezvous gate -----------------------------------------------------------------------------------


class TestRendezvous:
    def test_passes_when_every_rank_logged_a_join_line(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, L_LEADER), (2, L_INIT), (31, L_ASSIGNED_0)]),
                1: ScriptedRank(lines=[(1, L_HEADLESS), (3, L_INIT_W), (32, L_NCCL)]),
            },
        )
        res = decisions.wait_for_rendezvous(RANKS, src, _rdv(), clock, _noop)
        assert 32 <= res.elapsed_s <= 37
        assert res.world_size == 2
        assert res.joined_at == {0: "ts+31", 1: "ts+32"}

    def test_one_rank_joined_is_not_enough_and_timeout_names_the_missing_rank(self) -> None:
        clock = FakeClock()
        head_lines = [(1, L_INIT), (2, L_ASSIGNED_0)] + [(3 + i, f"head line {i}") for i in range(25)]
        src = ScriptedSource(clock, {0: ScriptedRank(lines=head_lines), 1: ScriptedRank(lines=[(4, L_INIT_W)])})
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_rendezvous(RANKS, src, _rdv(rendezvous_timeout_s=60), clock, _noop)
        msg = str(err.value)
        assert 60 <= clock.t <= 65
        first = msg.splitlines()[0]
        assert "rank 1 (node spark-b" in first and "rank 0 (" not in first.split("within")[1]
        assert "reached init_process_group but never joined" in first
        for cause in ("NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX", "firewall", "stale rank container", "10.0.0.1:29521"):
            assert cause in msg, cause
        # the last 20 lines of every rank, not more
        assert "head line 24" in msg and "head line 5" in msg and "head line 4\n" not in msg
        assert L_INIT_W in msg
        assert "--- rank 0 (node spark-a, container dsv41-rank0), last 20 lines ---" in msg

    def test_rank_that_never_reached_init_is_told_apart(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(lines=[(1, L_ASSIGNED_0)]), 1: ScriptedRank()})
        with pytest.raises(GateFailure, match="never reached the rendezvous") as err:
            decisions.wait_for_rendezvous(RANKS, src, _rdv(rendezvous_timeout_s=20), clock, _noop)
        assert "(no log lines seen)" in str(err.value)

    def test_exited_container_fails_on_the_next_poll(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, L_INIT)]),
                1: ScriptedRank(
                    lines=[(2, "Traceback (most recent call last):"), (11, "RuntimeError: NCCL error")],
                    exits_at=12,
                    exit_code=1,
                ),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_rendezvous(RANKS, src, _rdv(), clock, _noop)
        assert 12 <= clock.t <= 17
        msg = str(err.value)
        assert msg.startswith("rank 1 (node spark-b, container dsv41-rank1) is exited with exit code 1")
        assert "RuntimeError: NCCL error" in msg  # the lines logged just before the exit are drained

    def test_dist_store_error_fails_at_once(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, L_INIT), (40, L_DIST_STORE)]),
                1: ScriptedRank(lines=[(1, L_HEADLESS)]),
            },
        )
        with pytest.raises(GateFailure, match="logged a rendezvous failure") as err:
            decisions.wait_for_rendezvous(RANKS, src, _rdv(rendezvous_timeout_s=900), clock, _noop)
        assert 40 <= clock.t <= 45
        assert "NCCL_SOCKET_IFNAME" in str(err.value)

    def test_restarted_container_fails(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(), 1: ScriptedRank(restarted_at=20)})
        with pytest.raises(GateFailure, match=r"rank 1 .* restarted"):
            decisions.wait_for_rendezvous(RANKS, src, _rdv(), clock, _noop)
        assert 20 <= clock.t <= 25

    def test_transient_ssh_errors_are_tolerated_but_three_in_a_row_fail(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock, {0: ScriptedRank(lines=[(1, L_ASSIGNED_0)]), 1: ScriptedRank(lines=[(1, L_NCCL)], errors_at={1, 2})}
        )
        decisions.wait_for_rendezvous(RANKS, src, _rdv(), clock, _noop)  # two misses, then fine
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(), 1: ScriptedRank(errors_at={2, 3, 4})})
        with pytest.raises(GateFailure, match=r"cannot observe rank 1 .* 3 failures in a row.*Connection refused"):
            decisions.wait_for_rendezvous(RANKS, src, _rdv(), clock, _noop)
        assert clock.t <= 20

    def test_progress_is_reported_at_a_steady_pace(self) -> None:
        clock = FakeClock()
        seen: list[tuple[float, str]] = []
        src = ScriptedSource(clock, {0: ScriptedRank(lines=[(1, L_ASSIGNED_0)]), 1: ScriptedRank(lines=[(95, L_NCCL)])})
        decisions.wait_for_rendezvous(RANKS, src, _rdv(), clock, lambda m: seen.append((clock.t, m)))
        assert [t for t, _ in seen] == [30, 60, 90]
        assert all("waiting for rank 1" in m for _, m in seen)

    def test_real_time_bound(self) -> None:
        src = ScriptedSource(
            FakeClock(),
            {0: ScriptedRank(), 1: ScriptedRank()},  # fake clock never advances
            wait_clock=SystemClock(),
        )
        t0 = time.monotonic()
        with pytest.raises(GateFailure, match="within 0.4 s"):
            decisions.wait_for_rendezvous(
                RANKS, src, _rdv(rendezvous_timeout_s=0.4, poll_interval_s=0.05), SystemClock(), _noop
            )
        assert 0.4 <= time.monotonic() - t0 < 1.0


# --- ready gate ----------------------------------------------------------------------------------------

BOOT_HEAD = [
    (1, L_INIT),
    (30, L_ASSIGNED_0),
    (40, L_LOAD),
    (290, L_LOADED),
    (400, L_KV),
    (401, L_KV_SIZE),
    (410, L_GRAPH),
    (415, L_GRAPH_DONE),
    (500, L_WARM),
    (505, L_SERVER),
    (510, L_COMPLETE),
]
BOOT_WORKER = [(2, L_INIT_W), (30, L_ASSIGNED_1)] + [(40 + 20 * i, f"worker loading {i}") for i in range(24)]


class TestReady:
    def test_the_default_bounds_pass_a_36_minute_first_boot_and_end_one_that_never_finishes(self) -> None:
        # A first boot after an NCCL topology change: ~30 min of JIT after the KV cache, a line every 5 min.
        g = Gates()
        settings = _ready(ready_timeout_s=g.ready_timeout_seconds, stall_s=g.stall_seconds)
        jit = [(420.0 + 300 * i, f"INFO 09-22 10:0{i}:00 [compilation.py:99] compiling graph {i}") for i in range(6)]
        head = [*BOOT_HEAD[:6], *jit, (2150, L_GRAPH), (2155, L_GRAPH_DONE), (2158, L_WARM), (2160, L_COMPLETE)]
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(lines=head), 1: ScriptedRank(lines=BOOT_WORKER)})
        res = decisions.wait_for_ready(RANKS, src, settings, clock, _noop, Probe(LISTED), "m")
        assert 2160 <= res.elapsed_s <= 2161, "36 minutes of boot with progress must pass under the defaults"

        endless = [*BOOT_HEAD[:6], *((420.0 + 300 * i, f"compiling graph {i}") for i in range(20))]
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(lines=endless), 1: ScriptedRank(lines=BOOT_WORKER)})
        with pytest.raises(GateFailure, match=f"not ready within {g.ready_timeout_seconds} s") as failure:
            decisions.wait_for_ready(RANKS, src, settings, clock, _noop, Probe(LISTED), "m")
        assert clock.t <= g.ready_timeout_seconds + 5, "the ready bound acts, however long the logs keep moving"
        assert "stall" not in str(failure.value), str(failure.value)

    def test_passes_after_startup_complete_and_model_listed_with_phase_times(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(lines=BOOT_HEAD), 1: ScriptedRank(lines=BOOT_WORKER)})
        probe = Probe(LISTED)
        res = decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, probe, "DeepSeek-v4.1-Flash-EXL3")
        assert 510 <= res.elapsed_s <= 515
        assert probe.calls == 1  # not probed before the head said it is up
        assert res.phases == {
            "rendezvous": "ts+1",
            "loading weights": "ts+40",
            "KV cache": "ts+400",
            "graph capture": "ts+410",
            "warm-up": "ts+500",
            "API starting": "ts+505",
            "ready": "ts+510",
        }

    def test_polls_fast_only_near_readiness_so_the_pass_is_prompt(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(lines=BOOT_HEAD), 1: ScriptedRank(lines=BOOT_WORKER)})
        res = decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")
        assert 510 <= res.elapsed_s <= 510.5, "'Application startup complete.' at 510 s must pass within 0.5 s"
        while_loading = [s for t, s in zip(_cumulative(clock.sleeps), clock.sleeps, strict=True) if t < 395]
        assert set(while_loading) == {5.0}, "a long weight load is polled at the normal pace, not 2 Hz"

    def test_worker_logging_startup_complete_does_not_count(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, "x")] + [(i, f"h{i}") for i in range(2, 100, 10)]),
                1: ScriptedRank(lines=[(5, L_COMPLETE)]),
            },
        )
        probe = Probe(LISTED)
        with pytest.raises(GateFailure, match="not ready within 60 s"):
            decisions.wait_for_ready(RANKS, src, _ready(ready_timeout_s=60), clock, _noop, probe, "m")
        assert probe.calls == 0

    def test_progress_every_30_s_names_phase_and_elapsed(self) -> None:
        clock = FakeClock()
        seen: list[tuple[float, str]] = []
        src = ScriptedSource(clock, {0: ScriptedRank(lines=BOOT_HEAD), 1: ScriptedRank(lines=BOOT_WORKER)})
        decisions.wait_for_ready(RANKS, src, _ready(), clock, lambda m: seen.append((clock.t, m)), Probe(LISTED), "m")
        times = [t for t, _ in seen]
        assert times == [30.0 * k for k in range(1, 17)]  # 30..480 s; it passes at 510 s
        at_300 = dict(seen)[300.0]
        assert "phase 'loading weights'" in at_300 and "elapsed 5m00s" in at_300

    def test_container_exit_is_detected_within_15_s(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock, {0: ScriptedRank(lines=BOOT_HEAD), 1: ScriptedRank(lines=BOOT_WORKER, exits_at=203, exit_code=137)}
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")
        assert 203 <= clock.t <= 203 + 15
        msg = str(err.value)
        assert "rank 1 (node spark-b, container dsv41-rank1) is exited with exit code 137" in msg
        assert "watchdog.log" in msg and "worker loading 8" in msg and L_LOAD in msg

    def test_stall_fails_and_shm_broadcast_lines_do_not_count_as_progress(self) -> None:
        clock = FakeClock()
        head = [(1, L_INIT), (20, L_LOAD)] + [(20 + 10 * i, L_SHM) for i in range(1, 40)]
        src = ScriptedSource(clock, {0: ScriptedRank(lines=head), 1: ScriptedRank(lines=[(2, L_INIT_W)])})
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(stall_s=60), clock, _noop, Probe(LISTED), "m")
        assert 80 <= clock.t <= 85
        msg = str(err.value)
        assert msg.startswith("no rank logged anything new for 1m0") and "in phase 'loading weights'" in msg
        assert "raise stall_s" in msg

    def test_one_rank_still_logging_is_not_a_stall(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {0: ScriptedRank(lines=[(1, L_LOAD)]), 1: ScriptedRank(lines=[(10 * i, f"w{i}") for i in range(1, 30)])},
        )
        with pytest.raises(GateFailure, match="not ready within 200 s"):
            decisions.wait_for_ready(
                RANKS, src, _ready(stall_s=60, ready_timeout_s=200), clock, _noop, Probe(LISTED), "m"
            )

    def test_timeout_names_last_phase(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, L_LOAD), (50, L_KV)] + [(60 + i, "jit") for i in range(200)]),
                1: ScriptedRank(),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(ready_timeout_s=120), clock, _noop, Probe(LISTED), "m")
        assert 120 <= clock.t <= 125
        assert "not ready within 120 s, last phase 'KV cache'" in str(err.value)

    def test_head_up_but_models_unreachable_keeps_polling_then_says_so(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock, {0: ScriptedRank(lines=[(1, L_COMPLETE)] + [(i, "busy") for i in range(2, 99)]), 1: ScriptedRank()}
        )
        probe = Probe(ModelsProbeResult("unreachable", "GET http://127.0.0.1:1/v1/models: ConnectionError"))
        with pytest.raises(GateFailure, match="never answered: GET http://127.0.0.1:1/v1/models"):
            decisions.wait_for_ready(RANKS, src, _ready(ready_timeout_s=60), clock, _noop, probe, "m")
        assert probe.calls >= 12

    def test_wrong_model_name_fails_at_once(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(lines=[(1, L_COMPLETE)]), 1: ScriptedRank()})
        with pytest.raises(GateFailure, match=r"lists \['other'\], not 'DeepSeek-v4.1-Flash-EXL3'"):
            decisions.wait_for_ready(
                RANKS,
                src,
                _ready(),
                clock,
                _noop,
                Probe(ModelsProbeResult("not_listed", ids=("other",))),
                "DeepSeek-v4.1-Flash-EXL3",
            )
        assert clock.t <= 5

    def test_rejected_api_key_fails_at_once(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(lines=[(1, L_COMPLETE)]), 1: ScriptedRank()})
        with pytest.raises(GateFailure, match="refused the API key"):
            decisions.wait_for_ready(
                RANKS, src, _ready(), clock, _noop, Probe(ModelsProbeResult("unauthorized", "401")), "m"
            )

    def test_dist_store_error_fails_the_ready_gate_too(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(clock, {0: ScriptedRank(lines=[(1, L_INIT), (30, L_DIST_STORE)]), 1: ScriptedRank()})
        with pytest.raises(GateFailure, match="rendezvous failure"):
            decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")
        assert clock.t <= 35

    def test_failure_messages_never_carry_the_api_key(self) -> None:
        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {0: ScriptedRank(lines=[(1, L_ARGS_WITH_KEY), (2, "key=OTHERSECRET9")]), 1: ScriptedRank(exits_at=10)},
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(
                RANKS,
                src,
                _ready(secrets=("OTHERSECRET9",)),
                clock,
                _noop,  # type: ignore[arg-type]
                Probe(LISTED),
                "m",
            )
        assert "sk-live-very-secret-0123456789ab" not in str(err.value) and "OTHERSECRET9" not in str(err.value)
        assert "non-default args" in str(err.value)

    def test_defaults_allow_a_36_minute_jit_boot_and_detect_exits_within_15_s(self) -> None:
        # The timeouts' defaults live in the config; the watch's own defaults (poll, progress) here.
        gates = Gates()
        s = ReadySettings(bounds=bounds(ready_timeout_s=gates.ready_timeout_seconds, stall_s=gates.stall_seconds))
        assert s.bounds.ready_timeout_s >= 36 * 60 + 5 * 60
        assert s.poll_interval_s * s.max_source_errors <= 15
        assert s.progress_interval_s == 30
        with pytest.raises(ValueError, match="poll_interval_s=10"):
            ReadySettings(
                bounds=bounds(ready_timeout_s=gates.ready_timeout_seconds, stall_s=gates.stall_seconds),
                poll_interval_s=10,
            )

    def test_real_time_bound_on_stall(self) -> None:
        src = ScriptedSource(
            FakeClock(), {0: ScriptedRank(lines=[(0, L_LOAD)]), 1: ScriptedRank()}, wait_clock=SystemClock()
        )
        t0 = time.monotonic()
        with pytest.raises(GateFailure, match="stall limit 0.4 s"):
            decisions.wait_for_ready(
                RANKS,
                src,
                _ready(stall_s=0.4, poll_interval_s=0.05, ready_timeout_s=30),
                SystemClock(),
                _noop,
                Probe(LISTED),
                "m",
            )
        assert 0.4 <= time.monotonic() - t0 < 1.0


# --- the same decisions on streams: taken when the line or the event arrives ------------------------------


@dataclass
class StreamedRank:
    lines: list[tuple[float, str]] = field(default_factory=list)  # (time it is written, text)
    dies_at: float | None = None
    exit_code: int = 1
    oom: bool = False
    # (drop, reconnected): the stream is cut at `drop`; the lines of the gap arrive at `reconnected`
    gap: tuple[float, float] | None = None
    # connection attempts that fail (1 = the first)
    refused: set[int] = field(default_factory=set)
    usage: Callable[[float], ContainerUsage] = FROZEN


class ScriptedStream:
    """A RankSource delivering scripted ranks as the streams do: each item when it happens on the fake clock
    (a state on connect, each line when written, a die with its log's end), with drops and refusals."""

    def __init__(self, clock: FakeClock, ranks: dict[int, StreamedRank]) -> None:
        self.clock, self.ranks = clock, ranks
        self.timeouts: list[float] = []
        self.closed = False
        self.pending: list[tuple[float, int, observations.Observation]] = []
        seq = 0
        for rank, r in ranks.items():
            at = 0.0
            for attempt in sorted(r.refused):
                self.pending.append(
                    (at, seq, observations.Unobservable(rank, "ssh root@127.0.0.3:2222 failed: Connection refused"))
                )
                seq += 1
                at += 2.0 * attempt
            self.pending.append(
                (at, seq, observations.StateSeen(rank, ContainerState("running", 0, "2026-09-22T10:00:00Z")))
            )
            seq += 1
            for t, text in r.lines:
                due = max(t, at)
                if r.gap and r.gap[0] <= t < r.gap[1]:
                    due = r.gap[1]
                self.pending.append((due, seq, observations.LineSeen(rank, LogLine(text=text, at=f"ts+{t:g}"))))
                seq += 1
            if r.gap:
                self.pending.append(
                    (
                        r.gap[0],
                        seq,
                        observations.Notice(f"rank watch: the stream from rank {rank}'s node ended; reconnecting"),
                    )
                )
                self.pending.append(
                    (
                        r.gap[1],
                        seq + 1,
                        observations.StateSeen(rank, ContainerState("running", 0, "2026-09-22T10:00:00Z")),
                    )
                )
                seq += 2
            if r.dies_at is not None:
                if r.oom:
                    self.pending.append((r.dies_at, seq, observations.EventSeen(rank, "oom")))
                self.pending.append(
                    (
                        r.dies_at,
                        seq + 1,
                        observations.StateSeen(rank, ContainerState("exited", r.exit_code, ""), "die event"),
                    )
                )
                self.pending.append((r.dies_at, seq + 2, observations.LogEnded(rank)))
                seq += 3
        self.pending.sort(key=lambda p: (p[0], p[1]))
        # a rank that died stops logging
        for rank, r in ranks.items():
            if r.dies_at is not None:
                self.pending = [
                    p
                    for p in self.pending
                    if not (isinstance(p[2], observations.LineSeen) and p[2].rank == rank and p[0] > r.dies_at)
                ]

    def next_items(self, timeout_s: float, pace_s: float) -> list[observations.Observation]:
        assert not self.closed
        self.timeouts.append(timeout_s)
        now = self.clock.t
        if not self.pending or self.pending[0][0] > now + timeout_s:
            self.clock.sleep(timeout_s)
            return []
        due = self.pending[0][0]
        if due > now:
            self.clock.sleep(due - now)
        items = [p[2] for p in self.pending if p[0] <= self.clock.t]
        self.pending = [p for p in self.pending if p[0] > self.clock.t]
        return items

    def request_usage(self) -> None:
        """Each rank's sample arrives half a second later (docker stats' own time)."""
        self.usage_requests = getattr(self, "usage_requests", 0) + 1
        at = self.clock.t + 0.5
        self.pending += [
            (at, -1, observations.UsageSeen(rank, r.usage(at)))
            for rank, r in self.ranks.items()
            if r.dies_at is None or at < r.dies_at
        ]
        self.pending.sort(key=lambda p: (p[0], p[1]))

    def close(self) -> None:
        self.closed = True


class TestStreamDecisions:
    def test_die_event_fails_at_once_with_exit_code_and_both_ranks_last_lines(self) -> None:
        clock = FakeClock()
        src = ScriptedStream(
            clock, {0: StreamedRank(lines=BOOT_HEAD), 1: StreamedRank(lines=BOOT_WORKER, dies_at=203.25, exit_code=137)}
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")
        assert clock.t == 203.25, "failed on the die event itself, not a poll later"
        msg = str(err.value)
        assert "rank 1 (node spark-b, container dsv41-rank1) is exited with exit code 137" in msg
        assert "watchdog.log" in msg and "worker loading 8" in msg and L_LOAD in msg
        assert src.closed

    def test_oom_event_names_the_oom_killer(self) -> None:
        clock = FakeClock()
        src = ScriptedStream(
            clock,
            {
                0: StreamedRank(lines=BOOT_HEAD),
                1: StreamedRank(lines=BOOT_WORKER, dies_at=100, exit_code=137, oom=True),
            },
        )
        with pytest.raises(GateFailure, match=r"exit code 137\. What to do: the kernel OOM killer killed it"):
            decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")

    @pytest.mark.parametrize("code", [0, 137])
    def test_a_worker_exit_0_or_137_points_to_the_watchdog_log_and_the_oom_killer(self, code: int) -> None:
        # Real headless workers exit 0 on SIGTERM (the watchdog's docker stop) and 137 when killed during the load.
        clock = FakeClock()
        src = ScriptedStream(
            clock, {0: StreamedRank(lines=BOOT_HEAD), 1: StreamedRank(lines=BOOT_WORKER, dies_at=300, exit_code=code)}
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")
        msg = str(err.value)
        assert f"rank 1 (node spark-b, container dsv41-rank1) is exited with exit code {code}" in msg
        hint = msg.split("What to do: ", 1)[1].split("\n", 1)[0]
        assert "watchdog.log" in hint and "OOM killer" in hint, hint
        assert "on its own" not in msg and "a rank of the group died" not in msg

    def test_a_head_exit_0_is_named_a_dead_rank_with_both_ranks_last_lines(self) -> None:
        # Real vLLM: the worker dies, the head logs the engine's failure and exits 0 within 1-5 s.
        clock = FakeClock()
        head = [*BOOT_HEAD[:4], (300, L_WORKER_PROC), (300.5, L_GLOO_CLOSED)]
        src = ScriptedStream(
            clock,
            {
                0: StreamedRank(lines=head, dies_at=301, exit_code=0),
                1: StreamedRank(lines=[(2, L_INIT_W), (30, L_ASSIGNED_1), (250, L_KV_WORKER)]),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(stall_s=600), clock, _noop, Probe(LISTED), "m")
        msg = str(err.value)
        first = msg.splitlines()[0]
        assert first.startswith(
            "rank 0 (node spark-a, container dsv41-rank0) is exited with exit code 0: a rank of the group died"
        ), first
        assert "WorkerProc hit an exception" in first and "watchdog.log" in first
        assert L_GLOO_CLOSED in msg and L_KV_WORKER in msg, "both ranks' last lines"

    def test_a_worker_stopping_with_the_head_is_named_first(self) -> None:
        clock = FakeClock()
        src = ScriptedStream(
            clock,
            {
                0: StreamedRank(lines=BOOT_HEAD[:4], dies_at=300, exit_code=0),
                1: StreamedRank(lines=BOOT_WORKER, dies_at=300.4, exit_code=137),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(stall_s=600), clock, _noop, Probe(LISTED), "m")
        first = str(err.value).splitlines()[0]
        assert first.startswith(
            "rank 1 (node spark-b, container dsv41-rank1) is exited with exit code 137 (and "
            "rank 0 (node spark-a, container dsv41-rank0) is exited with exit code 0)"
        ), first

    def test_rendezvous_exit_fails_when_it_happens(self) -> None:
        clock = FakeClock()
        src = ScriptedStream(
            clock,
            {
                0: StreamedRank(lines=[(1, L_INIT)]),
                1: StreamedRank(
                    lines=[(2, "Traceback (most recent call last):"), (11.9, "RuntimeError: NCCL error")], dies_at=12
                ),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_rendezvous(RANKS, src, _rdv(), clock, _noop)
        assert clock.t == 12
        assert str(err.value).startswith("rank 1 (node spark-b, container dsv41-rank1) is exited with exit code 1")
        assert "RuntimeError: NCCL error" in str(err.value)

    def test_ready_line_is_seen_when_it_is_written(self) -> None:
        clock = FakeClock()
        boot = [(t + 0.123, x) for t, x in BOOT_HEAD]
        src = ScriptedStream(clock, {0: StreamedRank(lines=boot), 1: StreamedRank(lines=BOOT_WORKER)})
        probe = Probe(LISTED)
        res = decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, probe, "m")
        assert res.elapsed_s == 510.123 and probe.calls == 1
        assert res.phases["ready"] == "ts+510.123"
        # the gate waits for what arrives: never a wake-up per poll while a long load logs nothing
        assert max(src.timeouts) > 5

    def test_stall_is_timed_from_the_last_line_received(self) -> None:
        clock = FakeClock()
        head = [(1, L_INIT), (20.7, L_LOAD)] + [(20.7 + 10 * i, L_SHM) for i in range(1, 40)]
        src = ScriptedStream(clock, {0: StreamedRank(lines=head), 1: StreamedRank(lines=[(2, L_INIT_W)])})
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(stall_s=60), clock, _noop, Probe(LISTED), "m")
        assert clock.t == pytest.approx(80.7)
        assert str(err.value).startswith("no rank logged anything new for 1m0")

    def test_progress_every_30_s_on_streams_too(self) -> None:
        clock = FakeClock()
        seen: list[tuple[float, str]] = []
        src = ScriptedStream(clock, {0: StreamedRank(lines=BOOT_HEAD), 1: StreamedRank(lines=BOOT_WORKER)})
        decisions.wait_for_ready(RANKS, src, _ready(), clock, lambda m: seen.append((clock.t, m)), Probe(LISTED), "m")
        assert [t for t, m in seen if m.startswith("ready gate:")] == [30.0 * k for k in range(1, 17)]

    def test_a_dropped_stream_reconnected_does_not_fail_a_healthy_boot(self) -> None:
        clock = FakeClock()
        seen: list[str] = []
        src = ScriptedStream(
            clock, {0: StreamedRank(lines=BOOT_HEAD), 1: StreamedRank(lines=BOOT_WORKER, gap=(100, 104.5))}
        )
        res = decisions.wait_for_ready(RANKS, src, _ready(stall_s=120), clock, seen.append, Probe(LISTED), "m")
        assert res.elapsed_s == 510
        assert any("reconnecting" in m for m in seen), "the drop is said in the progress output"

    def test_three_failed_connections_in_a_row_fail_two_do_not(self) -> None:
        clock = FakeClock()
        src = ScriptedStream(
            clock, {0: StreamedRank(lines=[(1, L_ASSIGNED_0)]), 1: StreamedRank(lines=[(1, L_NCCL)], refused={1, 2})}
        )
        decisions.wait_for_rendezvous(RANKS, src, _rdv(), clock, _noop)
        clock = FakeClock()
        src = ScriptedStream(clock, {0: StreamedRank(), 1: StreamedRank(refused={1, 2, 3})})
        with pytest.raises(GateFailure, match=r"cannot observe rank 1 .* 3 failures in a row.*Connection refused"):
            decisions.wait_for_rendezvous(RANKS, src, _rdv(), clock, _noop)
        assert clock.t <= 20


# --- the stall rule on hardware: a worker is silent while it loads -----------------------------------------
# Real vLLM: only rank 0 draws the safetensors progress bar. The recipe's head loads locally in ~250 s, the worker
# streams 196 GiB over NFS for ~15 min, printing nothing: ~650 s without a line from any rank. The containers'
# memory (page cache of the shards read, the weights loaded) grows the whole time.

SILENT_HEAD = [
    (1, L_INIT),
    (30, L_ASSIGNED_0),
    (40, L_LOAD),
    (290, L_LOADED),
    (945, L_KV),
    (946, L_KV_SIZE),
    (960, L_GRAPH),
    (965, L_GRAPH_DONE),
    (1000, L_WARM),
    (1005, L_SERVER),
    (1010, L_COMPLETE),
]
SILENT_WORKER = [(2, L_INIT_W), (30, L_ASSIGNED_1), (944, L_KV_WORKER)]


def _defaults() -> ReadySettings:
    gates = Gates()
    return ReadySettings(bounds=bounds(ready_timeout_s=gates.ready_timeout_seconds, stall_s=gates.stall_seconds))


class TestSilentLoad:
    def test_defaults_are_the_recipes_stall_limit(self) -> None:
        assert _defaults().bounds.stall_s == 600, "what a 650 s silent window would fail on without the counters"

    @pytest.mark.parametrize("streamed", [False, True])
    def test_a_15_minute_silent_worker_load_with_moving_counters_passes_with_default_settings(
        self, streamed: bool
    ) -> None:
        clock = FakeClock()
        head, worker = loading(40, 290, 95.0), loading(40, 940, 95.0)
        src: observations.RankSource
        if streamed:
            src = ScriptedStream(
                clock,
                {0: StreamedRank(lines=SILENT_HEAD, usage=head), 1: StreamedRank(lines=SILENT_WORKER, usage=worker)},
            )
        else:
            src = ScriptedSource(
                clock,
                {0: ScriptedRank(lines=SILENT_HEAD, usage=head), 1: ScriptedRank(lines=SILENT_WORKER, usage=worker)},
            )
        said: list[str] = []
        res = decisions.wait_for_ready(RANKS, src, _defaults(), clock, said.append, Probe(LISTED), "m")
        assert 1010 <= res.elapsed_s <= 1011
        assert any("silent but progressing: rank 1 memory +" in m for m in said), said

    @pytest.mark.parametrize("streamed", [False, True])
    def test_silence_with_frozen_counters_is_still_a_stall(self, streamed: bool) -> None:
        # the worker hangs at 300 s: it never prints again and its memory stops growing
        clock = FakeClock()
        head, worker = loading(40, 290, 95.0), loading(40, 940, 95.0, then=300)
        src: observations.RankSource
        if streamed:
            src = ScriptedStream(
                clock,
                {0: StreamedRank(lines=SILENT_HEAD, usage=head), 1: StreamedRank(lines=SILENT_WORKER, usage=worker)},
            )
        else:
            src = ScriptedSource(
                clock,
                {0: ScriptedRank(lines=SILENT_HEAD, usage=head), 1: ScriptedRank(lines=SILENT_WORKER, usage=worker)},
            )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _defaults(), clock, _noop, Probe(LISTED), "m")
        assert 890 <= clock.t <= 891, "as without the counters: 600 s after the last line"
        msg = str(err.value)
        first = msg.splitlines()[0]
        assert first.startswith(
            "no rank logged anything new for 10m00s and no rank container's memory or block "
            "I/O grew meanwhile (stall limit 600 s) in phase 'loading weights'"
        ), first
        assert "docker stats: rank 0 memory 97GiB" in first and "rank 1 memory 29.44GiB" in first, first
        assert "py-spy dump" in msg and L_LOADED in msg and L_ASSIGNED_1 in msg

    def test_a_load_that_stops_growing_stalls_a_stall_limit_after_its_last_growth(self) -> None:
        clock = FakeClock()
        worker = loading(40, 940, 95.0, then=600)
        src = ScriptedStream(
            clock,
            {
                0: StreamedRank(lines=SILENT_HEAD[:4], usage=loading(40, 290, 95.0)),
                1: StreamedRank(lines=SILENT_WORKER[:2], usage=worker),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _defaults(), clock, _noop, Probe(LISTED), "m")
        # growth is timed from the sample that saw it: at most one sampling interval (30 s) after it happened
        assert 1200 <= clock.t <= 1231
        first = str(err.value).splitlines()[0]
        assert "no rank container's memory or block I/O grew for 10m00s (last: rank 1 memory +" in first, first

    def test_block_io_growth_counts_too(self) -> None:
        # a rank reading its shards from a local disk: the page cache may be counted out, the reads are not
        clock = FakeClock()

        def reading(t: float) -> ContainerUsage:
            return usage(3.5, read_gb=min(t, 940) * 0.2)

        src = ScriptedSource(
            clock, {0: ScriptedRank(lines=SILENT_HEAD), 1: ScriptedRank(lines=SILENT_WORKER, usage=reading)}
        )
        assert decisions.wait_for_ready(RANKS, src, _defaults(), clock, _noop, Probe(LISTED), "m").elapsed_s >= 1010

    def test_a_chatty_boot_samples_no_counters(self) -> None:
        clock = FakeClock()
        ranks = {0: ScriptedRank(lines=BOOT_HEAD), 1: ScriptedRank(lines=BOOT_WORKER)}
        decisions.wait_for_ready(RANKS, ScriptedSource(clock, ranks), _defaults(), clock, _noop, Probe(LISTED), "m")
        assert ranks[0].usage_calls == ranks[1].usage_calls == 0

    def test_counters_that_cannot_be_read_leave_the_old_rule(self) -> None:
        clock = FakeClock()

        def broken(_t: float) -> ContainerUsage:
            raise SourceError("docker stats dsv41-rank1 failed: permission denied")

        src = ScriptedSource(
            clock,
            {0: ScriptedRank(lines=SILENT_HEAD, usage=broken), 1: ScriptedRank(lines=SILENT_WORKER, usage=broken)},
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _defaults(), clock, _noop, Probe(LISTED), "m")
        assert 890 <= clock.t <= 891
        first = str(err.value).splitlines()[0]
        assert first.startswith("no rank logged anything new for 10m00s (stall limit 600 s)"), first
        assert "rank 1 unreadable (docker stats dsv41-rank1 failed: permission denied)" in first

    def test_memory_only_given_back_is_not_progress(self) -> None:
        # a hung rank whose page cache the kernel reclaims: its memory shrinks, nothing grows
        clock = FakeClock()

        def shrinking(t: float) -> ContainerUsage:
            return usage(60.0 - max(t - 300, 0) / 30)

        src = ScriptedSource(
            clock, {0: ScriptedRank(lines=SILENT_HEAD[:4]), 1: ScriptedRank(lines=SILENT_WORKER[:2], usage=shrinking)}
        )
        with pytest.raises(GateFailure, match="stall limit 600 s"):
            decisions.wait_for_ready(RANKS, src, _defaults(), clock, _noop, Probe(LISTED), "m")
        assert 890 <= clock.t <= 891


def gb10(
    nfs_gib_per_s: float = 0.0, rx_gib_per_s: float = 0.0, mem_fall_gib_per_s: float = 0.0, until: float = 940.0
) -> Callable[[float], ContainerUsage]:
    """A GB10 worker loading from `until`'s start: its container's counters flat (the weights go to unified memory,
    NFS reads are not block I/O), the node's own counters moving at these rates until `until`."""

    def at(t: float) -> ContainerUsage:
        moved = min(t, until)
        return ContainerUsage(
            3.5 * 2**30,
            0.0,
            0.0,
            "memory 3.5GiB, block I/O 0B / 0B",
            NodeCounters(
                mem_available_bytes=(120 - mem_fall_gib_per_s * moved) * 2**30,
                nfs_read_bytes=nfs_gib_per_s * moved * 2**30,
                fabric_rx_bytes=rx_gib_per_s * moved * 2**30,
            ),
        )

    return at


class TestGB10SilentLoad:
    """The recipe's first boot on GB10: the worker silent for ~15 min with its container's counters flat."""

    @pytest.mark.parametrize(
        "signal",
        [
            {"nfs_gib_per_s": 0.22},  # 196 GiB in ~15 min over NFS
            {"rx_gib_per_s": 0.22},  # the same bytes on the fabric interface
            {"mem_fall_gib_per_s": 0.11},  # MemAvailable falling as the driver fills unified memory
        ],
        ids=["nfs-read", "fabric-rx", "memavailable"],
    )
    @pytest.mark.parametrize("streamed", [False, True])
    def test_a_node_counter_that_moves_keeps_a_flat_container_from_stalling(
        self, signal: dict[str, float], streamed: bool
    ) -> None:
        clock = FakeClock()
        worker = gb10(**signal)
        src: observations.RankSource
        if streamed:
            src = ScriptedStream(
                clock, {0: StreamedRank(lines=SILENT_HEAD), 1: StreamedRank(lines=SILENT_WORKER, usage=worker)}
            )
        else:
            src = ScriptedSource(
                clock, {0: ScriptedRank(lines=SILENT_HEAD), 1: ScriptedRank(lines=SILENT_WORKER, usage=worker)}
            )
        said: list[str] = []
        res = decisions.wait_for_ready(RANKS, src, _defaults(), clock, said.append, Probe(LISTED), "m")
        assert 1010 <= res.elapsed_s <= 1011
        what = {"nfs_gib_per_s": "NFS read +", "rx_gib_per_s": "fabric rx +", "mem_fall_gib_per_s": "MemAvailable -"}
        assert any(f"silent but progressing: rank 1 {what[next(iter(signal))]}" in m for m in said), said

    def test_the_same_silence_with_every_counter_flat_is_a_stall_naming_the_node_counters(self) -> None:
        clock = FakeClock()
        src = ScriptedStream(
            clock, {0: StreamedRank(lines=SILENT_HEAD), 1: StreamedRank(lines=SILENT_WORKER, usage=gb10())}
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _defaults(), clock, _noop, Probe(LISTED), "m")
        assert 890 <= clock.t <= 891, "600 s after the last line, as without the node's counters"
        first = str(err.value).splitlines()[0]
        assert "and no node's NFS reads, fabric rx or MemAvailable moved meanwhile (stall limit 600 s)" in first
        assert "rank 1 memory 3.5GiB, block I/O 0B / 0B; node MemAvailable 120.0GiB, NFS read 0B, fabric rx 0B" in first

    def test_memavailable_churn_below_a_gib_and_memory_coming_back_are_not_progress(self) -> None:
        # a hung worker on a node whose page cache is reclaimed and refilled: MemAvailable wanders by 0.9 GiB
        clock = FakeClock()

        def wandering(t: float) -> ContainerUsage:
            churn = 0.9 * ((int(t) // 45) % 2)
            return ContainerUsage(3.5 * 2**30, 0.0, 0.0, "flat", NodeCounters((100 - churn) * 2**30, None, None))

        src = ScriptedStream(
            clock, {0: StreamedRank(lines=SILENT_HEAD), 1: StreamedRank(lines=SILENT_WORKER, usage=wandering)}
        )
        with pytest.raises(GateFailure, match="stall limit 600 s"):
            decisions.wait_for_ready(RANKS, src, _defaults(), clock, _noop, Probe(LISTED), "m")
        assert 890 <= clock.t <= 891

    def test_a_load_whose_nfs_reads_stop_stalls_a_stall_limit_after_the_last_bytes(self) -> None:
        clock = FakeClock()
        src = ScriptedStream(
            clock,
            {
                0: StreamedRank(lines=SILENT_HEAD[:4]),
                1: StreamedRank(lines=SILENT_WORKER[:2], usage=gb10(0.22, until=500)),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _defaults(), clock, _noop, Probe(LISTED), "m")
        assert 1100 <= clock.t <= 1131, "600 s after the last growth, seen within one sampling interval"
        assert "(last: rank 1 NFS read +" in str(err.value).splitlines()[0]


def test_docker_stats_lines_parse_into_bytes() -> None:
    line = (
        '{"BlockIO":"190GB / 1.2MB","CPUPerc":"101.5%","Container":"dsv41-rank1","ID":"4f1c","MemPerc":"79.5%",'
        '"MemUsage":"95.12GiB / 119.7GiB","Name":"dsv41-rank1","NetIO":"0B / 0B","PIDs":"212"}'
    )
    name, seen = observations.parse_stats(line) or ("", None)
    assert name == "dsv41-rank1" and seen is not None
    assert seen.memory_bytes == pytest.approx(95.12 * 2**30)
    assert seen.block_read_bytes == 190e9 and seen.block_written_bytes == 1.2e6
    assert seen.text == "memory 95.12GiB, block I/O 190GB / 1.2MB"
    assert [observations.parse_size(t) for t in ("0B", "12.3kB", "1.5MiB", "2TB", "--", "")] == [
        0,
        12300,
        1.5 * 2**20,
        2e12,
        None,
        None,
    ]
    assert observations.parse_stats("Error response from daemon: No such container") is None


# --- /v1/models probe against a loopback server -------------------------------------------------------


@pytest.fixture
def models_server() -> Iterator[ModelsServer]:
    with serve_models(["DeepSeek-v4.1-Flash-EXL3"]) as server:
        yield server


class TestModelsEndpoint:
    def test_listed_with_bearer_key(self, models_server: ModelsServer) -> None:
        res = ModelsEndpoint(models_server.base, "DeepSeek-v4.1-Flash-EXL3", api_key="k-123", timeout_s=2)()
        assert res.outcome == "listed"
        assert models_server.seen == [{"path": "/v1/models", "auth": "Bearer k-123"}]
        assert "k-123" not in repr(ModelsEndpoint(models_server.base, "m", api_key="k-123"))

    def test_other_model_is_not_listed(self, models_server: ModelsServer) -> None:
        res = ModelsEndpoint(models_server.base + "/v1/", "Another", timeout_s=2)()
        assert res.outcome == "not_listed" and res.ids == ("DeepSeek-v4.1-Flash-EXL3",)
        assert models_server.seen[0]["path"] == "/v1/models"

    def test_401_is_unauthorized(self, models_server: ModelsServer) -> None:
        models_server.plan["status"] = 401
        assert ModelsEndpoint(models_server.base, "m", timeout_s=2)().outcome == "unauthorized"

    def test_503_while_starting_is_unreachable(self, models_server: ModelsServer) -> None:
        models_server.plan["status"] = 503
        assert ModelsEndpoint(models_server.base, "m", timeout_s=2)().outcome == "unreachable"

    def test_refused_connection_is_unreachable(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        res = ModelsEndpoint(f"http://127.0.0.1:{port}", "m", api_key="k-999", timeout_s=1)()
        assert res.outcome == "unreachable" and "k-999" not in res.detail


# --- the SSH source, through a fake `ssh` on PATH ------------------------------------------------------


@pytest.fixture
def fake_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return install_fake_ssh(tmp_path, monkeypatch)


class TestSshRankSource:
    def test_state_parses_docker_inspect_and_the_key_never_reaches_argv(self, fake_ssh: Path) -> None:
        canned(fake_ssh, "inspect", "running 0 2026-09-22T10:00:00.123456789Z\n")
        src = SshRankSource(RANKS, SshAccess(private_key=KEY))
        assert src.state(1) == ContainerState("running", 0, "2026-09-22T10:00:00.123456789Z")
        argv = (fake_ssh / "argv.log").read_text().split("---\n")[0].splitlines()
        assert "SECRETKEYMATERIAL" not in "".join(argv)
        key_file = Path(argv[argv.index("-i") + 1])
        assert key_file.read_text() == KEY and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert "root@127.0.0.3" in argv and argv[argv.index("-p") + 1] == "2222"
        assert sent_script(argv[-1]) == (
            "timeout 10 docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.State.StartedAt}}' dsv41-rank1"
        )

    def test_exited_and_missing_containers(self, fake_ssh: Path) -> None:
        canned(fake_ssh, "inspect.1", "exited 137 2026-09-22T10:00:00Z\n")
        canned(fake_ssh, "inspect.2", "", rc=1, err="Error: No such object: dsv41-rank1\n")
        src = SshRankSource(RANKS)
        assert src.state(1) == ContainerState("exited", 137, "2026-09-22T10:00:00Z")
        assert src.state(1).status == "missing"

    def test_ssh_failure_and_garbage_raise_source_error(self, fake_ssh: Path) -> None:
        canned(fake_ssh, "inspect.1", "", rc=255, err="ssh: connect to host 127.0.0.3 port 2222: Connection refused\n")
        canned(fake_ssh, "inspect.2", "permission denied while trying to connect\n")
        canned(fake_ssh, "inspect.3", "", rc=124)
        src = SshRankSource(RANKS)
        with pytest.raises(SourceError, match="ssh root@127.0.0.3:2222 failed: .*Connection refused"):
            src.state(1)
        with pytest.raises(SourceError, match="unexpected docker inspect output"):
            src.state(1)
        with pytest.raises(SourceError, match="did not answer within 10 s"):
            src.state(1)

    def test_logs_start_at_container_start_then_continue_without_duplicates(self, fake_ssh: Path) -> None:
        canned(fake_ssh, "inspect", "running 0 2026-09-22T10:00:00.5Z\n")
        canned(
            fake_ssh,
            "logs.1",
            "2026-09-22T10:00:01.000000001Z first\n"
            "2026-09-22T10:00:02.1Z second\r\n"
            "2026-09-22T10:00:03.25Z bar 10%\rbar 100%\n"
            "2026-09-22T10:00:03.25Z same instant\n",
        )
        canned(
            fake_ssh,
            "logs.2",
            "2026-09-22T10:00:03.25Z bar 100%\n2026-09-22T10:00:03.25Z same instant\n2026-09-22T10:00:04Z third\n",
        )
        src = SshRankSource(RANKS)
        first = src.new_lines(0)
        assert [ln.text for ln in first] == ["first", "second", "bar 100%", "same instant"]
        assert first[0].at == "2026-09-22T10:00:01.000000001Z"
        second = src.new_lines(0)
        assert [ln.text for ln in second] == ["third"]
        remote = (fake_ssh / "remote.log").read_text().splitlines()
        assert [sent_script(r) for r in remote[1:3]] == [
            # a second before StartedAt: docker stamps a line written at once before its own StartedAt
            "timeout 10 docker logs --timestamps --since 2026-09-22T09:59:59Z dsv41-rank0 2>&1",
            "timeout 10 docker logs --timestamps --since 2026-09-22T10:00:03.25Z dsv41-rank0 2>&1",
        ]

    def test_usage_reads_docker_stats_of_the_container(self, fake_ssh: Path) -> None:
        canned(fake_ssh, "stats", '{"BlockIO":"1.1GB / 0B","MemUsage":"12.5GiB / 119.7GiB","Name":"dsv41-rank1"}\n')
        seen = SshRankSource(RANKS).usage(1)
        assert seen.memory_bytes == 12.5 * 2**30 and seen.block_read_bytes == 1.1e9
        remote = (fake_ssh / "remote.log").read_text().splitlines()
        assert sent_script(remote[-1]) == "timeout 10 docker stats --no-stream --format '{{json .}}' dsv41-rank1"
        canned(fake_ssh, "stats", "", rc=1, err="permission denied while trying to connect to the docker API\n")
        with pytest.raises(SourceError, match="docker stats dsv41-rank1 failed: permission denied"):
            SshRankSource(RANKS).usage(1)

    def test_logs_failure_is_a_source_error(self, fake_ssh: Path) -> None:
        canned(fake_ssh, "inspect", "running 0 2026-09-22T10:00:00Z\n")
        canned(fake_ssh, "logs", "Error response from daemon: No such container: dsv41-rank0\n", rc=1)
        with pytest.raises(SourceError, match="docker logs dsv41-rank0 failed: Error response"):
            SshRankSource(RANKS).new_lines(0)


def test_timestamp_key_orders_variable_length_fractions() -> None:
    assert poll_source.timestamp_key("2026-09-22T10:00:00.1Z") > poll_source.timestamp_key(
        "2026-09-22T10:00:00.099999999Z"
    )
    assert poll_source.timestamp_key("2026-09-22T12:00:00+02:00") == poll_source.timestamp_key("2026-09-22T10:00:00Z")


class TestFatalLinesInBothGates:
    """One table (log_patterns.FATAL_PATTERNS) read by both gates, and by the report of a rank's exit."""

    @pytest.mark.parametrize("gate", ["rendezvous", "ready"])
    def test_a_kv_cache_refusal_fails_at_once_naming_the_setting(self, gate: str) -> None:
        from tests.gates.test_log_patterns import FATAL_LINES

        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, L_INIT), (30, FATAL_LINES["KV cache too small"])]),
                1: ScriptedRank(lines=[(1, L_HEADLESS)]),
            },
        )
        with pytest.raises(GateFailure) as err:
            if gate == "rendezvous":
                decisions.wait_for_rendezvous(RANKS, src, _rdv(rendezvous_timeout_s=900), clock, _noop)
            else:
                decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")
        assert clock.t <= 35  # the line, not the timeout and not the exit
        msg = str(err.value)
        assert msg.startswith(
            "rank 0 (node spark-a, container dsv41-rank0) has too little memory left for the KV cache"
        )
        assert "lower serve.maxModelLen" in msg and "estimated maximum model length is 530432" in msg

    def test_an_nccl_error_alone_does_not_fail_but_names_the_exit_after_it(self) -> None:
        from tests.gates.test_log_patterns import FATAL_LINES

        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, L_INIT)]),
                1: ScriptedRank(lines=[(1, L_HEADLESS), (20, FATAL_LINES["NCCL"])], exits_at=60),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")
        assert 60 <= clock.t <= 66  # the exit failed it, not the line
        msg = str(err.value)
        assert (
            "exited with exit code 1; before it, rank 1 (node spark-b, container dsv41-rank1) hit an NCCL error" in msg
        )
        assert "on spark-b check the fabric" in msg

    def test_an_out_of_memory_line_fails_naming_the_node_that_printed_it(self) -> None:
        from tests.gates.test_log_patterns import FATAL_LINES

        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, L_INIT), (40, FATAL_LINES["engine start failed"])], exits_at=41),
                1: ScriptedRank(lines=[(1, L_HEADLESS), (39, FATAL_LINES["out of memory"])]),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")
        msg = str(err.value)
        # The out-of-memory line fails the gate as it arrives (39 s), naming the worker and its node.
        assert msg.startswith("rank 1 (node spark-b, container dsv41-rank1) ran out of GPU memory")
        assert "check MemAvailable on spark-b" in msg

    def test_a_rank_its_entrypoint_did_not_start_fails_the_rendezvous_at_once_naming_its_memory(self) -> None:
        # The head's entrypoint found MemAvailable below the floor (page cache left after staging): it prints one
        # line and exits before vLLM; the worker waits at the rendezvous. The line is the cause, not the timeout.
        from tests.gates.test_log_patterns import FATAL_LINES

        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, FATAL_LINES["memory before start"])], exits_at=1),
                1: ScriptedRank(lines=[(1, L_HEADLESS)]),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_rendezvous(RANKS, src, _rdv(rendezvous_timeout_s=900), clock, _noop)
        assert clock.t <= 10
        msg = str(err.value)
        # Its exit and its line arrive together: either way the line names the cause and the advice follows it.
        assert "rank 0 (node spark-a, container dsv41-rank0) was not started: its node's MemAvailable" in msg
        assert "MemAvailable 80.12 GiB (MemTotal 119.00 GiB) is below the floor of 111.598 GiB" in msg
        assert "What to do: free memory on spark-a or drop its page cache" in msg
        assert "or lower preflight.minMemAvailableGiB; then run `pulumi up` again" in msg

    def test_the_heads_exit_0_names_the_workers_last_fatal_line(self) -> None:
        from tests.gates.test_log_patterns import FATAL_LINES

        clock = FakeClock()
        src = ScriptedSource(
            clock,
            {
                0: ScriptedRank(lines=[(1, L_INIT)], exits_at=50, exit_code=0),
                1: ScriptedRank(lines=[(1, L_HEADLESS), (45, FATAL_LINES["NCCL"])]),
            },
        )
        with pytest.raises(GateFailure) as err:
            decisions.wait_for_ready(RANKS, src, _ready(), clock, _noop, Probe(LISTED), "m")
        msg = str(err.value)
        assert msg.startswith("rank 0 (node spark-a, container dsv41-rank0) is exited with exit code 0")
        assert "before it, rank 1 (node spark-b, container dsv41-rank1) hit an NCCL error" in msg
