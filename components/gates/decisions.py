"""The two gates' decisions: `wait_for_rendezvous` and `wait_for_ready` over any RankSource and Clock, and
what their failure messages say. Tests drive them with fake sources and a fake clock.

The stall rule. Silence alone is not a stall: a real headless worker prints nothing while it loads weights
(only rank 0 draws the safetensors progress bar), and on the recipe's hardware the worker streams 196 GiB over
NFS for ~15 min while the head loaded locally in ~250 s, so no rank prints for ~650 s of a healthy first boot.
The signals are each rank container's memory and block I/O as `docker stats --no-stream` reports them (the
page cache of the shards read and the weights loaded on the CPU are charged to the container's cgroup, local
reads show as block I/O) and, because on GB10 those can stand still for a whole load (the CUDA driver puts the
weights in unified memory, not charged to the container; NFS reads are not block I/O), the node's own counters:
bytes read from the weights' NFS server (/proc/self/mountstats), the fabric interface's rx bytes, and
MemAvailable falling (docs/hardware.md). All are read as the node's SSH user (no root, unlike /proc/<pid>/io)
over the ssh path the watch already has (a line `U` to the node's stream script: a polled node, the fallback,
reads the containers' counters only). The head's own progress was not chosen: the head is done long before the
worker, and a hung worker and a loading one look the same from it. CPU was not chosen: a rank spinning in a
hung NCCL collective burns CPU. The counters are sampled only once every rank has been silent for
USAGE_QUIET_S, then every USAGE_INTERVAL_S (a chatty boot costs nothing); memory or block I/O grown by
USAGE_MIN_GROWTH_BYTES since the quiet window's first sample is progress, as is MemAvailable fallen by
NODE_MEM_MIN_FALL_BYTES; memory given back is not (the baseline follows it down, and MemAvailable's follows it
up). Stall: no line and no growth for `stall_s`, reported with every rank's last sample. Counters that cannot be
read leave the rule as it was (silence alone).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.client import HTTPException
from typing import Literal

from components.contract import Contract
from components.gates.log_patterns import (
    FATAL_PATTERNS,
    NEAR_READY_PHASES,
    RENDEZVOUS_ADVICE,
    FatalPattern,
    assigned_rank,
    fatal_of,
    init_method_address,
    is_join_line,
    is_noise,
    is_reached_line,
    is_ready_line,
    phase_of,
)
from components.gates.observations import (
    Clock,
    ContainerState,
    ContainerUsage,
    EventSeen,
    GateFailure,
    LineSeen,
    LogEnded,
    LogLine,
    Notice,
    RankSource,
    RankSpec,
    Reporter,
    StateSeen,
    Unobservable,
    UsageSeen,
)
from components.http import ConnectionRefusedOrReset, DeadlineExceeded, exchange
from components.redaction import redact

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
class GateBounds(Contract):
    """The gates' bounds (`gates.*`): what an update's gates and a supervisor's restart both wait by. Crosses the
    program's boundary to the gates' provider and to the supervisor agent (components/contract.py)."""

    rendezvous_timeout_s: float
    ready_timeout_s: float
    stall_s: float
    """No rank logged a (non-noise) line, and no rank container's memory or block I/O grew, for this long = hung."""

    def __post_init__(self) -> None:
        for name, value in self.to_props().items():
            if not value > 0:
                raise ValueError(f"{name}={value} must be > 0")


@dataclass(frozen=True, kw_only=True)
class WatchSettings:
    """What both gates share. The bounds have no defaults: they are operator settings, whose defaults live in
    components/config."""

    bounds: GateBounds
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
    pass


@dataclass(frozen=True, kw_only=True)
class ReadySettings(WatchSettings):
    near_ready_poll_s: float = NEAR_READY_POLL_S
    usage_quiet_s: float = USAGE_QUIET_S
    usage_interval_s: float = USAGE_INTERVAL_S
    usage_min_growth_bytes: float = USAGE_MIN_GROWTH_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.usage_quiet_s <= 0 or self.usage_interval_s <= 0 or self.usage_min_growth_bytes <= 0:
            raise ValueError(
                f"usage_quiet_s={self.usage_quiet_s}, usage_interval_s={self.usage_interval_s} and "
                f"usage_min_growth_bytes={self.usage_min_growth_bytes} must be > 0"
            )
        if self.near_ready_poll_s <= 0:
            raise ValueError(f"near_ready_poll_s={self.near_ready_poll_s} must be > 0")


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
_OOM_KILLER = 'the kernel OOM killer (`journalctl -k | grep -i "out of memory"` on that node)'


def _exit_hint(code: int | None, oom: bool = False, head: bool = False) -> str:
    """What a rank's exit code points to. vLLM exits 0 on SIGTERM (a headless worker stopped by docker stop or the
    watchdog) and the head exits 0 after a rank of its group died; 137 is SIGKILL (a worker killed while it loads
    weights, ignoring SIGTERM, ends so too)."""
    if oom:
        return (
            "the kernel OOM killer killed it (docker reported oom): the node ran out of memory; see "
            f"{_WATCHDOG_LOG} on that node for what held it"
        )
    candidates = (
        f"candidates: the memory watchdog (see {_WATCHDOG_LOG} on that node: it stops every rank), "
        f"{_OOM_KILLER}, or a docker stop by an operator"
    )
    if code == 137:
        return f"exit 137 = killed by SIGKILL (a docker stop that timed out, or a kill); {candidates}"
    if code == 0:
        if head:
            return (
                "vLLM's head exits 0 seconds after a rank of its group died: its engine lost the worker "
                "(`WorkerProc hit an exception`, `Connection closed by peer` in its last lines); every rank's "
                f"last lines are below; it also exits 0 when stopped (SIGTERM); {candidates}"
            )
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

    def __init__(
        self,
        ranks: Sequence[RankSpec],
        source: RankSource,
        settings: WatchSettings,
        clock: Clock,
        report: Reporter,
        min_growth_bytes: float = USAGE_MIN_GROWTH_BYTES,
    ) -> None:
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
        self.views = {
            r.rank: _RankView(spec=r, tail=deque(maxlen=settings.tail_lines), last_activity=start)
            for r in sorted(ranks, key=lambda r: r.rank)
        }
        # HEAD:PORT of the rendezvous, from the first line that names it (for the advice).
        self.master: str | None = None

    def head(self) -> _RankView:
        return self.views[min(self.views)]

    def _source_failed(self, view: _RankView, error: str) -> None:
        view.source_errors += 1
        view.last_error = error
        if view.source_errors >= self.settings.max_source_errors:
            raise GateFailure(
                self.message(
                    f"cannot observe {view.spec.label()} on {view.spec.user}@{view.spec.host}:{view.spec.port}: "
                    f"{view.source_errors} failures in a row, last: "
                    f"{redact(view.last_error, self.settings.secrets, key_shapes=True)}",
                    "check that the node is up and reachable over SSH with the configured key, and that "
                    "the docker CLI works there for that user",
                )
            )

    def _line(self, view: _RankView, line: LogLine) -> None:
        view.tail.append(line.text)
        self.master = self.master or init_method_address(line.text)
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
            raise GateFailure(
                self.message(
                    f"{view.spec.label()}: the container does not exist",
                    "something removed it; run `pulumi up` again to recreate it",
                )
            )
        if not state.running:
            view.oom = view.oom or state.oom_killed
            return True
        view.log_ended = False  # running (a new session's read): an end seen before was that session's
        if view.first_state.started_at and state.started_at and state.started_at != view.first_state.started_at:
            raise GateFailure(
                self.message(
                    f"{view.spec.label()} restarted (started at {view.first_state.started_at}, now {state.started_at})",
                    "a restart policy brought it back after a crash; the last lines show the crash",
                )
            )
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
            return not all(v.log_ended for v in views) or (
                len(self.views) > 1 and list(stopped) == [head] and stopped[head].exit_code == 0
            )

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
        also = [
            f"{self.views[r].spec.label()} is {s.status} with exit code {s.exit_code}"
            for r, s in stopped.items()
            if r != rank
        ]
        if also:
            cause += f" (and {', '.join(also)})"
        hint = _exit_hint(state.exit_code, view.oom or state.oom_killed, head=rank == head)
        # What it printed before it went names the cause better than its exit code (any rank's, its own first).
        found = self._last_fatal(view)
        if found is not None and not (view.oom or state.oom_killed):
            printed_by, fatal, text = found
            cause += (
                f"; before it, {printed_by.spec.label()} {fatal.cause}: "
                f"{redact(text.strip(), self.settings.secrets, key_shapes=True)}"
            )
            hint = self._fatal_advice(fatal, printed_by)
        raise GateFailure(self.message(cause, hint))

    def fail_on_fatal(self, view: _RankView, line: LogLine) -> None:
        """A line of FATAL_PATTERNS that fails at once: fail naming it, the rank and the operator's fix."""
        fatal = fatal_of(line.text)
        if fatal is None or not fatal.at_once:
            return
        raise GateFailure(
            self.message(
                f"{view.spec.label()} {fatal.cause}: "
                f"{redact(line.text.strip(), self.settings.secrets, key_shapes=True)}",
                self._fatal_advice(fatal, view),
            )
        )

    def _fatal_advice(self, fatal: FatalPattern, view: _RankView) -> str:
        # A rendezvous failure is about the ranks not in the group; the others about the rank that printed them.
        if fatal.name == "rendezvous":
            nodes = [v.spec for v in self.views.values() if not v.joined and v is not view] or [
                v.spec for v in self.views.values() if v is not view
            ]
        else:
            nodes = [view.spec]
        return _advice(fatal.advice, nodes, self.master)

    def _last_fatal(self, first: _RankView) -> tuple[_RankView, FatalPattern, str] | None:
        """The fatal line in the ranks' tails whose entry comes first in FATAL_PATTERNS (the most specific cause),
        `first`'s before another rank's, the latest of a rank's."""
        found: list[tuple[int, bool, _RankView, FatalPattern, str]] = []
        for view in self.views.values():
            for text in reversed(view.tail):
                fatal = fatal_of(text)
                if fatal is not None:
                    found.append((FATAL_PATTERNS.index(fatal), view is not first, view, fatal, text))
        if not found:
            return None
        _, _, view, fatal, text = min(found, key=lambda f: (f[0], f[1]))
        return view, fatal, text

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
                parts.append(f"rank {view.spec.rank} {view.usage.describe()}")
            elif view.usage_error:
                parts.append(
                    f"rank {view.spec.rank} unreadable "
                    f"({redact(view.usage_error, self.settings.secrets, key_shapes=True)})"
                )
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


def wait_for_rendezvous(
    ranks: Sequence[RankSpec], source: RankSource, settings: RendezvousSettings, clock: Clock, report: Reporter
) -> RendezvousResult:
    """Block until every rank's container logged that it joined the distributed group. Closes `source`."""
    try:
        return _rendezvous(ranks, source, settings, clock, report)
    finally:
        source.close()


def _rendezvous(
    ranks: Sequence[RankSpec], source: RankSource, settings: RendezvousSettings, clock: Clock, report: Reporter
) -> RendezvousResult:
    cluster = _Cluster(ranks, source, settings, clock, report)
    start = clock.monotonic()
    deadline = start + settings.bounds.rendezvous_timeout_s
    last_report = start
    world_size: int | None = None
    joined_at: dict[int, str] = {}
    while True:
        for view, line in cluster.step(
            min(deadline, last_report + settings.progress_interval_s), settings.poll_interval_s
        ):
            cluster.fail_on_fatal(view, line)
            if is_reached_line(line.text):
                view.reached = True
            if is_join_line(line.text):
                view.joined = True
                joined_at.setdefault(view.spec.rank, line.at or _iso(clock.now()))
                assigned = assigned_rank(line.text)
                if assigned:
                    world_size = assigned[1]
        missing = [v for v in cluster.views.values() if not v.joined]
        now = clock.monotonic()
        if not missing:
            return RendezvousResult(
                elapsed_s=round(now - start, 3), passed_at=_iso(clock.now()), world_size=world_size, joined_at=joined_at
            )
        if now >= deadline:
            named = ", ".join(
                f"{v.spec.label()} ({'reached init_process_group but never joined' if v.reached else 'never reached the rendezvous: check its log below'})"  # noqa: E501
                for v in missing
            )
            raise GateFailure(
                cluster.message(
                    f"rendezvous did not complete within {settings.bounds.rendezvous_timeout_s:g} s: {named}",
                    _rendezvous_advice([v.spec for v in missing], cluster.master),
                )
            )
        if now - last_report >= settings.progress_interval_s:
            last_report = now
            report(
                f"rendezvous: waiting for {', '.join(f'rank {v.spec.rank}' for v in missing)} "
                f"to join, elapsed {_fmt_duration(now - start)}"
            )


def _rendezvous_advice(missing: Sequence[RankSpec], master: str | None) -> str:
    return _advice(RENDEZVOUS_ADVICE, missing, master)


def _advice(template: str, nodes: Sequence[RankSpec], master: str | None) -> str:
    where = f"master {master}" if master else "the master address/port (--master-addr/--master-port)"
    return template.format(nodes=", ".join(dict.fromkeys(r.node for r in nodes)) or "the workers", where=where)


# ---------------------------------------------------------------------------------------------
# Gate 2: ready


@dataclass(frozen=True)
class ModelsProbeResult:
    outcome: Literal["listed", "not_listed", "unauthorized", "unreachable"]
    detail: str = ""
    ids: tuple[str, ...] = ()


ModelsProbe = Callable[[], ModelsProbeResult]


def wait_for_ready(
    ranks: Sequence[RankSpec],
    source: RankSource,
    settings: ReadySettings,
    clock: Clock,
    report: Reporter,
    probe: ModelsProbe,
    model_name: str,
) -> ReadyResult:
    """Block until the head logged startup complete and /v1/models lists `model_name`. Closes `source`."""
    try:
        return _ready(ranks, source, settings, clock, report, probe, model_name)
    finally:
        source.close()


def _ready(
    ranks: Sequence[RankSpec],
    source: RankSource,
    settings: ReadySettings,
    clock: Clock,
    report: Reporter,
    probe: ModelsProbe,
    model_name: str,
) -> ReadyResult:
    cluster = _Cluster(ranks, source, settings, clock, report, settings.usage_min_growth_bytes)
    start = clock.monotonic()
    deadline = start + settings.bounds.ready_timeout_s
    last_report = start
    phases: dict[str, str] = {}
    phase = "rendezvous"
    phase_since = start
    head_ready = False
    next_probe = start
    last_probe = ModelsProbeResult("unreachable", "not probed yet")
    head = cluster.head()
    # The containers' counters are sampled only while every rank is silent: a chatty boot costs nothing.
    usage_quiet = min(settings.usage_quiet_s, settings.bounds.stall_s / 2)
    usage_every = min(settings.usage_interval_s, settings.bounds.stall_s / 4)
    last_usage = -math.inf
    while True:
        pace = settings.poll_interval_s
        if phase in NEAR_READY_PHASES:
            pace = min(pace, settings.near_ready_poll_s)
        wake = min(
            deadline, last_report + settings.progress_interval_s, cluster.progress_at() + settings.bounds.stall_s
        )
        if head_ready:
            wake = min(wake, next_probe)
        else:
            wake = min(wake, max(cluster.last_activity() + usage_quiet, last_usage + usage_every))
        for view, line in cluster.step(wake, pace):
            cluster.fail_on_fatal(view, line)
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
                return ReadyResult(
                    elapsed_s=round(clock.monotonic() - start, 3), passed_at=_iso(clock.now()), phases=phases
                )
            if last_probe.outcome == "not_listed":
                raise GateFailure(
                    cluster.message(
                        f"the server is up but /v1/models lists {list(last_probe.ids)}, not {model_name!r}",
                        "make the served model name (--served-model-name) and the gate's model name agree",
                    )
                )
            if last_probe.outcome == "unauthorized":
                raise GateFailure(
                    cluster.message(
                        f"/v1/models refused the API key: {last_probe.detail}",
                        "give the gate the same API key the server was started with (--api-key / VLLM_API_KEY)",
                    )
                )
        quiet = cluster.quiet_for()
        if now - cluster.progress_at() >= settings.bounds.stall_s:
            raise GateFailure(
                cluster.message(
                    _stall_cause(cluster, quiet, settings.bounds.stall_s, phase),
                    "a rank is probably hung (NCCL, a deadlocked kernel); dump stacks with `py-spy dump` in the "
                    "containers, then restart; if this boot is legitimately silent for longer with its containers' "
                    "counters standing still (JIT), raise stall_s",
                )
            )
        if not head_ready and now >= max(cluster.last_activity() + usage_quiet, last_usage + usage_every):
            last_usage = now
            source.request_usage()
        if now >= deadline:
            extra = (
                f"; the head logged startup complete but /v1/models was never answered: {last_probe.detail}"
                if head_ready
                else ""
            )
            raise GateFailure(
                cluster.message(
                    f"not ready within {settings.bounds.ready_timeout_s:g} s, last phase {phase!r}{extra}",
                    "if the ranks are still making progress (see below), raise ready_timeout_s; if the API is "
                    "up but unreachable, check the api base URL and the firewall on the serve port",
                )
            )
        if now - last_report >= settings.progress_interval_s:
            last_report = now
            growing = ""
            if cluster.usage_progress_at is not None and cluster.usage_progress_at > cluster.last_activity():
                growing = (
                    f"; silent but progressing: {cluster.usage_growth} "
                    f"{_fmt_duration(now - cluster.usage_progress_at)} ago"
                )
            report(
                f"ready gate: phase {phase!r} for {_fmt_duration(now - phase_since)}, elapsed "
                f"{_fmt_duration(now - start)}, last log line {_fmt_duration(quiet)} ago{growing}"
            )


def _stall_cause(cluster: _Cluster, quiet: float, stall_s: float, phase: str) -> str:
    """No line and no counter growth for stall_s: what was last seen of both."""
    cause = f"no rank logged anything new for {_fmt_duration(quiet)}"
    summary = cluster.usage_summary()
    sampled = any(v.usage is not None for v in cluster.views.values())
    nodes = any(
        v.usage is not None and v.usage.node is not None and v.usage.node.text() for v in cluster.views.values()
    )
    # what was watched: the containers' counters, and the nodes' own where their streams read them
    watched = "no rank container's memory or block I/O grew" + (
        " and no node's NFS reads, fabric rx or MemAvailable moved" if nodes else ""
    )
    if cluster.usage_progress_at is not None and cluster.usage_progress_at > cluster.last_activity():
        cause += (
            f" and {watched} for "
            f"{_fmt_duration(cluster.clock.monotonic() - cluster.usage_progress_at)} "
            f"(last: {cluster.usage_growth})"
        )
    elif sampled:
        cause += f" and {watched} meanwhile"
    cause += f" (stall limit {stall_s:g} s) in phase {phase!r}"
    if summary:
        cause += f"; docker stats: {summary}"
    return cause


class ModelsEndpoint:
    """GET {api_base}/v1/models within `timeout_s` (connect and read); the API key goes in a header, never a
    message."""

    def __init__(
        self, api_base: str, model_name: str, api_key: str | None = None, timeout_s: float = MODELS_PROBE_TIMEOUT_S
    ) -> None:
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
