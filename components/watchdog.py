"""The per-node memory watchdog: stops the serving container before unified memory runs out.

GB10's weights are not charged to any process RSS, so the guard is MemAvailable from
/proc/meminfo, never a `used` figure (a large resident footprint is normal here). When
MemAvailable stays below the floor for K consecutive samples the watchdog runs `docker stop`
on that node's serving container and records why in `~/.local/state/dsv41-exl3/watchdog.log`
(and syslog through `logger -t dsv41-exl3-watchdog` when available).

How it runs: a POSIX sh loop started with nohup (and setsid when present), a pidfile per node.
It does NOT survive a reboot: the simulated cluster has no systemd, and a user unit with linger
would be a second, untested path. After a reboot the serving containers are gone too; the next
`pulumi up --refresh` recreates them, and since the watchdog's triggers carry the containers'
ids it is reinstalled and restarted with them.

Rendering is pure (tested by running the script locally); `MemoryWatchdog` only wires it into
`pulumi_command.remote.Command`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
from pulumi_command import remote

LOG_PATH = "~/.local/state/dsv41-exl3/watchdog.log"
SYSLOG_TAG = "dsv41-exl3-watchdog"
_STATE_DIR = '"$HOME/.local/state/dsv41-exl3"'
_SHARE_DIR = '"$HOME/.local/share/dsv41-exl3"'
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_HEREDOC_END = "DSV41_WATCHDOG_SCRIPT_END"


@dataclass(frozen=True, kw_only=True)
class WatchdogSettings:
    """What the watchdog does on one node. Plain values: they shape the rendered script."""

    node_name: str
    container_name: str
    floor_gib: float = 5.0
    sample_interval_s: int = 5
    consecutive_samples: int = 3
    meminfo_path: str = "/proc/meminfo"
    # The serving container has a 60 s stop timeout; docker stop then kills. Bound the whole call.
    stop_timeout_s: int = 120

    def __post_init__(self) -> None:
        if not _NODE_NAME.match(self.node_name):
            raise ValueError(f"watchdog node_name {self.node_name!r} must match [A-Za-z0-9][A-Za-z0-9._-]* "
                             "(it names the watchdog's files)")
        if not _CONTAINER_NAME.match(self.container_name):
            raise ValueError(f"watchdog container_name {self.container_name!r} on {self.node_name} is not a valid "
                             "docker container name ([a-zA-Z0-9][a-zA-Z0-9_.-]*)")
        if not 0 < self.floor_gib < 1024:
            raise ValueError(f"watchdog floor_gib={self.floor_gib} on {self.node_name} must be > 0 GiB "
                             "(the recipe uses 5)")
        if self.sample_interval_s < 1:
            raise ValueError(f"watchdog sample_interval_s={self.sample_interval_s} on {self.node_name} must be >= 1")
        if self.consecutive_samples < 1:
            raise ValueError(f"watchdog consecutive_samples={self.consecutive_samples} on {self.node_name} "
                             "must be >= 1")
        if not self.meminfo_path.startswith("/") or "'" in self.meminfo_path:
            raise ValueError(f"watchdog meminfo_path {self.meminfo_path!r} must be an absolute path without quotes")

    @property
    def floor_kib(self) -> int:
        """/proc/meminfo counts in KiB (it prints `kB`)."""
        return int(self.floor_gib * 1024 * 1024)

    @property
    def script_name(self) -> str:
        return f"memory-watchdog-{self.node_name}.sh"

    @property
    def pid_name(self) -> str:
        return f"memory-watchdog-{self.node_name}.pid"


def render_watchdog_script(s: WatchdogSettings) -> str:
    """The loop that runs on the node. Env overrides (configuration, e.g. for a node without
    /proc or a docker behind sudo): DSV41_WATCHDOG_MEMINFO, DSV41_WATCHDOG_DOCKER,
    DSV41_WATCHDOG_INTERVAL_S."""
    return f"""#!/bin/sh
# dsv41-exl3 memory watchdog for node {s.node_name} (rendered by the Pulumi program; edits are overwritten).
# Stops container {s.container_name} when MemAvailable stays below {s.floor_gib:g} GiB for
# {s.consecutive_samples} consecutive samples. MemAvailable, never "used": on GB10 the weights are not
# charged to any RSS and a large resident footprint is normal.
set -u
NODE='{s.node_name}'
CONTAINER='{s.container_name}'
FLOOR_KIB={s.floor_kib}
SAMPLES={s.consecutive_samples}
STOP_TIMEOUT={s.stop_timeout_s}
INTERVAL="${{DSV41_WATCHDOG_INTERVAL_S:-{s.sample_interval_s}}}"
MEMINFO="${{DSV41_WATCHDOG_MEMINFO:-{s.meminfo_path}}}"
DOCKER="${{DSV41_WATCHDOG_DOCKER:-docker}}"
STATE_DIR={_STATE_DIR}
LOG="$STATE_DIR/watchdog.log"
PIDFILE="$STATE_DIR/{s.pid_name}"

mkdir -p "$STATE_DIR"
say() {{
  line="$(date -u +%Y-%m-%dT%H:%M:%SZ) node=$NODE container=$CONTAINER $*"
  printf '%s\\n' "$line" >> "$LOG"
  if command -v logger >/dev/null 2>&1; then logger -t {SYSLOG_TAG} -- "$line" 2>/dev/null || true; fi
}}
stop_container() {{
  if command -v timeout >/dev/null 2>&1; then timeout "$STOP_TIMEOUT" $DOCKER stop "$CONTAINER"
  else $DOCKER stop "$CONTAINER"; fi
}}

echo $$ > "$PIDFILE"
trap 'say "watchdog stopping (signal)"; rm -f "$PIDFILE"; exit 0' TERM INT HUP
say "watchdog started pid=$$ floor_kib=$FLOOR_KIB samples=$SAMPLES interval_s=$INTERVAL meminfo=$MEMINFO"
low=0
recent=""
unreadable=0
while :; do
  avail=$(awk '$1 == "MemAvailable:" {{ print $2; exit }}' "$MEMINFO" 2>/dev/null)
  case "$avail" in
    ''|*[!0-9]*)
      # never act on a reading we do not have; say so once
      if [ "$unreadable" = 0 ]; then say "cannot read MemAvailable from $MEMINFO; not guarding"; fi
      unreadable=1; low=0; recent="" ;;
    *)
      unreadable=0
      if [ "$avail" -lt "$FLOOR_KIB" ]; then
        low=$((low + 1)); recent="$recent $avail"
        if [ "$low" -ge "$SAMPLES" ]; then
          say "STOP: MemAvailable below $FLOOR_KIB KiB in $low consecutive samples (KiB:$recent); docker stop"
          if stop_container >/dev/null 2>&1; then say "stopped $CONTAINER"
          else say "docker stop $CONTAINER failed (exit $?)"; fi
          low=0; recent=""
        fi
      else
        low=0; recent=""
      fi ;;
  esac
  # background + wait: a TERM is handled at once instead of after the sleep
  sleep "$INTERVAL" &
  wait $!
done
"""


def _stop_running(s: WatchdogSettings) -> str:
    """sh that stops this node's running watchdog, if any (checked by pid and command line)."""
    # "ours": alive and still our script (not a recycled pid; a zombie's cmdline is empty)
    return f"""pidfile={_STATE_DIR}/{s.pid_name}
ours() {{ kill -0 "$1" 2>/dev/null && grep -q memory-watchdog "/proc/$1/cmdline" 2>/dev/null; }}
if [ -s "$pidfile" ]; then
  old=$(cat "$pidfile")
  if ours "$old"; then
    kill "$old"
    i=0; while ours "$old" && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
  fi
  rm -f "$pidfile"
fi
"""


def render_install_command(s: WatchdogSettings, *, timeout_s: int = 60) -> str:
    """Idempotent: writes the script, stops a running copy, starts it again, confirms it is alive."""
    body = f"""set -eu
mkdir -p {_SHARE_DIR} {_STATE_DIR}
script={_SHARE_DIR}/{s.script_name}
{_stop_running(s)}cat > "$script.tmp" <<'{_HEREDOC_END}'
{render_watchdog_script(s)}{_HEREDOC_END}
chmod 755 "$script.tmp"
mv -f "$script.tmp" "$script"
if command -v setsid >/dev/null 2>&1; then
  setsid nohup sh "$script" >/dev/null 2>&1 </dev/null &
else
  nohup sh "$script" >/dev/null 2>&1 </dev/null &
fi
i=0; while [ ! -s "$pidfile" ] && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
pid=$(cat "$pidfile" 2>/dev/null || true)
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
  echo "memory watchdog for {s.container_name} running on {s.node_name}: pid $pid, log {LOG_PATH}"
else
  echo "memory watchdog on {s.node_name} did not start; see {LOG_PATH}" >&2
  exit 1
fi
"""
    return f"timeout {timeout_s} sh -c {shlex.quote(body)}"


def render_remove_command(s: WatchdogSettings, *, timeout_s: int = 30) -> str:
    """Stops the watchdog and removes its script; the log stays (it may explain a past stop)."""
    body = f"""set -eu
{_stop_running(s)}rm -f {_SHARE_DIR}/{s.script_name}
echo "memory watchdog removed from {s.node_name}; log kept at {LOG_PATH}"
"""
    return f"timeout {timeout_s} sh -c {shlex.quote(body)}"


@dataclass(frozen=True, kw_only=True)
class MemoryWatchdogArgs:
    """Inputs of MemoryWatchdog. `restart_on`: the serving containers' ids, so the watchdog is
    reinstalled whenever they are replaced (e.g. recreated after a reboot)."""

    node_name: str
    connection: pulumi.Input[remote.ConnectionArgs]
    container_name: str
    floor_gib: float = 5.0
    sample_interval_s: int = 5
    consecutive_samples: int = 3
    meminfo_path: str = "/proc/meminfo"
    restart_on: Sequence[pulumi.Input[str]] = ()

    def settings(self) -> WatchdogSettings:
        return WatchdogSettings(node_name=self.node_name, container_name=self.container_name,
                                floor_gib=self.floor_gib, sample_interval_s=self.sample_interval_s,
                                consecutive_samples=self.consecutive_samples, meminfo_path=self.meminfo_path)

    def __post_init__(self) -> None:
        self.settings()  # validate now, at program time, with the node named in the message


class MemoryWatchdog(pulumi.ComponentResource):
    """Installs and runs the MemAvailable watchdog on one node."""

    status: pulumi.Output[str]
    """What the install reported (pid and log path)."""
    log_path: str
    """Where the watchdog records why it stopped a container (on the node)."""
    script_path: str
    """Where the watchdog script lives on the node."""

    def __init__(self, name: str, args: MemoryWatchdogArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("dsv41-exl3:watchdog:MemoryWatchdog", name, None, opts)
        settings = args.settings()
        install = render_install_command(settings)
        # delete_before_replace: the old copy's delete must not run after the new copy started
        # (both share the node's pidfile).
        self._command = remote.Command(
            f"{name}-install",
            remote.CommandArgs(
                connection=args.connection,
                create=install,
                update=install,
                delete=render_remove_command(settings),
                triggers=list(args.restart_on),
                add_previous_output_in_env=False,
            ),
            pulumi.ResourceOptions(parent=self, delete_before_replace=True),
        )
        self.status = self._command.stdout
        self.log_path = LOG_PATH
        self.script_path = f"~/.local/share/dsv41-exl3/{settings.script_name}"
        self.register_outputs({"status": self.status, "log_path": self.log_path, "script_path": self.script_path})
