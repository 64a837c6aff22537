"""A restart's boot, decided by the gates' own rules: the supervisor waits as `pulumi up` does.

After it started the ranks, the leader follows every rank's log from its start through the node's agent
(`GET /rank/logs?since=<unix>`, which reads the node's docker) and runs the gates' decisions on it
(components/gates/decisions.py, pure and stdlib plus `requests`, so they run in the serving image): first the
rendezvous gate (every rank logged that it joined the group, within `gates.rendezvousTimeoutSeconds`), then the
ready gate (the head logged "Application startup complete" and /v1/models lists the model, within
`gates.readyTimeoutSeconds`, with the stall rule of `gates.stallSeconds`). Either fails at once on a fatal line
(a rendezvous failure, too little memory for the KV cache, ...) or on a rank that exits, naming the rank, its
node and the line, as the gates fail an update. `/health` decides nothing: real vLLM answers 200 from a head
whose worker is gone.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.client import HTTPException
from typing import Any

from components.gates.decisions import (
    NEAR_READY_POLL_S,
    GateBounds,
    ModelsProbe,
    ReadySettings,
    RendezvousSettings,
    wait_for_ready,
    wait_for_rendezvous,
)
from components.gates.observations import (
    ContainerState,
    ContainerUsage,
    LogCursor,
    LogLine,
    PollingRankSource,
    RankSpec,
    Reporter,
    SourceError,
    SystemClock,
    timestamp_key,
)

Fetch = Callable[[int, str], Mapping[str, Any]]
"""(rank, path with query) -> the JSON answer of that rank's agent (`/rank`, `/rank/logs?since=`, `/rank/usage`)."""

# A node's agent that fails this many looks in a row ends the boot (at one look a second: its own restart).
MAX_AGENT_ERRORS = 5
PROGRESS_INTERVAL_S = 30.0
_UNIX_SINCE = re.compile(r"^\d{1,12}(?:\.\d{1,9})?$")


def unix_since(stamp: str) -> str:
    """docker's RFC 3339 stamp as the Engine API's `since` (`seconds.nanoseconds`, what the CLI sends)."""
    seconds, nanos = timestamp_key(stamp)
    return f"{max(seconds, 0)}.{nanos:09d}"


def valid_since(value: str) -> str:
    """A `since` query value the agent passes to docker: `seconds[.fraction]` only."""
    if not _UNIX_SINCE.match(value):
        raise ValueError(f"since={value[:40]!r}: expected unix seconds with an optional fraction (1700000000.5)")
    return value


def container_state(data: Mapping[str, Any]) -> ContainerState:
    """An agent's `/rank` answer as the gates' ContainerState."""
    if not data.get("exists"):
        return ContainerState(status="missing")
    code = data.get("exit_code")
    return ContainerState(
        status=str(data.get("status") or ("running" if data.get("running") else "exited")),
        exit_code=int(code) if code is not None else None,
        started_at=str(data.get("started_at") or ""),
        oom_killed=bool(data.get("oom_killed")),
    )


def container_usage(data: Mapping[str, Any]) -> ContainerUsage:
    """An agent's `/rank/usage` answer as the gates' ContainerUsage."""

    def number(key: str) -> float | None:
        value = data.get(key)
        return float(value) if isinstance(value, int | float) else None

    return ContainerUsage(
        number("memory_bytes"), number("block_read_bytes"), number("block_written_bytes"), str(data.get("text") or "")
    )


class AgentRanks:
    """The gates' RankPoller over the nodes' agents: a rank's state, its new log lines (from its container's
    start on the first read, then from the newest line taken), its container's counters."""

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.cursors: dict[int, LogCursor] = {}

    def _get(self, rank: int, path: str) -> Mapping[str, Any]:
        try:
            return self.fetch(rank, path)
        except (OSError, HTTPException, ValueError) as error:
            raise SourceError(f"GET {path.split('?')[0]}: {error}") from None

    def state(self, rank: int) -> ContainerState:
        return container_state(self._get(rank, "/rank"))

    def new_lines(self, rank: int) -> list[LogLine]:
        cursor = self.cursors.get(rank)
        if cursor is None:
            started = self.state(rank).started_at
            if not started:
                raise SourceError("the rank's container has no start time yet")
            cursor = self.cursors[rank] = LogCursor(started)
        data = self._get(rank, f"/rank/logs?since={urllib.parse.quote(unix_since(cursor.since))}")
        lines = [
            LogLine(text=str(item.get("text", "")), at=str(item["at"]) if item.get("at") else None)
            for item in data.get("lines") or []
            if isinstance(item, Mapping)
        ]
        return cursor.take(lines)

    def usage(self, rank: int) -> ContainerUsage:
        return container_usage(self._get(rank, "/rank/usage"))


class Interrupted(Exception):
    """The operator paused the supervisor or an update took the lock during the boot: the ranks are theirs."""


class HeldClock(SystemClock):
    """The real clock, whose waits end early (Interrupted) once `held()` names who took the ranks over."""

    def __init__(self, held: Callable[[], str | None], slice_s: float = 1.0) -> None:
        self.held = held
        self.slice_s = slice_s

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            who = self.held()
            if who:
                raise Interrupted(who)
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, self.slice_s))


@dataclass(frozen=True, kw_only=True)
class BootSettings:
    """The gates' bounds (`gates.*`) and how often the agents are read."""

    bounds: GateBounds
    poll_s: float
    secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class Booted:
    rendezvous_s: float
    ready_s: float


def wait_for_boot(
    ranks: Sequence[RankSpec],
    fetch: Fetch,
    settings: BootSettings,
    *,
    probe: ModelsProbe,
    model: str,
    clock: SystemClock,
    report: Reporter,
) -> Booted:
    """The rendezvous gate, then the ready gate, over the agents. Raises the gates' GateFailure (the cause first,
    every rank's last lines after it) or Interrupted (from `clock`)."""
    numbers = [r.rank for r in ranks]
    rendezvous = wait_for_rendezvous(
        ranks,
        PollingRankSource(AgentRanks(fetch), numbers, clock),
        RendezvousSettings(
            bounds=settings.bounds,
            poll_interval_s=settings.poll_s,
            progress_interval_s=PROGRESS_INTERVAL_S,
            max_source_errors=MAX_AGENT_ERRORS,
            secrets=settings.secrets,
        ),
        clock,
        report,
    )
    # The ready gate reads every log from its start again, as its own stream does in an update.
    ready = wait_for_ready(
        ranks,
        PollingRankSource(AgentRanks(fetch), numbers, clock),
        ReadySettings(
            bounds=settings.bounds,
            poll_interval_s=settings.poll_s,
            near_ready_poll_s=min(settings.poll_s, NEAR_READY_POLL_S),
            progress_interval_s=PROGRESS_INTERVAL_S,
            max_source_errors=MAX_AGENT_ERRORS,
            secrets=settings.secrets,
        ),
        clock,
        report,
        probe,
        model,
    )
    return Booted(rendezvous.elapsed_s, ready.elapsed_s)


def cause_of(message: str) -> str:
    """A gate's verdict without the ranks' tails: its first line (the cause, then what to do)."""
    return message.strip().splitlines()[0] if message.strip() else "the boot failed"


# --- the node's side: docker's answers made into the agent's ------------------------------------------------


def demultiplex(raw: bytes, tty: bool) -> str:
    """The Engine API's log body as text. Without a TTY docker frames it (`[stream, 0, 0, 0, size (u32 BE)]`, then
    `size` bytes of stdout or stderr); a frame cut by a size bound is dropped (the next read starts before it)."""
    if tty:
        return raw.decode("utf-8", "replace")
    out = bytearray()
    i = 0
    while i + 8 <= len(raw):
        kind, pad = raw[i], raw[i + 1 : i + 4]
        if kind not in (0, 1, 2) or pad != b"\0\0\0":
            raise ValueError(f"docker's log stream is not multiplexed at byte {i}: {raw[i : i + 8]!r}")
        size = int.from_bytes(raw[i + 4 : i + 8], "big")
        if i + 8 + size > len(raw):
            break
        out += raw[i + 8 : i + 8 + size]
        i += 8 + size
    return out.decode("utf-8", "replace")


def usage_of_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    """`GET /containers/{id}/stats?stream=false` as the agent's `/rank/usage`: memory as the docker CLI shows it
    (usage less the inactive page cache) and cumulative block I/O, as `docker stats` gives the gates."""
    memory = stats.get("memory_stats") or {}
    detail = memory.get("stats") or {}
    used = memory.get("usage")
    mem: float | None = None
    if isinstance(used, int | float):
        inactive = detail.get("inactive_file", detail.get("total_inactive_file", 0))
        mem = float(used) - float(inactive if isinstance(inactive, int | float) else 0)
    read: float | None = None
    written: float | None = None
    entries = (stats.get("blkio_stats") or {}).get("io_service_bytes_recursive")
    if isinstance(entries, list):
        read = float(sum(e.get("value", 0) for e in entries if str(e.get("op", "")).lower() == "read"))
        written = float(sum(e.get("value", 0) for e in entries if str(e.get("op", "")).lower() == "write"))
    return {
        "memory_bytes": mem,
        "block_read_bytes": read,
        "block_written_bytes": written,
        "text": f"memory {_size(mem)}, block I/O {_size(read)} / {_size(written)}",
    }


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}B"
