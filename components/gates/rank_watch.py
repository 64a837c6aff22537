"""Watching the serving ranks from the operator's machine: pure gate logic plus the real SSH sources.

No Pulumi resources here. The gates in `components/gates/gates.py` wrap `wait_for_rendezvous` and
`wait_for_ready`, fed by `StreamRankSource` (one ssh session per node running `rank_stream.sh`: container
events and log streams, reconnected and resumed; a node that cannot stream is polled through
`SshRankSource`). Tests drive the same functions with fake `RankSource`s and a fake `Clock`.

vLLM's wording changes between releases and the recipe image runs a patched vLLM, so every
log pattern below is deliberately tolerant (substring or loose regex, case where it helps).

The stall rule. Silence alone is not a stall: a real headless worker prints nothing while it loads weights
(only rank 0 draws the safetensors progress bar), and on the recipe's hardware the worker streams 196 GiB over
NFS for ~15 min while the head loaded locally in ~250 s, so no rank prints for ~650 s of a healthy first boot.
The signal chosen is each rank container's memory and block I/O as `docker stats --no-stream` reports them: the
page cache of the shards read (NFS included) and the loaded weights are charged to the container's cgroup, local
reads show as block I/O, the docker CLI reads them as the node's docker user (no root, unlike /proc/<pid>/io), and
they go over the ssh path the watch already has (a line `U` to the node's stream script, or one more command
for a polled node). The head's own progress was not chosen: the head is done long before the worker, and a hung
worker and a loading one look the same from it. CPU was not chosen: a rank spinning in a hung NCCL collective
burns CPU. The counters are sampled only once every rank has been silent for USAGE_QUIET_S, then every
USAGE_INTERVAL_S (a chatty boot costs nothing); memory or block I/O grown by USAGE_MIN_GROWTH_BYTES since the
quiet window's first sample is progress, memory given back is not (the baseline follows it down). Stall: no
line and no growth for `stall_s`, reported with every rank's last sample. Counters that cannot be read leave
the rule as it was (silence alone).
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import re
import shlex
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.client import HTTPException
from typing import Any, Literal, Protocol

from components import scripts
from components.http import ConnectionRefusedOrReset, DeadlineExceeded, exchange
from components.redaction import redact
from components.ssh import SshTarget, ssh_argv

# ---------------------------------------------------------------------------------------------
# What a rank is and what we can observe about it


_CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """One serving container: rank 0 is the head (API server), the others are headless workers."""

    rank: int
    node: str
    host: str
    port: int = 22
    user: str
    container: str

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"gate rank {self.rank} on node {self.node!r} is negative: ranks start at 0 (head)")
        if not _CONTAINER_NAME.match(self.container):
            raise ValueError(f"gate container name {self.container!r} on node {self.node!r} is not a valid docker "
                             "container name ([a-zA-Z0-9][a-zA-Z0-9_.-]*)")
        if not 0 < self.port < 65536:
            raise ValueError(f"gate ssh port {self.port} for node {self.node!r} is out of range 1..65535")

    def label(self) -> str:
        return f"rank {self.rank} (node {self.node}, container {self.container})"

    def to_prop(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "host": self.host, "port": self.port, "user": self.user,
                "container": self.container}

    @classmethod
    def from_prop(cls, r: Mapping[str, Any]) -> RankSpec:
        return cls(rank=int(r["rank"]), node=str(r["node"]), host=str(r["host"]), port=int(r.get("port", 22)),
                   user=str(r["user"]), container=str(r["container"]))


@dataclass(frozen=True)
class LogLine:
    """One container log line; `at` is docker's RFC 3339 timestamp when the source has one."""

    text: str
    at: str | None = None


@dataclass(frozen=True)
class ContainerState:
    """`docker inspect` State: status is running/exited/dead/restarting/created/paused, or `missing`."""

    status: str
    exit_code: int | None = None
    started_at: str = ""
    oom_killed: bool = False

    @property
    def running(self) -> bool:
        return self.status == "running"


@dataclass(frozen=True)
class ContainerUsage:
    """One `docker stats --no-stream` sample of a rank's container: memory in use (what the cgroup is charged:
    the loaded weights and the page cache of the shards read, NFS included) and cumulative block I/O."""

    memory_bytes: float | None
    block_read_bytes: float | None
    block_written_bytes: float | None
    text: str = ""
    """As docker wrote it, for messages: `memory 95.1GiB, block I/O 190GB / 1.2MB`."""

    def grown_from(self, base: ContainerUsage, min_bytes: float) -> str | None:
        """What grew by at least `min_bytes` since `base` (memory, block I/O), or None."""
        grew: list[str] = []
        for what, now, then in (("memory", self.memory_bytes, base.memory_bytes),
                                ("block I/O", _sum(self.block_read_bytes, self.block_written_bytes),
                                 _sum(base.block_read_bytes, base.block_written_bytes))):
            if now is not None and then is not None and now - then >= min_bytes:
                grew.append(f"{what} +{_fmt_bytes(now - then)}")
        return ", ".join(grew) or None

    def floor(self, other: ContainerUsage) -> ContainerUsage:
        """A baseline that only goes down: memory given back (page cache reclaimed) is not progress to regain."""
        low = (min(self.memory_bytes, other.memory_bytes)
               if self.memory_bytes is not None and other.memory_bytes is not None else other.memory_bytes)
        return ContainerUsage(low, self.block_read_bytes, self.block_written_bytes, self.text)


def _sum(*values: float | None) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}B"


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKMGTPE]?i?B)\s*$")
_UNITS = {"B": 1.0, **{p + "B": 1000.0 ** (i + 1) for i, p in enumerate("kMGTPE")}, "KB": 1000.0,
          **{p + "iB": 1024.0 ** (i + 1) for i, p in enumerate("KMGTPE")}}


def parse_size(text: str) -> float | None:
    """docker's sizes: `1.5GiB` (binary, memory), `190GB` / `12.3kB` (decimal, block I/O); None for `--`."""
    m = _SIZE.match(text)
    if m is None or m.group(2) not in _UNITS:
        return None
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_stats(line: str) -> tuple[str, ContainerUsage] | None:
    """One `docker stats --format '{{json .}}'` line as (container name, usage), or None."""
    try:
        stats = json.loads(line)
    except ValueError:
        return None
    if not isinstance(stats, dict):
        return None
    name = str(stats.get("Name") or stats.get("Container") or "")
    memory = str(stats.get("MemUsage") or "").split("/")[0]
    block = str(stats.get("BlockIO") or "").split("/")
    read, written = (block + ["", ""])[:2]
    text = f"memory {memory.strip() or '?'}, block I/O {read.strip() or '?'} / {written.strip() or '?'}"
    return name, ContainerUsage(parse_size(memory), parse_size(read), parse_size(written), text)


class SourceError(Exception):
    """The source could not observe a rank this time (ssh failed, docker did not answer)."""


class RankPoller(Protocol):
    """One look at a rank at a time: the fallback when its node cannot stream (and LiveRanks' one-shot read)."""

    def new_lines(self, rank: int) -> list[LogLine]:
        """Log lines the container wrote since the previous call (first call: since it started)."""
        ...

    def state(self, rank: int) -> ContainerState: ...

    def usage(self, rank: int) -> ContainerUsage:
        """One sample of the container's memory and block I/O (SourceError when it cannot be read)."""
        ...


# What a source reports about the ranks, in the order it learnt it.


@dataclass(frozen=True)
class LineSeen:
    rank: int
    line: LogLine


@dataclass(frozen=True)
class StateSeen:
    """The container's state: read (on connect, after a log stream ended, on a poll) or told by an event
    (`die`: exited with its exit code; `start`: started again, `started_at` the event's time)."""

    rank: int
    state: ContainerState
    how: str = "read"


@dataclass(frozen=True)
class LogEnded:
    """The rank's log stream ended: docker sends nothing more, so its tail is complete."""

    rank: int


@dataclass(frozen=True)
class EventSeen:
    """An event that decides nothing by itself (`oom` before a `die`, `health_status: ...`)."""

    rank: int
    action: str


@dataclass(frozen=True)
class Unobservable:
    """One failed attempt to observe the rank (ssh failed, docker did not answer)."""

    rank: int
    error: str


@dataclass(frozen=True)
class UsageSeen:
    """The answer to `request_usage` for one rank: its container's counters, or why they could not be read."""

    rank: int
    usage: ContainerUsage | None
    error: str = ""


@dataclass(frozen=True)
class Notice:
    """For the progress output: a reconnect, a fallback to polling."""

    text: str


Observation = LineSeen | StateSeen | LogEnded | EventSeen | Unobservable | UsageSeen | Notice


class RankSource(Protocol):
    """Where the gates read ranks from: the streams over SSH in production (polling per node as the fallback),
    fakes in tests. The gates never sleep themselves: they wait in `next_items`."""

    def next_items(self, timeout_s: float, pace_s: float) -> list[Observation]:
        """What arrived, waiting up to `timeout_s` for the first item (an empty list: nothing came).
        `pace_s`: how often a source that polls looks (a streaming source ignores it)."""
        ...

    def request_usage(self) -> None:
        """Ask for one sample of every rank's container counters: it arrives as UsageSeen items."""
        ...

    def close(self) -> None:
        """Stop watching (end the streams); idempotent."""
        ...


class PollingRankSource:
    """A RankSource over a RankPoller: one look at every rank per `pace_s`, as the gates used to poll."""

    def __init__(self, poller: RankPoller, ranks: Sequence[int], clock: Clock) -> None:
        self.poller, self.ranks, self.clock = poller, list(ranks), clock
        self._next_poll: float | None = None
        self._usage_wanted = False

    def request_usage(self) -> None:
        self._usage_wanted = True

    def next_items(self, timeout_s: float, pace_s: float) -> list[Observation]:
        if self._usage_wanted:
            self._usage_wanted = False
            return usage_once(self.poller, self.ranks)
        now = self.clock.monotonic()
        if self._next_poll is not None and now < self._next_poll:
            wait = min(timeout_s, self._next_poll - now)
            if wait > 0:
                self.clock.sleep(wait)
            if self.clock.monotonic() < self._next_poll:
                return []
        items = poll_once(self.poller, self.ranks)
        self._next_poll = self.clock.monotonic() + pace_s
        return items

    def close(self) -> None:
        pass


def poll_once(poller: RankPoller, ranks: Sequence[int]) -> list[Observation]:
    """Every rank's state, then every rank's new lines; a rank found not running has its log complete."""
    items: list[Observation] = []
    stopped: list[int] = []
    for rank in ranks:
        try:
            state = poller.state(rank)
        except SourceError as err:
            items.append(Unobservable(rank, f"docker inspect: {err}"))
            continue
        items.append(StateSeen(rank, state, "poll"))
        if not state.running:
            stopped.append(rank)
    for rank in ranks:
        try:
            items.extend(LineSeen(rank, line) for line in poller.new_lines(rank))
        except SourceError as err:
            items.append(Unobservable(rank, f"docker logs: {err}"))
    items.extend(LogEnded(rank) for rank in stopped)
    return items


def usage_once(poller: RankPoller, ranks: Sequence[int]) -> list[Observation]:
    """Every rank's container counters, one look each."""
    items: list[Observation] = []
    for rank in ranks:
        try:
            items.append(UsageSeen(rank, poller.usage(rank)))
        except SourceError as err:
            items.append(UsageSeen(rank, None, str(err)))
    return items


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    def now(self) -> datetime: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def now(self) -> datetime:
        return datetime.now(UTC)


Reporter = Callable[[str], None]


class GateFailure(Exception):
    """A gate's verdict: the message names the cause, what to do, and every rank's last lines."""


# ---------------------------------------------------------------------------------------------
# Log patterns (vLLM 0.33 wording plus older releases)

# `shm_broadcast.py` prints "No available shared memory broadcast block found in 60 seconds"
# while a rank waits on another: it is not progress (the recipe's launcher ignores it too).
_NOISE = re.compile(r"shm_broadcast\.py|No available shared memory broadcast block")

_RANK_ASSIGNED = re.compile(r"\brank (\d+) in world size (\d+) is assigned as")
_JOINED = (
    _RANK_ASSIGNED,
    re.compile(r"vLLM is using nccl==", re.IGNORECASE),
)
# Printed before init_process_group blocks: the rank reached the rendezvous but may not be in.
_INIT_METHOD = re.compile(r"distributed_init_method=(?:tcp://)?(\S+?)(?:\s|$)")
_REACHED = (
    re.compile(r"world_size=\d+ rank=\d+"),
    _INIT_METHOD,
    re.compile(r"DP group leader"),
    re.compile(r"headless multiproc executor", re.IGNORECASE),
)
# torch's store timeout when a rank never joins: "DistStoreError: ... 1/2 clients joined".
_DIST_STORE_FAILURE = re.compile(r"DistStoreError|\b\d+/\d+ clients joined")

_READY = re.compile(r"Application startup complete\.?|Starting vLLM API server")

PHASES: tuple[str, ...] = (
    "rendezvous",
    "loading weights",
    "KV cache",
    "graph capture",
    "warm-up",
    "API starting",
    "ready",
)

# From KV-cache profiling on, the boot is in its last minutes (graph capture, warm-up, API start).
NEAR_READY_PHASES = frozenset({"KV cache", "graph capture", "warm-up", "API starting"})

# Checked latest phase first, so a line that mentions two phases counts for the later one.
_PHASE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ready", re.compile(r"Application startup complete")),
    (
        "API starting",
        re.compile(
            r"Starting vLLM (?:API )?server|Started server process|Waiting for application startup"
            r"|Available routes are"
        ),
    ),
    (
        "warm-up",
        re.compile(
            r"init engine \(profile|\bwarming up\b|\bwarm-?up (?:model|run|took|finished|done)"
            r"|torch\.compile takes|Compiling a graph for|Dynamo bytecode transform",
            re.IGNORECASE,
        ),
    ),
    ("graph capture", re.compile(r"Capturing CUDA graph|Graph capturing finished", re.IGNORECASE)),
    (
        "KV cache",
        re.compile(r"Available KV cache memory|GPU KV cache size|Maximum concurrency for", re.IGNORECASE),
    ),
    (
        "loading weights",
        re.compile(
            r"Starting to load model|Loading weights took|Model loading took"
            r"|Loading safetensors checkpoint shards|Loading model weights",
            re.IGNORECASE,
        ),
    ),
    ("rendezvous", re.compile("|".join(p.pattern for p in (*_REACHED, *_JOINED)), re.IGNORECASE)),
)


def is_noise(text: str) -> bool:
    return bool(_NOISE.search(text))


def is_join_line(text: str) -> bool:
    """The rank is in the distributed group (groups formed, NCCL picked)."""
    return any(p.search(text) for p in _JOINED)


def is_reached_line(text: str) -> bool:
    """The rank reached the rendezvous (it may still be blocked in init_process_group)."""
    return any(p.search(text) for p in _REACHED)


def assigned_rank(text: str) -> tuple[int, int] | None:
    """(global rank, world size) from `rank N in world size W is assigned as ...`."""
    m = _RANK_ASSIGNED.search(text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def init_method_address(text: str) -> str | None:
    """HEAD:PORT from `distributed_init_method=tcp://HEAD:PORT`."""
    m = _INIT_METHOD.search(text)
    return m.group(1).rstrip(",") if m else None


def is_rendezvous_failure(text: str) -> bool:
    return bool(_DIST_STORE_FAILURE.search(text))


def is_ready_line(text: str) -> bool:
    return bool(_READY.search(text))


# Every phase pattern's every alternative holds one of these (lower case): a line with none of them names no
# phase, found with a few substring tests instead of the case-insensitive searches (a flood stays cheap).
_PHASE_WORDS = ("startup", "server", "routes are", "init engine", "warm", "torch.compile", "dynamo", "graph",
                "kv cache", "concurrency", "load", "world_size=", "distributed_init_method=", "dp group leader",
                "headless multiproc", "in world size", "nccl")


def phase_of(text: str) -> str | None:
    """The boot phase a log line belongs to, or None for lines that say nothing about it."""
    if is_noise(text):
        return None
    low = text.lower()
    if not any(word in low for word in _PHASE_WORDS):
        return None
    for name, pattern in _PHASE_PATTERNS:
        if pattern.search(text):
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Settings and results


# The gates follow the ranks' streams and decide when a line or an event arrives. These paces are what a node
# that cannot stream is polled at (the fallback; <= 5 s so an exited container is noticed within 15 s) and how
# often the gates report progress.
WATCH_POLL_INTERVAL_S = 5.0
WATCH_PROGRESS_INTERVAL_S = 30.0
# Once loading is done (KV cache, graphs, warm-up, API start), readiness is minutes away at most: a polled
# node is polled faster then, so the update returns within about this long of "Application startup complete."
NEAR_READY_POLL_S = 0.5
# After a rank's exit, how long the gate waits for the rest of its log (the lines written just before the
# exit usually hold the traceback) before it fails; docker ends the log stream at the exit, so this is a bound.
EXIT_DRAIN_S = 1.0
# One GET /v1/models, connect and read.
MODELS_PROBE_TIMEOUT_S = 5.0
# Silence is not a stall while the ranks' containers show progress: once no rank has logged for USAGE_QUIET_S,
# the ready gate samples every rank container's memory and block I/O (`docker stats`) every USAGE_INTERVAL_S
# (both at most a half and a quarter of the stall limit); a counter grown by USAGE_MIN_GROWTH_BYTES since the
# window's first sample is progress (docker prints 3-4 significant digits: ~10 MiB at 100 GiB).
USAGE_QUIET_S = 60.0
USAGE_INTERVAL_S = 30.0
USAGE_MIN_GROWTH_BYTES = float(16 << 20)


@dataclass(frozen=True, kw_only=True)
class WatchSettings:
    """What both gates share. The timeouts (in the subclasses) have no defaults: they are operator settings,
    whose defaults live in components/config.py."""

    poll_interval_s: float = WATCH_POLL_INTERVAL_S
    tail_lines: int = 20
    max_source_errors: int = 3
    progress_interval_s: float = WATCH_PROGRESS_INTERVAL_S
    secrets: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.poll_interval_s <= 5:
            raise ValueError(
                f"poll_interval_s={self.poll_interval_s} is out of range: use 0 < value <= 5 so an exited "
                "container is noticed within 15 s"
            )
        if self.tail_lines < 1:
            raise ValueError(f"tail_lines={self.tail_lines} must be >= 1")
        if self.max_source_errors < 1:
            raise ValueError(f"max_source_errors={self.max_source_errors} must be >= 1")
        if self.progress_interval_s <= 0:
            raise ValueError(f"progress_interval_s={self.progress_interval_s} must be > 0")


@dataclass(frozen=True, kw_only=True)
class RendezvousSettings(WatchSettings):
    rendezvous_timeout_s: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rendezvous_timeout_s <= 0:
            raise ValueError(f"rendezvous_timeout_s={self.rendezvous_timeout_s} must be > 0")


@dataclass(frozen=True, kw_only=True)
class ReadySettings(WatchSettings):
    ready_timeout_s: float
    stall_s: float
    """No rank logged a (non-noise) line, and no rank container's memory or block I/O grew, for this long = hung."""
    near_ready_poll_s: float = NEAR_READY_POLL_S
    usage_quiet_s: float = USAGE_QUIET_S
    usage_interval_s: float = USAGE_INTERVAL_S
    usage_min_growth_bytes: float = USAGE_MIN_GROWTH_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.usage_quiet_s <= 0 or self.usage_interval_s <= 0 or self.usage_min_growth_bytes <= 0:
            raise ValueError(f"usage_quiet_s={self.usage_quiet_s}, usage_interval_s={self.usage_interval_s} and "
                             f"usage_min_growth_bytes={self.usage_min_growth_bytes} must be > 0")
        if self.near_ready_poll_s <= 0:
            raise ValueError(f"near_ready_poll_s={self.near_ready_poll_s} must be > 0")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s={self.ready_timeout_s} must be > 0")
        if self.stall_s <= 0:
            raise ValueError(f"stall_s={self.stall_s} must be > 0")


@dataclass(frozen=True)
class RendezvousResult:
    elapsed_s: float
    passed_at: str
    world_size: int | None
    joined_at: dict[int, str]


@dataclass(frozen=True)
class ReadyResult:
    elapsed_s: float
    passed_at: str
    phases: dict[str, str]


# ---------------------------------------------------------------------------------------------
# Shared observation: per-rank tails, activity, container state


@dataclass
class _RankView:
    spec: RankSpec
    tail: deque[str]
    last_activity: float
    first_state: ContainerState | None = None
    source_errors: int = 0
    last_error: str = ""
    reached: bool = False
    joined: bool = False
    log_ended: bool = False
    oom: bool = False
    usage: ContainerUsage | None = None
    """The container's counters, last sample."""
    usage_base: ContainerUsage | None = None
    """What a sample is compared with: the quiet window's first, or the last that showed growth."""
    usage_error: str = ""


_WATCHDOG_LOG = "~/.local/state/dsv41-exl3-<stack>/watchdog.log"
_OOM_KILLER = "the kernel OOM killer (`journalctl -k | grep -i \"out of memory\"` on that node)"


def _exit_hint(code: int | None, oom: bool = False, head: bool = False) -> str:
    """What a rank's exit code points to. vLLM exits 0 on SIGTERM (a headless worker stopped by docker stop or the
    watchdog) and the head exits 0 after a rank of its group died; 137 is SIGKILL (a worker killed while it loads
    weights, ignoring SIGTERM, ends so too)."""
    if oom:
        return ("the kernel OOM killer killed it (docker reported oom): the node ran out of memory; see "
                f"{_WATCHDOG_LOG} on that node for what held it")
    candidates = (f"candidates: the memory watchdog (see {_WATCHDOG_LOG} on that node: it stops every rank), "
                  f"{_OOM_KILLER}, or a docker stop by an operator")
    if code == 137:
        return f"exit 137 = killed by SIGKILL (a docker stop that timed out, or a kill); {candidates}"
    if code == 0:
        if head:
            return ("vLLM's head exits 0 seconds after a rank of its group died: its engine lost the worker "
                    "(`WorkerProc hit an exception`, `Connection closed by peer` in its last lines); every rank's "
                    f"last lines are below; it also exits 0 when stopped (SIGTERM); {candidates}")
        return f"exit 0 = vLLM stopped as it does on SIGTERM; {candidates}"
    if code == 143:
        return "exit 143 = SIGTERM: something ran docker stop (the memory watchdog or an operator)"
    if code == 139:
        return "exit 139 = segmentation fault in a native kernel: check the image and driver versions"
    return "read the last lines below for the Python traceback"


class _Cluster:
    """Every rank as a RankSource reports it, and what the failure messages need. `step` waits for what
    arrives and applies it: an exit, a missing or restarted container, or a node that cannot be observed
    fails at once (GateFailure); the new lines are returned for the gate's own decisions."""

    def __init__(self, ranks: Sequence[RankSpec], source: RankSource, settings: WatchSettings,
                 clock: Clock, report: Reporter, min_growth_bytes: float = USAGE_MIN_GROWTH_BYTES) -> None:
        if not ranks:
            raise ValueError("ranks is empty: a gate needs at least the head (rank 0)")
        self.source = source
        self.settings = settings
        self.clock = clock
        self.report = report
        self.min_growth_bytes = min_growth_bytes
        # When a container counter last grew (monotonic), and which.
        self.usage_progress_at: float | None = None
        self.usage_growth = ""
        start = clock.monotonic()
        self.views = {r.rank: _RankView(spec=r, tail=deque(maxlen=settings.tail_lines), last_activity=start)
                      for r in sorted(ranks, key=lambda r: r.rank)}

    def head(self) -> _RankView:
        return self.views[min(self.views)]

    def _source_failed(self, view: _RankView, error: str) -> None:
        view.source_errors += 1
        view.last_error = error
        if view.source_errors >= self.settings.max_source_errors:
            raise GateFailure(self.message(
                f"cannot observe {view.spec.label()} on {view.spec.user}@{view.spec.host}:{view.spec.port}: "
                f"{view.source_errors} failures in a row, last: "
                f"{redact(view.last_error, self.settings.secrets, key_shapes=True)}",
                "check that the node is up and reachable over SSH with the configured key, and that "
                "the docker CLI works there for that user",
            ))

    def _line(self, view: _RankView, line: LogLine) -> None:
        view.tail.append(line.text)
        if not is_noise(line.text):
            view.last_activity = self.clock.monotonic()
            for v in self.views.values():  # counters are compared within one quiet window
                v.usage_base = None

    def _usage(self, view: _RankView, seen: UsageSeen) -> None:
        view.usage_error = seen.error
        if seen.usage is None:
            return
        view.usage = seen.usage
        if view.usage_base is None:
            view.usage_base = seen.usage
            return
        grew = seen.usage.grown_from(view.usage_base, self.min_growth_bytes)
        if grew is None:
            view.usage_base = view.usage_base.floor(seen.usage)
            return
        view.usage_base = seen.usage
        self.usage_progress_at = self.clock.monotonic()
        self.usage_growth = f"rank {view.spec.rank} {grew}"

    def _state(self, view: _RankView, state: ContainerState) -> bool:
        """Apply one state; True when the container is no longer running (the caller drains, then fails)."""
        view.source_errors = 0
        if view.first_state is None:
            view.first_state = state
        if state.status == "missing":
            raise GateFailure(self.message(
                f"{view.spec.label()}: the container does not exist",
                "something removed it; run `pulumi up` again to recreate it",
            ))
        if not state.running:
            view.oom = view.oom or state.oom_killed
            return True
        view.log_ended = False  # running (a new session's read): an end seen before was that session's
        if view.first_state.started_at and state.started_at and state.started_at != view.first_state.started_at:
            raise GateFailure(self.message(
                f"{view.spec.label()} restarted (started at {view.first_state.started_at}, "
                f"now {state.started_at})",
                "a restart policy brought it back after a crash; the last lines show the crash",
            ))
        return False

    def step(self, wake_at: float, pace_s: float) -> list[tuple[_RankView, LogLine]]:
        """Wait until something arrives or `wake_at` (monotonic); apply it; return the new lines."""
        items = self.source.next_items(max(wake_at - self.clock.monotonic(), 0.0), pace_s)
        got: list[tuple[_RankView, LogLine]] = []
        stopped: dict[int, ContainerState] = {}
        for item in items:
            if isinstance(item, Notice):
                self.report(redact(item.text, self.settings.secrets, key_shapes=True))
                continue
            view = self.views.get(item.rank)
            if view is None:
                continue
            if isinstance(item, LineSeen):
                self._line(view, item.line)
                if not stopped:
                    got.append((view, item.line))
            elif isinstance(item, StateSeen):
                if self._state(view, item.state):
                    stopped.setdefault(view.spec.rank, item.state)
            elif isinstance(item, LogEnded):
                view.log_ended = True
            elif isinstance(item, EventSeen):
                if item.action == "oom":
                    view.oom = True
                else:
                    self.report(f"{view.spec.label()}: docker event {item.action}")
            elif isinstance(item, Unobservable):
                self._source_failed(view, item.error)
            elif isinstance(item, UsageSeen):
                self._usage(view, item)
        if stopped:
            self._fail_stopped(stopped, pace_s)
        return got

    def _fail_stopped(self, stopped: Mapping[int, ContainerState], pace_s: float) -> None:
        """A rank stopped: take the rest of its log (up to EXIT_DRAIN_S) and any other rank's stop, then fail
        naming it: a worker before the head, whose exit follows a worker's death."""
        stopped = dict(stopped)
        views = [self.views[r] for r in stopped]
        head = self.head().spec.rank

        def waiting() -> bool:
            # the head's exit 0 follows a worker's death: give the worker's stop the same time to arrive
            return not all(v.log_ended for v in views) or (len(self.views) > 1 and list(stopped) == [head]
                                                           and stopped[head].exit_code == 0)

        until = self.clock.monotonic() + EXIT_DRAIN_S
        while waiting() and (now := self.clock.monotonic()) < until:
            for item in self.source.next_items(until - now, pace_s):
                view = self.views.get(getattr(item, "rank", -1))
                if view is None:
                    continue
                if isinstance(item, LineSeen):
                    self._line(view, item.line)
                elif isinstance(item, LogEnded):
                    view.log_ended = True
                elif isinstance(item, EventSeen) and item.action == "oom":
                    view.oom = True
                elif isinstance(item, StateSeen) and not item.state.running and item.state.status != "missing":
                    stopped.setdefault(item.rank, item.state)
                    view.oom = view.oom or item.state.oom_killed
        rank = min(stopped, key=lambda r: (r == head, r))
        state, view = stopped[rank], self.views[rank]
        cause = f"{view.spec.label()} is {state.status} with exit code {state.exit_code}"
        if rank == head and state.exit_code == 0 and not (view.oom or state.oom_killed):
            cause += ": a rank of the group died (vLLM's head ends with exit code 0 when its engine loses a rank)"
        also = [f"{self.views[r].spec.label()} is {s.status} with exit code {s.exit_code}"
                for r, s in stopped.items() if r != rank]
        if also:
            cause += f" (and {', '.join(also)})"
        raise GateFailure(self.message(
            cause, _exit_hint(state.exit_code, view.oom or state.oom_killed, head=rank == head)))

    def last_activity(self) -> float:
        return max(v.last_activity for v in self.views.values())

    def quiet_for(self) -> float:
        """Seconds since any rank logged a non-noise line (timed from when it was received)."""
        return self.clock.monotonic() - self.last_activity()

    def progress_at(self) -> float:
        """The last sign of progress: a non-noise line, or a container counter that grew."""
        if self.usage_progress_at is None:
            return self.last_activity()
        return max(self.last_activity(), self.usage_progress_at)

    def usage_summary(self) -> str:
        """Every rank's last container sample (or why there is none), for the messages."""
        parts = []
        for view in self.views.values():
            if view.usage is not None:
                parts.append(f"rank {view.spec.rank} {view.usage.text}")
            elif view.usage_error:
                parts.append(f"rank {view.spec.rank} unreadable "
                             f"({redact(view.usage_error, self.settings.secrets, key_shapes=True)})")
        return "; ".join(parts)

    def message(self, cause: str, what_to_do: str) -> str:
        secrets = self.settings.secrets
        parts = [f"{cause}. What to do: {what_to_do}."]
        for view in self.views.values():
            parts.append(f"--- {view.spec.label()}, last {len(view.tail)} lines ---")
            parts.extend(redact(t, secrets, key_shapes=True) for t in view.tail)
            if not view.tail:
                parts.append("(no log lines seen)")
        return "\n".join(parts)


def _iso(dt: datetime) -> str:
    return dt.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _fmt_duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# ---------------------------------------------------------------------------------------------
# Gate 1: rendezvous


def wait_for_rendezvous(ranks: Sequence[RankSpec], source: RankSource, settings: RendezvousSettings,
                        clock: Clock, report: Reporter) -> RendezvousResult:
    """Block until every rank's container logged that it joined the distributed group. Closes `source`."""
    try:
        return _rendezvous(ranks, source, settings, clock, report)
    finally:
        source.close()


def _rendezvous(ranks: Sequence[RankSpec], source: RankSource, settings: RendezvousSettings,
                clock: Clock, report: Reporter) -> RendezvousResult:
    cluster = _Cluster(ranks, source, settings, clock, report)
    start = clock.monotonic()
    deadline = start + settings.rendezvous_timeout_s
    last_report = start
    world_size: int | None = None
    master: str | None = None
    joined_at: dict[int, str] = {}
    while True:
        for view, line in cluster.step(min(deadline, last_report + settings.progress_interval_s),
                                       settings.poll_interval_s):
            if is_rendezvous_failure(line.text):
                raise GateFailure(cluster.message(
                    f"{view.spec.label()} logged a rendezvous failure: "
                    f"{redact(line.text.strip(), settings.secrets, key_shapes=True)}",
                    _rendezvous_advice([v.spec for v in cluster.views.values() if not v.joined], master),
                ))
            if is_reached_line(line.text):
                view.reached = True
                master = init_method_address(line.text) or master
            if is_join_line(line.text):
                view.joined = True
                joined_at.setdefault(view.spec.rank, line.at or _iso(clock.now()))
                assigned = assigned_rank(line.text)
                if assigned:
                    world_size = assigned[1]
        missing = [v for v in cluster.views.values() if not v.joined]
        now = clock.monotonic()
        if not missing:
            return RendezvousResult(elapsed_s=round(now - start, 3), passed_at=_iso(clock.now()),
                                    world_size=world_size, joined_at=joined_at)
        if now >= deadline:
            named = ", ".join(
                f"{v.spec.label()} ({'reached init_process_group but never joined' if v.reached else 'never reached the rendezvous: check its log below'})"  # noqa: E501
                for v in missing
            )
            raise GateFailure(cluster.message(
                f"rendezvous did not complete within {settings.rendezvous_timeout_s:g} s: {named}",
                _rendezvous_advice([v.spec for v in missing], master),
            ))
        if now - last_report >= settings.progress_interval_s:
            last_report = now
            report(f"rendezvous: waiting for {', '.join(f'rank {v.spec.rank}' for v in missing)} "
                   f"to join, elapsed {_fmt_duration(now - start)}")


def _rendezvous_advice(missing: Sequence[RankSpec], master: str | None) -> str:
    where = f"master {master}" if master else "the master address/port (--master-addr/--master-port)"
    nodes = ", ".join(r.node for r in missing) or "the workers"
    return (
        f"on {nodes} check: the fabric interface (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME must be the CX-7 "
        f"netdev that reaches {where}); NCCL_IB_GID_INDEX (must be the RoCE v2 GID holding the node's "
        f"fabric IPv4); a firewall blocking {where} on the head; a stale rank container from an earlier "
        "deployment still holding the port or joining in its place (docker ps -a on every node)"
    )


# ---------------------------------------------------------------------------------------------
# Gate 2: ready


@dataclass(frozen=True)
class ModelsProbeResult:
    outcome: Literal["listed", "not_listed", "unauthorized", "unreachable"]
    detail: str = ""
    ids: tuple[str, ...] = ()


ModelsProbe = Callable[[], ModelsProbeResult]


def wait_for_ready(ranks: Sequence[RankSpec], source: RankSource, settings: ReadySettings, clock: Clock,
                   report: Reporter, probe: ModelsProbe, model_name: str) -> ReadyResult:
    """Block until the head logged startup complete and /v1/models lists `model_name`. Closes `source`."""
    try:
        return _ready(ranks, source, settings, clock, report, probe, model_name)
    finally:
        source.close()


def _ready(ranks: Sequence[RankSpec], source: RankSource, settings: ReadySettings, clock: Clock,
           report: Reporter, probe: ModelsProbe, model_name: str) -> ReadyResult:
    cluster = _Cluster(ranks, source, settings, clock, report, settings.usage_min_growth_bytes)
    start = clock.monotonic()
    deadline = start + settings.ready_timeout_s
    last_report = start
    phases: dict[str, str] = {}
    phase = "rendezvous"
    phase_since = start
    head_ready = False
    next_probe = start
    last_probe = ModelsProbeResult("unreachable", "not probed yet")
    head = cluster.head()
    # The containers' counters are sampled only while every rank is silent: a chatty boot costs nothing.
    usage_quiet = min(settings.usage_quiet_s, settings.stall_s / 2)
    usage_every = min(settings.usage_interval_s, settings.stall_s / 4)
    last_usage = -math.inf
    while True:
        pace = settings.poll_interval_s
        if phase in NEAR_READY_PHASES:
            pace = min(pace, settings.near_ready_poll_s)
        wake = min(deadline, last_report + settings.progress_interval_s, cluster.progress_at() + settings.stall_s)
        if head_ready:
            wake = min(wake, next_probe)
        else:
            wake = min(wake, max(cluster.last_activity() + usage_quiet, last_usage + usage_every))
        for view, line in cluster.step(wake, pace):
            if is_rendezvous_failure(line.text):
                raise GateFailure(cluster.message(
                    f"{view.spec.label()} logged a rendezvous failure: "
                    f"{redact(line.text.strip(), settings.secrets, key_shapes=True)}",
                    _rendezvous_advice([r for r in ranks if r.rank != view.spec.rank], None),
                ))
            seen = phase_of(line.text)
            if seen is not None:
                if seen not in phases:
                    phases[seen] = line.at or _iso(clock.now())
                if seen != phase:
                    phase, phase_since = seen, clock.monotonic()
            if view is head and is_ready_line(line.text) and not head_ready:
                head_ready, next_probe = True, clock.monotonic()
        now = clock.monotonic()
        if head_ready and now >= next_probe:
            last_probe = probe()
            next_probe = clock.monotonic() + pace
            if last_probe.outcome == "listed":
                phases.setdefault("ready", _iso(clock.now()))
                return ReadyResult(elapsed_s=round(clock.monotonic() - start, 3), passed_at=_iso(clock.now()),
                                   phases=phases)
            if last_probe.outcome == "not_listed":
                raise GateFailure(cluster.message(
                    f"the server is up but /v1/models lists {list(last_probe.ids)}, not {model_name!r}",
                    "make the served model name (--served-model-name) and the gate's model name agree",
                ))
            if last_probe.outcome == "unauthorized":
                raise GateFailure(cluster.message(
                    f"/v1/models refused the API key: {last_probe.detail}",
                    "give the gate the same API key the server was started with (--api-key / VLLM_API_KEY)",
                ))
        quiet = cluster.quiet_for()
        if now - cluster.progress_at() >= settings.stall_s:
            raise GateFailure(cluster.message(_stall_cause(cluster, quiet, settings.stall_s, phase),
                "a rank is probably hung (NCCL, a deadlocked kernel); dump stacks with `py-spy dump` in the "
                "containers, then restart; if this boot is legitimately silent for longer with its containers' "
                "counters standing still (JIT), raise stall_s",
            ))
        if not head_ready and now >= max(cluster.last_activity() + usage_quiet, last_usage + usage_every):
            last_usage = now
            source.request_usage()
        if now >= deadline:
            extra = ("; the head logged startup complete but /v1/models was never answered: "
                     f"{last_probe.detail}" if head_ready else "")
            raise GateFailure(cluster.message(
                f"not ready within {settings.ready_timeout_s:g} s, last phase {phase!r}{extra}",
                "if the ranks are still making progress (see below), raise ready_timeout_s; if the API is "
                "up but unreachable, check the api base URL and the firewall on the serve port",
            ))
        if now - last_report >= settings.progress_interval_s:
            last_report = now
            growing = ""
            if cluster.usage_progress_at is not None and cluster.usage_progress_at > cluster.last_activity():
                growing = (f"; silent but progressing: {cluster.usage_growth} "
                           f"{_fmt_duration(now - cluster.usage_progress_at)} ago")
            report(f"ready gate: phase {phase!r} for {_fmt_duration(now - phase_since)}, elapsed "
                   f"{_fmt_duration(now - start)}, last log line {_fmt_duration(quiet)} ago{growing}")


def _stall_cause(cluster: _Cluster, quiet: float, stall_s: float, phase: str) -> str:
    """No line and no counter growth for stall_s: what was last seen of both."""
    cause = f"no rank logged anything new for {_fmt_duration(quiet)}"
    summary = cluster.usage_summary()
    sampled = any(v.usage is not None for v in cluster.views.values())
    if cluster.usage_progress_at is not None and cluster.usage_progress_at > cluster.last_activity():
        cause += (f" and no rank container's memory or block I/O grew for "
                  f"{_fmt_duration(cluster.clock.monotonic() - cluster.usage_progress_at)} "
                  f"(last: {cluster.usage_growth})")
    elif sampled:
        cause += " and no rank container's memory or block I/O grew meanwhile"
    cause += f" (stall limit {stall_s:g} s) in phase {phase!r}"
    if summary:
        cause += f"; docker stats: {summary}"
    return cause


class ModelsEndpoint:
    """GET {api_base}/v1/models within `timeout_s` (connect and read); the API key goes in a header, never a
    message."""

    def __init__(self, api_base: str, model_name: str, api_key: str | None = None,
                 timeout_s: float = MODELS_PROBE_TIMEOUT_S) -> None:
        base = api_base.rstrip("/")
        self.url = (base if base.endswith("/v1") else base + "/v1") + "/models"
        self.model_name = model_name
        self._api_key = api_key
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"ModelsEndpoint({self.url})"

    def __call__(self) -> ModelsProbeResult:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            reply = exchange("GET", self.url, headers=headers, deadline=time.monotonic() + self.timeout_s)
        except (ConnectionRefusedOrReset, DeadlineExceeded, HTTPException, OSError) as err:
            return ModelsProbeResult("unreachable", f"GET {self.url}: {type(err).__name__}")
        if reply.status in (401, 403):
            return ModelsProbeResult("unauthorized", f"GET {self.url}: HTTP {reply.status}")
        if reply.status != 200:
            return ModelsProbeResult("unreachable", f"GET {self.url}: HTTP {reply.status}")
        try:
            data = json.loads(reply.body).get("data", [])
            ids = tuple(str(m.get("id")) for m in data if isinstance(m, dict))
        except (ValueError, AttributeError):
            return ModelsProbeResult("unreachable", f"GET {self.url}: answer is not the OpenAI models list")
        if self.model_name in ids:
            return ModelsProbeResult("listed", ids=ids)
        return ModelsProbeResult("not_listed", f"GET {self.url} lists {list(ids)}", ids=ids)


# ---------------------------------------------------------------------------------------------
# The real source: docker over SSH

_DOCKER_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) ?(.*)$")
_INSPECT_FORMAT = "{{.State.Status}} {{.State.ExitCode}} {{.State.StartedAt}}"
STATS_FORMAT = "{{json .}}"


def timestamp_key(stamp: str) -> tuple[int, int]:
    """Sortable (unix seconds, nanoseconds) for docker's RFC 3339 stamps, whose fraction length varies."""
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", stamp)
    if not m:
        raise SourceError(f"unexpected docker timestamp {stamp[:60]!r}")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    seconds = int(datetime.fromisoformat(m.group(1) + zone).timestamp())
    nanos = int((m.group(2) or "0")[:9].ljust(9, "0"))
    return seconds, nanos


def parse_inspect(output: str) -> ContainerState:
    """Parse `docker inspect -f '<status> <exit code> <started at> [<oom killed>]'`."""
    fields = output.strip().split()
    if len(fields) not in (3, 4) or not fields[1].lstrip("-").isdigit():
        raise SourceError(f"unexpected docker inspect output {output.strip()[:200]!r}")
    return ContainerState(status=fields[0], exit_code=int(fields[1]), started_at=fields[2],
                          oom_killed=len(fields) == 4 and fields[3] == "true")


def parse_docker_logs(output: str) -> list[LogLine]:
    """Parse `docker logs --timestamps`: `<RFC3339Nano> <text>` per line; progress bars use \\r."""
    lines: list[LogLine] = []
    for raw in output.split("\n"):  # not splitlines(): that would also split tqdm's \r redraws
        if not raw.strip():
            continue
        m = _DOCKER_TS.match(raw)
        at, text = (m.group(1), m.group(2)) if m else (None, raw)
        # tqdm redraws with \r: the last redraw is the current state
        text = text.rstrip("\r").rsplit("\r", 1)[-1]
        lines.append(LogLine(text=text, at=at))
    return lines


Runner = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    # bytes, decoded by hand: text mode would turn tqdm's \r redraws into separate lines
    done = subprocess.run(argv, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    return subprocess.CompletedProcess(argv, done.returncode, done.stdout.decode("utf-8", "replace"),
                                       done.stderr.decode("utf-8", "replace"))


class SshRankSource:
    """Reads each rank's container with `docker inspect` / `docker logs` through ssh.

    The first `new_lines` reads from the container's StartedAt, so a re-run gate over a server
    that is already up sees its whole boot and passes at once. Later calls use the last
    timestamp seen; docker's --since is inclusive, so lines at exactly that instant are deduplicated.
    """

    def __init__(self, ranks: Sequence[RankSpec], *, private_key: str | None = None,
                 agent_socket: str | None = None, known_hosts_file: str | None = None,
                 remote_timeout_s: int = 10,
                 runner: Runner = _run) -> None:
        self._specs: Mapping[int, RankSpec] = {r.rank: r for r in ranks}
        self._targets = {
            r.rank: SshTarget(host=r.host, port=r.port, user=r.user, private_key=private_key,
                              agent_socket=agent_socket, known_hosts_file=known_hosts_file)
            for r in ranks
        }
        self._remote_timeout_s = remote_timeout_s
        self._runner = runner
        self._since: dict[int, str] = {}
        self._seen_at_since: dict[int, set[str]] = {}

    def __repr__(self) -> str:
        return f"SshRankSource(ranks={sorted(self._specs)})"

    def argv(self, rank: int, remote_command: str) -> list[str]:
        return ssh_argv(self._targets[rank], remote_command)

    def _remote(self, rank: int, remote_command: str) -> subprocess.CompletedProcess[str]:
        argv = self.argv(rank, remote_command)
        target = self._targets[rank]
        try:
            done = self._runner(argv, self._remote_timeout_s + 10.0)
        except subprocess.TimeoutExpired:
            raise SourceError(f"ssh {target.user}@{target.host}:{target.port} timed out") from None
        except OSError as err:
            raise SourceError(f"cannot run ssh: {err}") from None
        if done.returncode == 255:
            first = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise SourceError(f"ssh {target.user}@{target.host}:{target.port} failed: {first[:300]}")
        if done.returncode == 124:
            raise SourceError(f"docker on {target.host} did not answer within {self._remote_timeout_s} s")
        return done

    def state(self, rank: int) -> ContainerState:
        container = shlex.quote(self._specs[rank].container)
        fmt = shlex.quote(_INSPECT_FORMAT)
        done = self._remote(rank, f"timeout {self._remote_timeout_s} docker inspect -f {fmt} {container}")
        if done.returncode != 0:
            if "no such" in (done.stderr + done.stdout).lower():
                return ContainerState(status="missing")
            raise SourceError(f"docker inspect {self._specs[rank].container} failed: "
                              f"{(done.stderr or done.stdout).strip()[:300]}")
        return parse_inspect(done.stdout)

    def new_lines(self, rank: int) -> list[LogLine]:
        if rank not in self._since:
            started = self.state(rank).started_at
            if not started:
                raise SourceError(f"container {self._specs[rank].container} has no start time yet")
            self._since[rank] = started
            self._seen_at_since[rank] = set()
        since = self._since[rank]
        container = shlex.quote(self._specs[rank].container)
        done = self._remote(rank, f"timeout {self._remote_timeout_s} docker logs --timestamps "
                                  f"--since {shlex.quote(since)} {container} 2>&1")
        if done.returncode != 0:
            raise SourceError(
                f"docker logs {self._specs[rank].container} failed: {done.stdout.strip()[:300]}")
        fresh: list[LogLine] = []
        seen = self._seen_at_since[rank]
        newest, newest_key = since, timestamp_key(since)
        for line in parse_docker_logs(done.stdout):
            key = timestamp_key(line.at) if line.at else None
            if key is not None and key == timestamp_key(since) and line.text in seen:
                continue  # read by the previous call: --since is inclusive
            fresh.append(line)
            if key is not None and key > newest_key:
                newest, newest_key = line.at or newest, key
        # stdout and stderr arrive interleaved, so the newest instant is computed, not assumed last
        at_newest = {ln.text for ln in fresh if ln.at and timestamp_key(ln.at) == newest_key}
        seen = at_newest | (seen if newest == since else set())
        since = newest
        self._since[rank], self._seen_at_since[rank] = since, seen
        return fresh

    def usage(self, rank: int) -> ContainerUsage:
        container = self._specs[rank].container
        done = self._remote(rank, f"timeout {self._remote_timeout_s} docker stats --no-stream --format "
                                  f"{shlex.quote(STATS_FORMAT)} {shlex.quote(container)}")
        if done.returncode != 0:
            raise SourceError(f"docker stats {container} failed: {(done.stderr or done.stdout).strip()[:300]}")
        for line in done.stdout.splitlines():
            seen = parse_stats(line)
            if seen is not None and seen[0] == container:
                return seen[1]
        raise SourceError(f"docker stats {container}: unexpected output {done.stdout.strip()[:200]!r}")

    def resume_at(self, rank: int, since: str, seen: set[str]) -> None:
        """Continue after a stream's last line (`since`, its docker timestamp; `seen`: the texts at it)."""
        self._since[rank], self._seen_at_since[rank] = since, set(seen)


# ---------------------------------------------------------------------------------------------
# The streams: one ssh session per node runs components/gates/rank_stream.sh, which follows the containers'
# events and every rank's log; a reader thread per node turns its records into observations.

STREAM_SCRIPT = "gates/rank_stream.sh"
# A log line longer than this (characters) is cut on the node, so each record is one atomic pipe write.
STREAM_MAX_LINE = 2000
# After a session that streamed ends (the connection dropped): reconnect after this, resuming every log.
STREAM_RECONNECT_S = 0.2
# After a failed attempt (ssh failed, the script did not start): wait these in turn, the last one repeating.
RECONNECT_BACKOFF_S = (2.0, 4.0, 5.0)
# A node whose ssh works but whose stream does not start (or ends within STREAM_HEALTHY_S of starting, e.g. a
# log driver docker cannot follow) this many times in a row is polled instead.
STREAM_START_FAILURES = 2
STREAM_HEALTHY_S = 5.0
# Log lines waiting for the gate: a reader blocks beyond this (back-pressure down to the node), so a flood of
# lines never grows memory here; the gate takes at most STREAM_BATCH_ITEMS at a time. States, events and
# notices wait apart and go first, so a die behind a backlog of lines is decided within one batch of reading it.
STREAM_QUEUE_ITEMS = 2_000
STREAM_BATCH_ITEMS = 500
# Texts remembered at one docker timestamp for the dedupe after a reconnect (lines sharing one nanosecond).
_AT_SINCE_MAX = 1_000

Popen = Callable[..., "subprocess.Popen[bytes]"]


@dataclass
class _Resume:
    """Where a rank's log resumes after a reconnect, and what was delivered at that instant (docker's
    `--since` is inclusive): lines before it or already delivered at it are dropped, nothing else."""

    since: str = ""
    key: tuple[int, int] | None = None
    at_since: set[str] = field(default_factory=set)
    floor: tuple[int, int] | None = None
    floor_seen: frozenset[str] = frozenset()

    def reconnect(self) -> None:
        self.floor, self.floor_seen = self.key, frozenset(self.at_since)

    def accept(self, line: LogLine) -> bool:
        if line.at is None:
            return True
        try:
            key = timestamp_key(line.at)
        except SourceError:
            return True
        if self.floor is not None and (key < self.floor or (key == self.floor and line.text in self.floor_seen)):
            return False
        if self.key is None or key > self.key:
            self.since, self.key, self.at_since = line.at, key, {line.text}
        elif key == self.key and len(self.at_since) < _AT_SINCE_MAX:
            self.at_since.add(line.text)
        return True


def event_time(event: Mapping[str, Any]) -> str:
    """A docker event's time as an RFC 3339 UTC stamp (nanoseconds when the event has them)."""
    nanos = event.get("timeNano")
    if isinstance(nanos, int):
        seconds, frac = divmod(nanos, 1_000_000_000)
        base = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        return f"{base}.{frac:09d}Z"
    return datetime.fromtimestamp(int(event.get("time") or 0), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_event(text: str, ranks: Mapping[str, int]) -> Observation | None:
    """One `docker events --format '{{json .}}'` line as an observation of the rank it names, or None."""
    try:
        event = json.loads(text)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    actor = event.get("Actor")
    attrs = actor.get("Attributes") if isinstance(actor, dict) else None
    if not isinstance(attrs, dict):
        return None
    rank = ranks.get(str(attrs.get("name", "")))
    if rank is None:
        return None
    action = str(event.get("Action") or event.get("status") or "")
    if action == "die":
        code = str(attrs.get("exitCode", ""))
        return StateSeen(rank, ContainerState("exited", int(code) if code.lstrip("-").isdigit() else None, ""),
                         "die event")
    if action == "start":
        return StateSeen(rank, ContainerState("running", 0, event_time(event)), "start event")
    if action == "oom" or action.startswith("health_status"):
        return EventSeen(rank, action)
    return None  # stop, kill, ...: a die follows


class _NodeStream(threading.Thread):
    """One node: its ssh session running the stream script, reconnected with bounded backoff; polled when the
    stream cannot be started."""

    def __init__(self, owner: StreamRankSource, target: SshTarget, specs: Sequence[RankSpec]) -> None:
        super().__init__(name=f"rank-stream-{specs[0].node}", daemon=True)
        self.owner, self.target, self.specs = owner, target, list(specs)
        self.ranks = {r.container: r.rank for r in specs}
        self.resume = {r.rank: _Resume() for r in specs}
        self.node = specs[0].node
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.polling = False
        self.sessions = 0
        self._usage_wanted = threading.Event()

    def _where(self) -> str:
        return f"{self.target.user}@{self.target.host}:{self.target.port}"

    def run(self) -> None:
        try:
            self._run()
        except Exception as err:  # noqa: BLE001 - a reader that dies silently would leave the gate blind
            if not self.owner.stopping():
                self._poll(f"the stream reader failed ({type(err).__name__}: {err})")

    def _run(self) -> None:
        failures = start_failures = 0
        while not self.owner.stopping():
            kind, detail = self._session()
            if self.owner.stopping():
                return
            if kind == "fallback":
                self._poll(detail)
                return
            if kind == "streamed":
                failures = start_failures = 0
                self.owner.put(Notice(f"rank watch: the stream from node {self.node} ({self._where()}) ended "
                                      f"({detail}); reconnecting, each log resumes after its last line"))
                self.owner.wait(STREAM_RECONNECT_S)
                continue
            failures += 1
            if kind == "dropped":
                self.owner.put(Notice(f"rank watch: the stream from node {self.node} ({self._where()}) ended "
                                      f"soon after it started ({detail}); reconnecting, each log resumes after its "
                                      "last line"))
            if kind == "no-start":
                start_failures += 1
                if start_failures >= STREAM_START_FAILURES:
                    self._poll(detail)
                    return
            for spec in self.specs:
                self.owner.put(Unobservable(spec.rank, detail))
            self.owner.wait(RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S)) - 1])

    def _session(self) -> tuple[Literal["streamed", "dropped", "refused", "no-start", "fallback"], str]:
        """One session: `streamed` (it ran STREAM_HEALTHY_S or more), `dropped` (ssh failed soon after it
        started), `refused` (ssh failed before), `no-start` (ssh worked, the stream did not, or ended at once),
        `fallback` (the node says it cannot stream)."""
        for res in self.resume.values():
            res.reconnect()
        watch = " ".join(f"{c}={self.resume[r].since}" for c, r in self.ranks.items())
        text = scripts.render(STREAM_SCRIPT, {"WATCH": watch, "MAX_LINE": STREAM_MAX_LINE})
        argv = ssh_argv(self.target, text)
        with tempfile.TemporaryFile() as err:
            try:
                proc = self.owner.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
            except OSError as exc:
                return "no-start", f"cannot run ssh: {exc}"
            with self._lock:
                self._proc = proc
            if self.owner.stopping():
                self._end(proc)
            self.sessions += 1
            began = time.monotonic()
            try:
                ready, why, fallback = self._read(proc)
            finally:
                self._end(proc)
                with self._lock:
                    self._proc = None
            err.seek(0)
            last = (err.read().decode("utf-8", "replace").strip().splitlines() or [""])[-1][:300]
        if fallback is not None:
            return "fallback", fallback
        rc = proc.returncode
        ended = why or (f"ssh exited {rc}: {last}" if last else f"ssh exited {rc}")
        if ready and time.monotonic() - began >= STREAM_HEALTHY_S:
            return "streamed", ended
        if ready and rc == 255:
            return "dropped", ended
        if ready:
            return "no-start", f"the stream from node {self.node} ended within {STREAM_HEALTHY_S:g} s ({ended})"
        if rc == 255:
            return "refused", f"ssh {self._where()} failed: {last or 'no message'}"
        return "no-start", (f"the stream script on node {self.node} exited {rc} before streaming"
                            + (f": {last}" if last else ""))

    def _read(self, proc: subprocess.Popen[bytes]) -> tuple[bool, str, str | None]:
        """Records until the session ends: (streamed, why it was ended here, fallback reason)."""
        assert proc.stdout is not None
        ready = False
        ended: set[str] = set()
        for raw in proc.stdout:
            record = raw.rstrip(b"\n").decode("utf-8", "replace")
            tag, _, rest = record.partition(" ")
            if tag == "L":
                container, _, log = rest.partition(" ")
                rank = self.ranks.get(container)
                if rank is not None:
                    for line in parse_docker_logs(log):
                        if self.resume[rank].accept(line):
                            self.owner.put(LineSeen(rank, line))
            elif tag == "E":
                seen = parse_event(rest, self.ranks)
                if seen is not None:
                    self.owner.put(seen)
            elif tag == "S":
                container, _, state_text = rest.partition(" ")
                rank = self.ranks.get(container)
                if rank is None:
                    continue
                if state_text == "missing":
                    self.owner.put(StateSeen(rank, ContainerState("missing")))
                    continue
                if state_text.startswith("error"):
                    self.owner.put(Unobservable(rank, f"docker inspect {container}: {state_text[6:]}"))
                    continue
                try:
                    state = parse_inspect(state_text)
                except SourceError as exc:
                    self.owner.put(Unobservable(rank, str(exc)))
                    continue
                self.owner.put(StateSeen(rank, state))
                if container in ended and state.running:
                    return ready, f"the log of {container} ended while it runs", None
            elif tag == "X":
                rank = self.ranks.get(rest)
                if rank is not None:
                    ended.add(rest)
                    self.owner.put(LogEnded(rank))
            elif tag == "U":
                stats = parse_stats(rest)
                rank = self.ranks.get(stats[0]) if stats is not None else None
                if stats is not None and rank is not None:
                    self.owner.put(UsageSeen(rank, stats[1]))
            elif tag == "u":
                for spec in self.specs:
                    self.owner.put(UsageSeen(spec.rank, None, f"docker stats on node {self.node}: {rest}"))
            elif tag == "R":
                ready = True
            elif tag == "Z":
                # the session ending (its docker clients stopped) or docker events alone: tell them apart
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)
                return ready, "docker events ended", None
            elif tag == "F":
                return ready, "", f"node {self.node} cannot stream: {rest}"
            if self.owner.stopping():
                break
        return ready, "", None

    def _end(self, proc: subprocess.Popen[bytes]) -> None:
        """End the session: closing its stdin makes the script stop its docker clients; then the client."""
        with contextlib.suppress(OSError, ValueError):
            if proc.stdin is not None:
                proc.stdin.close()
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def request_usage(self) -> None:
        """Ask the node's session for one `docker stats` sample (a line `U` on its stdin), or the polling loop;
        between sessions nothing is asked (the gate asks again)."""
        if self.polling:
            self._usage_wanted.set()
            return
        with self._lock:
            proc = self._proc
        if proc is None or proc.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.write(b"U\n")
            proc.stdin.flush()

    def stop(self) -> None:
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                if proc.stdin is not None:
                    proc.stdin.close()
            proc.terminate()

    def _poll(self, why: str) -> None:
        """The fallback: `docker inspect` and `docker logs --since` once per pace, resuming after the stream."""
        self.polling = True
        self.owner.put(Notice(f"rank watch: {why}; polling node {self.node} instead (docker inspect and docker "
                              f"logs over ssh, every {self.owner.pace:g} s, faster near ready)"))
        poller = self.owner.poller(self.specs)
        for spec in self.specs:
            res = self.resume[spec.rank]
            if res.since:
                poller.resume_at(spec.rank, res.since, res.at_since)
        while not self.owner.stopping():
            items = poll_once(poller, [s.rank for s in self.specs])
            if self._usage_wanted.is_set():
                self._usage_wanted.clear()
                items += usage_once(poller, [s.rank for s in self.specs])
            for item in items:
                self.owner.put(item)
            self.owner.wait(self.owner.pace)


class StreamRankSource:
    """The gates' RankSource: every node followed through one long-lived ssh session (over the node's
    ControlMaster) running components/gates/rank_stream.sh; see the module's README section.

    Nothing starts until the first `next_items`; `close` ends every session."""

    def __init__(self, ranks: Sequence[RankSpec], *, private_key: str | None = None,
                 agent_socket: str | None = None, known_hosts_file: str | None = None,
                 popen: Popen = subprocess.Popen, runner: Runner = _run) -> None:
        self._key, self._agent, self._known_hosts = private_key, agent_socket, known_hosts_file
        self.popen = popen
        self._runner = runner
        self._queue: queue.Queue[Observation] = queue.Queue(maxsize=STREAM_QUEUE_ITEMS)
        self._urgent: queue.Queue[Observation] = queue.Queue(maxsize=STREAM_QUEUE_ITEMS)
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self.pace = WATCH_POLL_INTERVAL_S
        nodes: dict[tuple[str, str, int], list[RankSpec]] = {}
        for r in ranks:
            nodes.setdefault((r.user, r.host, r.port), []).append(r)
        self.streams = [
            _NodeStream(self, SshTarget(host=host, port=port, user=user, private_key=private_key,
                                        agent_socket=agent_socket, known_hosts_file=known_hosts_file), specs)
            for (user, host, port), specs in nodes.items()
        ]
        self._started = False

    def __repr__(self) -> str:
        return f"StreamRankSource(nodes={[s.node for s in self.streams]})"

    def poller(self, specs: Sequence[RankSpec]) -> SshRankSource:
        return SshRankSource(specs, private_key=self._key, agent_socket=self._agent,
                             known_hosts_file=self._known_hosts, runner=self._runner)

    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def put(self, item: Observation) -> None:
        """From a node's reader: blocks while the gate is behind (back-pressure), never once closed. A line and
        its log's end keep their order; the rest is urgent."""
        target = self._queue if isinstance(item, LineSeen | LogEnded) else self._urgent
        while not self._stop.is_set():
            try:
                target.put(item, timeout=0.2)
            except queue.Full:
                continue
            self._arrived.set()
            return

    def _take(self) -> list[Observation]:
        items: list[Observation] = []
        for source, limit in ((self._urgent, STREAM_QUEUE_ITEMS), (self._queue, STREAM_BATCH_ITEMS)):
            while len(items) < limit:
                try:
                    items.append(source.get_nowait())
                except queue.Empty:
                    break
        return items

    def next_items(self, timeout_s: float, pace_s: float) -> list[Observation]:
        self.pace = pace_s
        if not self._started:
            self._started = True
            for stream in self.streams:
                stream.start()
        deadline = time.monotonic() + timeout_s
        while True:
            self._arrived.clear()
            items = self._take()
            left = deadline - time.monotonic()
            if items or left <= 0:
                return items
            self._arrived.wait(left)

    def request_usage(self) -> None:
        if self._started:
            for stream in self.streams:
                stream.request_usage()

    def close(self) -> None:
        self._stop.set()
        for stream in self.streams:
            stream.stop()
