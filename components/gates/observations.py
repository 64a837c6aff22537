"""What a serving rank is and what the gates can observe about it: log lines, container states, docker
events, usage counters, and the RankSource a gate reads them from. Pure data and protocols; no ssh here."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

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
            raise ValueError(
                f"gate container name {self.container!r} on node {self.node!r} is not a valid docker "
                "container name ([a-zA-Z0-9][a-zA-Z0-9_.-]*)"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"gate ssh port {self.port} for node {self.node!r} is out of range 1..65535")

    def label(self) -> str:
        return f"rank {self.rank} (node {self.node}, container {self.container})"

    def to_prop(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node": self.node,
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "container": self.container,
        }

    @classmethod
    def from_prop(cls, r: Mapping[str, Any]) -> RankSpec:
        return cls(
            rank=int(r["rank"]),
            node=str(r["node"]),
            host=str(r["host"]),
            port=int(r.get("port", 22)),
            user=str(r["user"]),
            container=str(r["container"]),
        )


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
        for what, now, then in (
            ("memory", self.memory_bytes, base.memory_bytes),
            (
                "block I/O",
                _sum(self.block_read_bytes, self.block_written_bytes),
                _sum(base.block_read_bytes, base.block_written_bytes),
            ),
        ):
            if now is not None and then is not None and now - then >= min_bytes:
                grew.append(f"{what} +{_fmt_bytes(now - then)}")
        return ", ".join(grew) or None

    def floor(self, other: ContainerUsage) -> ContainerUsage:
        """A baseline that only goes down: memory given back (page cache reclaimed) is not progress to regain."""
        low = (
            min(self.memory_bytes, other.memory_bytes)
            if self.memory_bytes is not None and other.memory_bytes is not None
            else other.memory_bytes
        )
        return ContainerUsage(low, self.block_read_bytes, self.block_written_bytes, self.text)


def _sum(*values: float | None) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}B"


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKMGTPE]?i?B)\s*$")
_UNITS = {
    "B": 1.0,
    **{p + "B": 1000.0 ** (i + 1) for i, p in enumerate("kMGTPE")},
    "KB": 1000.0,
    **{p + "iB": 1024.0 ** (i + 1) for i, p in enumerate("KMGTPE")},
}


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


# ---------------------------------------------------------------------------------------------
# docker's log lines, as any source reads them (`docker logs --timestamps`, the Engine API's logs)

_DOCKER_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) ?(.*)$")


def timestamp_key(stamp: str) -> tuple[int, int]:
    """Sortable (unix seconds, nanoseconds) for docker's RFC 3339 stamps, whose fraction length varies."""
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", stamp)
    if not m:
        raise SourceError(f"unexpected docker timestamp {stamp[:60]!r}")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    seconds = int(datetime.fromisoformat(m.group(1) + zone).timestamp())
    nanos = int((m.group(2) or "0")[:9].ljust(9, "0"))
    return seconds, nanos


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


@dataclass
class LogCursor:
    """Where a rank's log is read from next: `since`, docker's stamp of the newest line taken (docker's since is
    inclusive), and the texts already taken at that instant, so a read from `since` yields each line once."""

    since: str
    seen: set[str] = field(default_factory=set)

    def take(self, lines: Sequence[LogLine]) -> list[LogLine]:
        """The lines of a read from `since` not taken before; moves the cursor past them."""
        since_key = timestamp_key(self.since)
        fresh: list[LogLine] = []
        newest, newest_key = self.since, since_key
        for line in lines:
            key = timestamp_key(line.at) if line.at else None
            if key is not None and key == since_key and line.text in self.seen:
                continue  # taken by the previous read
            fresh.append(line)
            if key is not None and key > newest_key:
                newest, newest_key = line.at or newest, key
        # stdout and stderr arrive interleaved, so the newest instant is computed, not assumed last
        at_newest = {ln.text for ln in fresh if ln.at and timestamp_key(ln.at) == newest_key}
        self.seen = at_newest | (self.seen if newest == self.since else set())
        self.since = newest
        return fresh


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
