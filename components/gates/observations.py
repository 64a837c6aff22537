"""What a serving rank is and what the gates can observe about it: log lines, container states, docker
events, usage counters, and the RankSource a gate reads them from. Pure data and protocols; no ssh here."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from components.contract import Contract

# ---------------------------------------------------------------------------------------------
# What a rank is and what we can observe about it


_CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")


@dataclass(frozen=True, kw_only=True)
class RankSpec(Contract):
    """One serving container: rank 0 is the head (API server), the others are headless workers."""

    rank: int
    node: str
    host: str
    port: int = 22
    user: str
    container: str
    fabric_interface: str = ""
    """The node's fabric interface, whose receive bytes count as a loading rank's progress (empty: not read)."""
    nfs_server: str = ""
    """The NFS server the node reads the weights from (the head's fabric IP under `share: nfs`; empty: none)."""

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


# MemAvailable falling by this much between two samples is progress: a GB10 rank loading its ~100 GiB into
# unified memory (the CUDA driver's allocations, not charged to the container) drops it by gigabytes per sample
# (196 GiB over NFS in ~15 min: ~6.5 GiB per 30 s); a quiet node's own churn stays far below it.
NODE_MEM_MIN_FALL_BYTES = float(1 << 30)


@dataclass(frozen=True)
class NodeCounters:
    """One sample of the node's own counters, read without root by the node's stream script (`N` record): the
    ones that move while a GB10 rank loads and its container's counters stand still (docs/hardware.md)."""

    mem_available_bytes: float | None = None
    """MemAvailable (/proc/meminfo): falls as the CUDA driver places the weights in unified memory."""
    nfs_read_bytes: float | None = None
    """Bytes read from the weights' NFS server (/proc/self/mountstats, `bytes:` serverreadbytes, summed)."""
    fabric_rx_bytes: float | None = None
    """The fabric interface's receive bytes (/sys/class/net/<if>/statistics/rx_bytes; not read on loopback)."""

    def text(self) -> str:
        parts = []
        if self.mem_available_bytes is not None:
            parts.append(f"MemAvailable {_fmt_bytes(self.mem_available_bytes)}")
        if self.nfs_read_bytes is not None:
            parts.append(f"NFS read {_fmt_bytes(self.nfs_read_bytes)}")
        if self.fabric_rx_bytes is not None:
            parts.append(f"fabric rx {_fmt_bytes(self.fabric_rx_bytes)}")
        return ", ".join(parts)


def parse_node_counters(rest: str) -> NodeCounters:
    """A stream's `N <MemAvailable bytes> <NFS read bytes> <fabric rx bytes>` record (`-`: not readable)."""
    words = (rest.split() + ["-", "-", "-"])[:3]

    def num(word: str) -> float | None:
        try:
            value = float(word)
        except ValueError:
            return None
        return value if value >= 0 and value == value else None

    return NodeCounters(num(words[0]), num(words[1]), num(words[2]))


@dataclass(frozen=True)
class ContainerUsage:
    """One `docker stats --no-stream` sample of a rank's container: memory in use (what the cgroup is charged:
    the page cache of the shards read) and cumulative block I/O; with the node's own counters when its stream
    read them. On GB10 the container's counters can stand still for a whole load (the weights go to unified
    memory, NFS reads are not block I/O): the node's counters are what moves then."""

    memory_bytes: float | None
    block_read_bytes: float | None
    block_written_bytes: float | None
    text: str = ""
    """As docker wrote it, for messages: `memory 95.1GiB, block I/O 190GB / 1.2MB`."""
    node: NodeCounters | None = None

    def describe(self) -> str:
        node = self.node.text() if self.node is not None else ""
        return f"{self.text}; node {node}" if node else self.text

    def grown_from(
        self, base: ContainerUsage, min_bytes: float, mem_fall_bytes: float = NODE_MEM_MIN_FALL_BYTES
    ) -> str | None:
        """What moved since `base`: memory, block I/O, NFS reads or fabric bytes grown by at least `min_bytes`,
        or the node's MemAvailable fallen by at least `mem_fall_bytes`; None when nothing did."""
        grew: list[str] = []
        now_node, then_node = self.node or NodeCounters(), base.node or NodeCounters()
        for what, now, then in (
            ("memory", self.memory_bytes, base.memory_bytes),
            (
                "block I/O",
                _sum(self.block_read_bytes, self.block_written_bytes),
                _sum(base.block_read_bytes, base.block_written_bytes),
            ),
            ("NFS read", now_node.nfs_read_bytes, then_node.nfs_read_bytes),
            ("fabric rx", now_node.fabric_rx_bytes, then_node.fabric_rx_bytes),
        ):
            if now is not None and then is not None and now - then >= min_bytes:
                grew.append(f"{what} +{_fmt_bytes(now - then)}")
        now_mem, then_mem = now_node.mem_available_bytes, then_node.mem_available_bytes
        if now_mem is not None and then_mem is not None and then_mem - now_mem >= mem_fall_bytes:
            grew.append(f"MemAvailable -{_fmt_bytes(then_mem - now_mem)}")
        return ", ".join(grew) or None

    def floor(self, other: ContainerUsage) -> ContainerUsage:
        """A baseline that gives nothing back twice: memory given back (page cache reclaimed) is not progress to
        regain, and MemAvailable that came back (a cache dropped) is not progress to lose again."""
        low = (
            min(self.memory_bytes, other.memory_bytes)
            if self.memory_bytes is not None and other.memory_bytes is not None
            else other.memory_bytes
        )
        node = self.node
        if node is not None and other.node is not None:
            mine, theirs = node.mem_available_bytes, other.node.mem_available_bytes
            high = max(mine, theirs) if mine is not None and theirs is not None else theirs
            node = NodeCounters(high, node.nfs_read_bytes, node.fabric_rx_bytes)
        elif other.node is not None:
            node = other.node
        return ContainerUsage(low, self.block_read_bytes, self.block_written_bytes, self.text, node)


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


def second_before(stamp: str) -> str:
    """docker's RFC 3339 stamp one second earlier (UTC, whole seconds)."""
    seconds, _ = timestamp_key(stamp)
    return datetime.fromtimestamp(seconds - 1, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
