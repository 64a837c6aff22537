"""The per-node memory watchdog: stops every rank of the deployment before unified memory runs out.

GB10's weights are not charged to any process RSS, so the guard is MemAvailable from
/proc/meminfo, never a `used` figure (a large resident footprint is normal here). When
MemAvailable stays below the floor for K consecutive samples the watchdog records which
processes held the memory (the top of the process list by RSS, and MemAvailable), runs
`docker stop` on that node's serving container, and then stops every other rank: a
tensor-parallel group with one rank gone hangs forever while `/health` says 200. Everything
goes to `~/.local/state/<stack prefix>/watchdog.log` (and syslog through `logger -t
dsv41-exl3-watchdog` when available). Every file lives in directories named by the stack's prefix
(`labels.stack_prefix`, e.g. `~/.local/share/dsv41-exl3-dev/`), so two stacks on one node keep
their own script, pidfile, key and log and never stop or delete each other's.

Stopping the other ranks: each node has its own watchdog key pair (`WatchdogKey`, generated on
the node, the private key never leaves it). Every node's `~/.ssh/authorized_keys` lists its
peers' public keys with a forced command (`restrict,command=...`): that key can do one thing
only, run the node's peer-stop script, which logs who asked and stops this stack's serving
container there. A tripped watchdog ssh-es to each peer (the SSH address of the stack config,
BatchMode, and only the peer's host key the operator's machine pinned, written to the watchdog's own
known_hosts file with StrictHostKeyChecking=yes) and so stops every rank
of the group. The default floor (1.5 GiB) sits below what a healthy head reaches (about 4 GiB
in normal serving, ~2.1 GiB at the end of a 601k prefill), as the upstream launcher's own guard.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
from pulumi_command import remote

SYSLOG_TAG = "dsv41-exl3-watchdog"
# Where versions before per-stack names kept every stack's watchdog files (migrated on install).
_LEGACY_STATE_DIR = '"$HOME/.local/state/dsv41-exl3"'
_LEGACY_SHARE_DIR = '"$HOME/.local/share/dsv41-exl3"'
_STACK_PREFIX = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,39}$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_HEREDOC_END = "DSV41_WATCHDOG_SCRIPT_END"
_PEER_STOP_END = "DSV41_WATCHDOG_PEER_STOP_END"
KEY_NAME = "watchdog-peer-key"
PUBKEY_MARKER = "DSV41_WATCHDOG_PUBKEY"
_PUBKEY = re.compile(r"^ssh-ed25519 [A-Za-z0-9+/=]+( [^\s\"]*)?$")
DEFAULT_FLOOR_GIB = 1.5
# Process-list lines kept in the log when the watchdog trips (the header plus the top holders).
TOP_HOLDERS = 10


@dataclass(frozen=True, kw_only=True)
class WatchdogPeer:
    """Another rank's node, as this node's watchdog reaches it to stop its container."""

    node_name: str
    host: str
    port: int = 22
    user: str
    # The peer's SSH host key as the operator's machine pinned it (`type base64`): the watchdog trusts
    # exactly that key, never a first use on the node.
    host_key: str

    def __post_init__(self) -> None:
        if not _NODE_NAME.match(self.node_name):
            raise ValueError(f"watchdog peer node_name {self.node_name!r} must match [A-Za-z0-9][A-Za-z0-9._-]*")
        if not re.fullmatch(r"(ssh|ecdsa|sk)-[A-Za-z0-9@.-]+ [A-Za-z0-9+/]+={0,3}", self.host_key):
            raise ValueError(f"watchdog peer {self.node_name}: host_key {self.host_key!r} is not `type base64`")
        for what, value in (("host", self.host), ("user", self.user)):
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]*", value):
                raise ValueError(f"watchdog peer {self.node_name}: {what} {value!r} is not a plain host or user name")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"watchdog peer {self.node_name}: port {self.port} must be 1-65535")


@dataclass(frozen=True, kw_only=True)
class WatchdogSettings:
    """What the watchdog does on one node. Plain values: they shape the rendered script."""

    node_name: str
    container_name: str
    stack_prefix: str
    """Names this stack's directories on the node (`labels.stack_prefix`)."""
    floor_gib: float = DEFAULT_FLOOR_GIB
    sample_interval_s: int = 5
    consecutive_samples: int = 3
    meminfo_path: str = "/proc/meminfo"
    # The serving container has a 60 s stop timeout; docker stop then kills. Bound the whole call.
    stop_timeout_s: int = 120
    peers: tuple[WatchdogPeer, ...] = ()
    """Every other rank's node: stopped through its forced-command key when this watchdog trips."""

    def __post_init__(self) -> None:
        if not _NODE_NAME.match(self.node_name):
            raise ValueError(f"watchdog node_name {self.node_name!r} must match [A-Za-z0-9][A-Za-z0-9._-]* "
                             "(it names the watchdog's files)")
        if not _STACK_PREFIX.match(self.stack_prefix):
            raise ValueError(f"watchdog stack_prefix {self.stack_prefix!r} on {self.node_name} is not a safe directory "
                             "name; derive it with components.labels.stack_prefix")
        if not _CONTAINER_NAME.match(self.container_name):
            raise ValueError(f"watchdog container_name {self.container_name!r} on {self.node_name} is not a valid "
                             "docker container name ([a-zA-Z0-9][a-zA-Z0-9_.-]*)")
        if not 0 < self.floor_gib < 1024:
            raise ValueError(f"watchdog floor_gib={self.floor_gib} on {self.node_name} must be > 0 GiB "
                             f"(the default is {DEFAULT_FLOOR_GIB:g})")
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
    def state_dir(self) -> str:
        """sh word: this stack's state directory (pidfile, key, log) on the node."""
        return f'"$HOME/.local/state/{self.stack_prefix}"'

    @property
    def share_dir(self) -> str:
        """sh word: this stack's scripts on the node."""
        return f'"$HOME/.local/share/{self.stack_prefix}"'

    @property
    def log_path(self) -> str:
        return f"~/.local/state/{self.stack_prefix}/watchdog.log"

    @property
    def script_path(self) -> str:
        return f"~/.local/share/{self.stack_prefix}/{self.script_name}"

    @property
    def script_name(self) -> str:
        return f"memory-watchdog-{self.node_name}.sh"

    @property
    def pid_name(self) -> str:
        return f"memory-watchdog-{self.node_name}.pid"

    @property
    def peer_stop_name(self) -> str:
        return f"memory-watchdog-{self.node_name}-peer-stop.sh"

    @property
    def key_tag(self) -> str:
        """Marks this container's lines in authorized_keys, so install and remove touch only those."""
        return f"dsv41-exl3-watchdog:{self.container_name}"


def known_hosts_text(peers: Sequence[WatchdogPeer]) -> str:
    """The watchdog's known_hosts: each peer's pinned key under the name ssh looks up (`[host]:port` off 22)."""
    return "".join(f"{p.host if p.port == 22 else f'[{p.host}]:{p.port}'} {p.host_key}\n" for p in peers)


def _peer_lines(s: WatchdogSettings) -> str:
    """`stop_peers` body: one bounded ssh per peer; the peer's forced command does the stop."""
    lines = []
    for p in s.peers:
        lines.append(
            f"  stop_peer {shlex.quote(p.node_name)} {shlex.quote(p.user)} {shlex.quote(p.host)} {p.port}"
        )
    return "\n".join(lines) if lines else "  :"


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
SSH="${{DSV41_WATCHDOG_SSH:-ssh}}"
STATE_DIR={s.state_dir}
KEY="$STATE_DIR/{KEY_NAME}"
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
# Who held the memory at the moment of the trip: MemAvailable and the top of the process list by RSS
# (the weights are in no RSS, so this names what else grew: often an unrelated host process).
memory_holders() {{
  mem=$(awk '$1 == "MemAvailable:" || $1 == "MemTotal:" || $1 == "Cached:" {{ printf "%s %s kB; ", $1, $2 }}' \\
    "$MEMINFO" 2>/dev/null)
  say "memory at stop: $mem"
  procs=$(ps -eo pid,rss,comm --sort=-rss 2>/dev/null | head -n {TOP_HOLDERS + 1})
  if [ -z "$procs" ]; then
    procs=$(for f in /proc/[0-9]*/status; do
      awk '$1 == "Name:" {{ n = $2 }} $1 == "Pid:" {{ p = $2 }} $1 == "VmRSS:" {{ r = $2 }}
           END {{ if (r) print p, r, n }}' "$f" 2>/dev/null
    done | sort -k2 -n -r | head -n {TOP_HOLDERS})
  fi
  printf '%s\\n' "$procs" | while IFS= read -r line; do
    [ -n "$line" ] && say "holder (pid rss_kib command): $line"
  done
}}
# Another rank's node: its forced-command key stops its serving container (nothing else is allowed).
stop_peer() {{
  if [ ! -s "$KEY" ]; then say "cannot stop rank on $1: no watchdog key at $KEY"; return 0; fi
  if out=$(timeout "$STOP_TIMEOUT" $SSH -i "$KEY" -p "$4" -o BatchMode=yes -o IdentitiesOnly=yes \\
      -o StrictHostKeyChecking=yes -o UserKnownHostsFile="$KNOWN_HOSTS" \\
      -o ConnectTimeout=10 "$2@$3" "stop-from $NODE" 2>&1); then
    say "peer $1 ($2@$3:$4): $(printf '%s' "$out" | tr '\\n' ' ')"
  else
    say "peer $1 ($2@$3:$4): stop FAILED (exit $?): $(printf '%s' "$out" | tr '\\n' ' '); stop it by hand"
  fi
}}
stop_peers() {{
{_peer_lines(s)}
}}

# The peers' host keys as the operator pinned them; rewritten on every start so a re-pinned key follows.
KNOWN_HOSTS="$STATE_DIR/watchdog-known_hosts"
cat > "$KNOWN_HOSTS" <<'DSV41_KNOWN_HOSTS'
{known_hosts_text(s.peers)}DSV41_KNOWN_HOSTS
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
          memory_holders
          if stop_container >/dev/null 2>&1; then say "stopped $CONTAINER"
          else say "docker stop $CONTAINER failed (exit $?)"; fi
          # the rest of the tensor-parallel group: one rank gone leaves the others hanging forever
          stop_peers
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


def render_peer_stop_script(s: WatchdogSettings) -> str:
    """The forced command of the peers' watchdog keys on this node: log who asked, stop the container.

    Its one argument names the peer; it comes from this node's authorized_keys line, not from the
    connecting side, so a key can only ever stop this container and say whose key it was."""
    return f"""#!/bin/sh
# dsv41-exl3: run by sshd for a peer's watchdog key (authorized_keys forced command); nothing else.
set -u
NODE='{s.node_name}'
CONTAINER='{s.container_name}'
DOCKER="${{DSV41_WATCHDOG_DOCKER:-docker}}"
STATE_DIR={s.state_dir}
LOG="$STATE_DIR/watchdog.log"
from="${{1:-unknown}}"
mkdir -p "$STATE_DIR"
line="$(date -u +%Y-%m-%dT%H:%M:%SZ) node=$NODE container=$CONTAINER STOP requested by the watchdog of $from"\\
" (its MemAvailable stayed below the floor): the tensor-parallel group cannot go on without that rank; docker stop"
printf '%s\\n' "$line" >> "$LOG"
if command -v logger >/dev/null 2>&1; then logger -t {SYSLOG_TAG} -- "$line" 2>/dev/null || true; fi
if timeout {s.stop_timeout_s} $DOCKER stop "$CONTAINER" >/dev/null 2>&1; then
  printf '%s\\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ) node=$NODE container=$CONTAINER stopped (asked by $from)" >> "$LOG"
  echo "stopped $CONTAINER on $NODE"
else
  rc=$?
  printf '%s\\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ) node=$NODE container=$CONTAINER docker stop failed (exit $rc)" \\
    >> "$LOG"
  echo "docker stop $CONTAINER failed on $NODE (exit $rc)"
  exit 1
fi
"""


def authorized_key_line(s: WatchdogSettings, peer_node: str, public_key: str) -> str:
    """One authorized_keys line: the peer's key may only run this node's peer-stop script."""
    key = " ".join(public_key.strip().split()[:2])
    if not _PUBKEY.match(key) or not _NODE_NAME.match(peer_node):
        raise ValueError(f"watchdog on {s.node_name}: peer {peer_node!r} public key {public_key[:40]!r} is not an "
                         "ssh-ed25519 key line")
    command = f"sh .local/share/{s.stack_prefix}/{s.peer_stop_name} {peer_node}"
    return f'restrict,command="{command}" {key} {s.key_tag}:from-{peer_node}'


def _authorized_keys(s: WatchdogSettings, lines: Sequence[str]) -> str:
    """sh that replaces this container's lines in ~/.ssh/authorized_keys with `lines` (none: removes)."""
    body = "".join(f"printf '%s\\n' {shlex.quote(line)} >> \"$tmp\"\n" for line in lines)
    # A temp file of its own: two stacks' watchdogs may rewrite the same file at once.
    return f"""mkdir -p "$HOME/.ssh" && chmod 700 "$HOME/.ssh"
ak="$HOME/.ssh/authorized_keys"
touch "$ak"
tmp=$(mktemp "$ak.XXXXXX")
grep -v -F {shlex.quote(s.key_tag + ":")} "$ak" > "$tmp" || true
{body}chmod 600 "$tmp"
mv -f "$tmp" "$ak"
"""


def render_key_command(s: WatchdogSettings, *, timeout_s: int = 30) -> str:
    """Creates this node's watchdog key pair once (kept on the node) and prints the public key."""
    body = f"""set -eu
mkdir -p {s.state_dir}
key={s.state_dir}/{KEY_NAME}
if [ ! -s "$key" ]; then ssh-keygen -q -t ed25519 -N '' -C {shlex.quote(s.key_tag)} -f "$key" </dev/null; fi
echo "{PUBKEY_MARKER} $(cut -d' ' -f1,2 "$key.pub")"
"""
    return f"timeout {timeout_s} sh -c {shlex.quote(body)}"


def render_key_remove_command(s: WatchdogSettings, *, timeout_s: int = 30) -> str:
    d = s.state_dir
    body = f"rm -f {d}/{KEY_NAME} {d}/{KEY_NAME}.pub {d}/watchdog-known_hosts"
    return f"timeout {timeout_s} sh -c {shlex.quote(body)}"


def parse_public_key(stdout: str, node_name: str) -> str:
    for line in reversed(stdout.splitlines()):
        if line.startswith(PUBKEY_MARKER + " "):
            key = line[len(PUBKEY_MARKER) + 1:].strip()
            if _PUBKEY.match(key):
                return key
    raise ValueError(f"the watchdog key command on {node_name} printed no ssh-ed25519 public key "
                     f"(output: {stdout[-200:]!r}); check that ssh-keygen exists there")


def _stop_pidfile(pidfile: str) -> str:
    # "ours": alive and still a watchdog script (not a recycled pid; a zombie's cmdline is empty)
    return f"""pidfile={pidfile}
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


def _stop_running(s: WatchdogSettings) -> str:
    """sh that stops this stack's running watchdog on this node, if any (checked by pid and command line)."""
    return _stop_pidfile(f"{s.state_dir}/{s.pid_name}")


def _stop_legacy(s: WatchdogSettings) -> str:
    """sh that retires the copy an earlier version installed at the shared fixed paths, only when that
    copy guards THIS stack's container (its script names it); another stack's copy is left alone."""
    legacy_script = f"{_LEGACY_SHARE_DIR}/{s.script_name}"
    return f"""if grep -qxF {shlex.quote(f"CONTAINER='{s.container_name}'")} {legacy_script} 2>/dev/null; then
{_stop_pidfile(f"{_LEGACY_STATE_DIR}/{s.pid_name}")}  rm -f {legacy_script} {_LEGACY_SHARE_DIR}/{s.peer_stop_name}
fi
"""


def render_install_command(
    s: WatchdogSettings, *, timeout_s: int = 60, peer_keys: Sequence[tuple[str, str]] = ()
) -> str:
    """Idempotent: writes the script, stops a running copy, starts it again, confirms it is alive.

    `peer_keys`: (peer node, its watchdog public key); each may then stop this node's container."""
    lines = [authorized_key_line(s, peer, key) for peer, key in peer_keys]
    peer_part = ""
    if s.peers or lines:
        peer_part = f"""cat > {s.share_dir}/{s.peer_stop_name}.tmp <<'{_PEER_STOP_END}'
{render_peer_stop_script(s)}{_PEER_STOP_END}
chmod 755 {s.share_dir}/{s.peer_stop_name}.tmp
mv -f {s.share_dir}/{s.peer_stop_name}.tmp {s.share_dir}/{s.peer_stop_name}
{_authorized_keys(s, lines)}"""
    body = f"""set -eu
mkdir -p {s.share_dir} {s.state_dir}
script={s.share_dir}/{s.script_name}
{_stop_legacy(s)}{_stop_running(s)}{peer_part}cat > "$script.tmp" <<'{_HEREDOC_END}'
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
  echo "memory watchdog for {s.container_name} running on {s.node_name}: pid $pid, log {s.log_path}"
else
  echo "memory watchdog on {s.node_name} did not start; see {s.log_path}" >&2
  exit 1
fi
"""
    return f"timeout {timeout_s} sh -c {shlex.quote(body)}"


def render_remove_command(s: WatchdogSettings, *, timeout_s: int = 30) -> str:
    """Stops the watchdog and removes its script; the log stays (it may explain a past stop)."""
    peers = f"rm -f {s.share_dir}/{s.peer_stop_name}\n{_authorized_keys(s, [])}" if s.peers else ""
    body = f"""set -eu
{_stop_running(s)}rm -f {s.share_dir}/{s.script_name}
{peers}echo "memory watchdog removed from {s.node_name}; log kept at {s.log_path}"
"""
    return f"timeout {timeout_s} sh -c {shlex.quote(body)}"


@dataclass(frozen=True, kw_only=True)
class MemoryWatchdogArgs:
    """Inputs of MemoryWatchdog. `restart_on`: the serving containers' ids, so the watchdog is
    reinstalled whenever they are replaced (e.g. recreated after a reboot)."""

    node_name: str
    connection: pulumi.Input[remote.ConnectionArgs]
    container_name: str
    stack_prefix: str
    floor_gib: float = DEFAULT_FLOOR_GIB
    sample_interval_s: int = 5
    consecutive_samples: int = 3
    meminfo_path: str = "/proc/meminfo"
    restart_on: Sequence[pulumi.Input[str]] = ()
    peers: Sequence[WatchdogPeer] = ()
    """The other ranks' nodes: a trip here stops their containers too."""
    peer_public_keys: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)
    """Per peer node name, its `WatchdogKey.public_key`: that peer's watchdog may stop this node's container."""

    def settings(self) -> WatchdogSettings:
        return WatchdogSettings(node_name=self.node_name, container_name=self.container_name,
                                stack_prefix=self.stack_prefix, floor_gib=self.floor_gib,
                                sample_interval_s=self.sample_interval_s,
                                consecutive_samples=self.consecutive_samples, meminfo_path=self.meminfo_path,
                                peers=tuple(self.peers))

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
        names = list(args.peer_public_keys)
        install: pulumi.Input[str] = render_install_command(settings)
        if names:
            install = pulumi.Output.all(*[args.peer_public_keys[n] for n in names]).apply(
                lambda keys: render_install_command(settings, peer_keys=list(zip(names, keys, strict=True))))
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
        self.log_path = settings.log_path
        self.script_path = settings.script_path
        self.register_outputs({"status": self.status, "log_path": self.log_path, "script_path": self.script_path})


@dataclass(frozen=True, kw_only=True)
class WatchdogKeyArgs:
    node_name: str
    connection: pulumi.Input[remote.ConnectionArgs]
    container_name: str
    stack_prefix: str


class WatchdogKey(pulumi.ComponentResource):
    """This node's watchdog key pair, made on the node (the private key never leaves it)."""

    public_key: pulumi.Output[str]
    """`ssh-ed25519 AAAA...`: the peers authorize it to stop their serving containers, nothing else."""

    def __init__(self, name: str, args: WatchdogKeyArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("dsv41-exl3:watchdog:WatchdogKey", name, None, opts)
        settings = WatchdogSettings(node_name=args.node_name, container_name=args.container_name,
                                    stack_prefix=args.stack_prefix)
        command = remote.Command(
            f"{name}-keygen",
            remote.CommandArgs(
                connection=args.connection,
                create=render_key_command(settings),
                delete=render_key_remove_command(settings),
                add_previous_output_in_env=False,
            ),
            pulumi.ResourceOptions(parent=self),
        )
        self.public_key = command.stdout.apply(lambda out: parse_public_key(out, args.node_name))
        self.register_outputs({"public_key": self.public_key})
