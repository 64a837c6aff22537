"""The streaming source: one ssh session per node running rank_stream.sh (container events and log streams),
reconnected and resumed, with a reader thread per node."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from components import scripts
from components.gates.decisions import WATCH_POLL_INTERVAL_S
from components.gates.observations import (
    ContainerState,
    ContainerUsage,
    EventSeen,
    LineSeen,
    LogEnded,
    LogLine,
    NodeCounters,
    Notice,
    Observation,
    RankSpec,
    SourceError,
    StateSeen,
    Unobservable,
    UsageSeen,
    parse_docker_logs,
    parse_node_counters,
    parse_stats,
    poll_once,
    timestamp_key,
    usage_once,
)
from components.gates.poll_source import (
    Runner,
    SshRankSource,
    parse_inspect,
    run_command,
)
from components.ssh import SSH_DEFAULTS, SshAccess, SshTarget, ssh_argv

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


def stream_script(watch: str, node: RankSpec | None = None) -> str:
    """The node's stream script: WATCH is `<container>=<since> ...`; `node` gives the node's counters' sources
    (its fabric interface, the weights' NFS server), None reads none of them."""
    return scripts.render(
        STREAM_SCRIPT,
        {
            "WATCH": watch,
            "MAX_LINE": STREAM_MAX_LINE,
            "FABRIC_IF": node.fabric_interface if node else "",
            "NFS_SERVER": node.nfs_server if node else "",
        },
    )


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
        return StateSeen(
            rank, ContainerState("exited", int(code) if code.lstrip("-").isdigit() else None, ""), "die event"
        )
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
                self.owner.put(
                    Notice(
                        f"rank watch: the stream from node {self.node} ({self._where()}) ended "
                        f"({detail}); reconnecting, each log resumes after its last line"
                    )
                )
                self.owner.wait(STREAM_RECONNECT_S)
                continue
            failures += 1
            if kind == "dropped":
                self.owner.put(
                    Notice(
                        f"rank watch: the stream from node {self.node} ({self._where()}) ended "
                        f"soon after it started ({detail}); reconnecting, each log resumes after its "
                        "last line"
                    )
                )
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
        text = stream_script(watch, self.specs[0])  # every rank of a session is on one node
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
        return "no-start", (
            f"the stream script on node {self.node} exited {rc} before streaming" + (f": {last}" if last else "")
        )

    def _read(self, proc: subprocess.Popen[bytes]) -> tuple[bool, str, str | None]:
        """Records until the session ends: (streamed, why it was ended here, fallback reason)."""
        assert proc.stdout is not None
        ready = False
        ended: set[str] = set()
        node_counters: NodeCounters | None = None
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
            elif tag == "N":
                # the node's counters, printed just before the sample's container lines, which carry them
                node_counters = parse_node_counters(rest)
            elif tag == "U":
                stats = parse_stats(rest)
                rank = self.ranks.get(stats[0]) if stats is not None else None
                if stats is not None and rank is not None:
                    self.owner.put(UsageSeen(rank, dataclasses.replace(stats[1], node=node_counters)))
            elif tag == "u":
                for spec in self.specs:
                    error = f"docker stats on node {self.node}: {rest}"
                    if node_counters is not None and node_counters.text():
                        # the node's own counters still say whether a silent load moves
                        usage = ContainerUsage(None, None, None, "container counters unreadable", node_counters)
                        self.owner.put(UsageSeen(spec.rank, usage, error))
                    else:
                        self.owner.put(UsageSeen(spec.rank, None, error))
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
        self.owner.put(
            Notice(
                f"rank watch: {why}; polling node {self.node} instead (docker inspect and docker "
                f"logs over ssh, every {self.owner.pace:g} s, faster near ready)"
            )
        )
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
    ControlMaster) running components/gates/rank_stream.sh; see docs/checks.md, how the gates watch the ranks.

    Nothing starts until the first `next_items`; `close` ends every session."""

    def __init__(
        self,
        ranks: Sequence[RankSpec],
        ssh: SshAccess = SSH_DEFAULTS,
        *,
        popen: Popen = subprocess.Popen,
        runner: Runner = run_command,
    ) -> None:
        self._ssh = ssh
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
            _NodeStream(
                self,
                ssh.target(host, port, user),
                specs,
            )
            for (user, host, port), specs in nodes.items()
        ]
        self._started = False

    def __repr__(self) -> str:
        return f"StreamRankSource(nodes={[s.node for s in self.streams]})"

    def poller(self, specs: Sequence[RankSpec]) -> SshRankSource:
        return SshRankSource(specs, self._ssh, runner=self._runner)

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
