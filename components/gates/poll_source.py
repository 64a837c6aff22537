"""The polling source: `docker inspect`, `docker logs` and `docker stats` over ssh, one command per poll. The
stream source falls back to it for a node that cannot stream."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence

from components.gates.observations import (
    ContainerState,
    ContainerUsage,
    LogCursor,
    LogLine,
    RankSpec,
    SourceError,
    parse_docker_logs,
    parse_stats,
    second_before,
)
from components.gates.observations import timestamp_key as timestamp_key  # where the stream source and tests read it
from components.ssh import SSH_DEFAULTS, SshAccess, ssh_argv

# ---------------------------------------------------------------------------------------------
# The real source: docker over SSH

_INSPECT_FORMAT = "{{.State.Status}} {{.State.ExitCode}} {{.State.StartedAt}}"
STATS_FORMAT = "{{json .}}"


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
        ssh: SshAccess = SSH_DEFAULTS,
        *,
        remote_timeout_s: int = 10,
        runner: Runner = run_command,
    ) -> None:
        self._specs: Mapping[int, RankSpec] = {r.rank: r for r in ranks}
        self._targets = {r.rank: ssh.target(r.host, r.port, r.user) for r in ranks}
        self._remote_timeout_s = remote_timeout_s
        self._runner = runner
        self._cursors: dict[int, LogCursor] = {}

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
        cursor = self._cursors.get(rank)
        if cursor is None:
            started = self.state(rank).started_at
            if not started:
                raise SourceError(f"container {self._specs[rank].container} has no start time yet")
            # a second earlier: docker stamps a line written at once before its own StartedAt (rank_stream.sh)
            cursor = self._cursors[rank] = LogCursor(second_before(started))
        container = shlex.quote(self._specs[rank].container)
        done = self._remote(
            rank,
            f"timeout {self._remote_timeout_s} docker logs --timestamps --since {shlex.quote(cursor.since)} "
            f"{container} 2>&1",
        )
        if done.returncode != 0:
            raise SourceError(f"docker logs {self._specs[rank].container} failed: {done.stdout.strip()[:300]}")
        return cursor.take(parse_docker_logs(done.stdout))

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
        self._cursors[rank] = LogCursor(since, set(seen))
