"""The polling source: `docker inspect`, `docker logs` and `docker stats` over ssh, one command per poll. The
stream source falls back to it for a node that cannot stream."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from components.gates.observations import ContainerState, ContainerUsage, LogLine, RankSpec, SourceError, parse_stats
from components.ssh import SshTarget, ssh_argv

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
    return ContainerState(
        status=fields[0],
        exit_code=int(fields[1]),
        started_at=fields[2],
        oom_killed=len(fields) == 4 and fields[3] == "true",
    )


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


def run_command(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    # bytes, decoded by hand: text mode would turn tqdm's \r redraws into separate lines
    done = subprocess.run(argv, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    return subprocess.CompletedProcess(
        argv, done.returncode, done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")
    )


class SshRankSource:
    """Reads each rank's container with `docker inspect` / `docker logs` through ssh.

    The first `new_lines` reads from the container's StartedAt, so a re-run gate over a server
    that is already up sees its whole boot and passes at once. Later calls use the last
    timestamp seen; docker's --since is inclusive, so lines at exactly that instant are deduplicated.
    """

    def __init__(
        self,
        ranks: Sequence[RankSpec],
        *,
        private_key: str | None = None,
        agent_socket: str | None = None,
        known_hosts_file: str | None = None,
        remote_timeout_s: int = 10,
        runner: Runner = run_command,
    ) -> None:
        self._specs: Mapping[int, RankSpec] = {r.rank: r for r in ranks}
        self._targets = {
            r.rank: SshTarget(
                host=r.host,
                port=r.port,
                user=r.user,
                private_key=private_key,
                agent_socket=agent_socket,
                known_hosts_file=known_hosts_file,
            )
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
            raise SourceError(
                f"docker inspect {self._specs[rank].container} failed: {(done.stderr or done.stdout).strip()[:300]}"
            )
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
        done = self._remote(
            rank,
            f"timeout {self._remote_timeout_s} docker logs --timestamps --since {shlex.quote(since)} {container} 2>&1",
        )
        if done.returncode != 0:
            raise SourceError(f"docker logs {self._specs[rank].container} failed: {done.stdout.strip()[:300]}")
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
        done = self._remote(
            rank,
            f"timeout {self._remote_timeout_s} docker stats --no-stream --format "
            f"{shlex.quote(STATS_FORMAT)} {shlex.quote(container)}",
        )
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
