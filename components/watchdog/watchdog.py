"""The per-node memory watchdog: stops every rank of the deployment before unified memory runs out.

GB10's weights are not charged to any process RSS, so the guard is MemAvailable from
/proc/meminfo, never a `used` figure (a large resident footprint is normal here). When
MemAvailable stays below the floor for K consecutive samples the watchdog records which
processes held the memory (the top of the process list by RSS, and MemAvailable), runs
`docker kill` on that node's serving container (no stop grace: a host short of unified memory
wedges in seconds), and then kills every other rank the same way: a
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
of the group. The floor, the sample interval and the count are the stack's `watchdog` section
(components/config says why its default floor is 1.5 GiB).

How it runs: a POSIX sh loop started with nohup (and setsid when present), a pidfile per node.
It does NOT survive a reboot: the simulated cluster has no systemd, and a user unit with linger
would be a second, untested path. After a reboot the serving containers are gone too; the next
`pulumi up --refresh` recreates them, and since the watchdog re-runs on the containers'
ids it is reinstalled and restarted with them.

The node scripts are files beside this module (`watchdog.sh`, `peer_stop.sh`, `install.sh`, `key.sh`),
rendered with `components.scripts` (a header of quoted values; the watchdog and peer-stop scripts reach the
node as text values of the install script). Rendering is pure (tested by running the scripts locally);
`MemoryWatchdog` only wires it into `pulumi_command.remote.Command`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
from pulumi_command import remote

from components import labels, scripts
from components.config import Watchdog

SYSLOG_TAG = "dsv41-exl3-watchdog"
# Where versions before per-stack names kept every stack's watchdog files (migrated on install).
_LEGACY_STATE_DIR = ".local/state/dsv41-exl3"
_LEGACY_SHARE_DIR = ".local/share/dsv41-exl3"
_STACK_PREFIX = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,39}$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
# Before keys were named per node; the key remove deletes a file left under this name.
LEGACY_KEY_NAME = "watchdog-peer-key"
PUBKEY_MARKER = "DSV41_WATCHDOG_PUBKEY"
_PUBKEY = re.compile(r"^ssh-ed25519 [A-Za-z0-9+/=]+( [^\s\"]*)?$")
# The kernel's memory counters; the floor, interval and sample count are operator settings (config.Watchdog).
MEMINFO_PATH = "/proc/meminfo"
# Process-list lines kept in the log when the watchdog trips (the header plus the top holders).
TOP_HOLDERS = 10


@dataclass(frozen=True, kw_only=True)
class WatchdogPeer:
    """Another rank's node, as this node's watchdog reaches it to stop its container."""

    node_name: str
    host: str
    port: int
    user: str
    # The peer's SSH host key as the operator's machine pinned it (`type base64`): the watchdog trusts
    # exactly that key, never a first use on the node.
    host_key: str

    def __post_init__(self) -> None:
        # Invariants of values components/config already checked (nodes[]), written into a shell script.
        if not _NODE_NAME.match(self.node_name):
            raise ValueError(f"watchdog peer node_name {self.node_name!r} must match [A-Za-z0-9][A-Za-z0-9._-]*")
        if not re.fullmatch(r"(ssh|ecdsa|sk)-[A-Za-z0-9@.-]+ [A-Za-z0-9+/]+={0,3}", self.host_key):
            raise ValueError(f"watchdog peer {self.node_name}: host_key {self.host_key!r} is not `type base64`")
        # A login name may start with '_' (components/config's rule, as useradd's); never with '-' (an ssh option).
        for what, value, pattern in (
            ("host", self.host, r"[A-Za-z0-9][A-Za-z0-9._:-]*"),
            ("user", self.user, r"[A-Za-z0-9_][A-Za-z0-9._-]*"),
        ):
            if not re.fullmatch(pattern, value):
                raise ValueError(f"watchdog peer {self.node_name}: {what} {value!r} is not a plain host or user name")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"watchdog peer {self.node_name}: port {self.port} must be 1-65535")


@dataclass(frozen=True, kw_only=True)
class WatchdogNames:
    """What names this stack's watchdog files on one node (the key pair needs only these)."""

    node_name: str
    container_name: str
    stack_prefix: str
    """Names this stack's directories on the node (`labels.stack_prefix`)."""

    def __post_init__(self) -> None:
        if not _NODE_NAME.match(self.node_name):
            raise ValueError(
                f"watchdog node_name {self.node_name!r} must match [A-Za-z0-9][A-Za-z0-9._-]* "
                "(it names the watchdog's files)"
            )
        if not _STACK_PREFIX.match(self.stack_prefix):
            raise ValueError(
                f"watchdog stack_prefix {self.stack_prefix!r} on {self.node_name} is not a safe directory "
                "name; derive it with components.labels.stack_prefix"
            )
        if not _CONTAINER_NAME.match(self.container_name):
            raise ValueError(
                f"watchdog container_name {self.container_name!r} on {self.node_name} is not a valid "
                "docker container name ([a-zA-Z0-9][a-zA-Z0-9_.-]*)"
            )

    @property
    def state_dir(self) -> str:
        """This stack's state directory (pidfile, key, log) on the node, relative to the SSH user's home."""
        return labels.state_dir(self.stack_prefix)

    @property
    def share_dir(self) -> str:
        """This stack's scripts on the node, relative to the SSH user's home (sshd runs a forced command there)."""
        return f".local/share/{self.stack_prefix}"

    @property
    def log_path(self) -> str:
        return f"~/{self.state_dir}/watchdog.log"

    @property
    def script_path(self) -> str:
        return f"~/{self.share_dir}/{self.script_name}"

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
    def key_name(self) -> str:
        """The key pair's file in the state dir. It names the stack and the node: nodes sharing one home (NFS
        homes, the simulated cluster) would otherwise all get one key, and a peer's stop would run the first
        matching authorized_keys line, another node's forced command."""
        return f"watchdog-key-{self.stack_prefix}-{self.node_name}"

    @property
    def stack_label(self) -> str:
        """The stack's label value on its rank containers, as the container's name tells it ("" when it does not):
        the peer-stop script finds this host's rank by it."""
        return labels.stack_of_container(self.container_name, self.node_name) or ""

    @property
    def key_tag(self) -> str:
        """Marks this container's lines in authorized_keys, so install and remove touch only those."""
        return f"dsv41-exl3-watchdog:{self.container_name}"


@dataclass(frozen=True, kw_only=True)
class WatchdogSettings(WatchdogNames):
    """What the watchdog does on one node. Plain values: they shape the rendered script."""

    watchdog: Watchdog
    """The stack's `watchdog` section: floor, sample interval, consecutive samples. Invariant: components/config
    refuses a floor at or below 0 or above a Spark's memory, and an interval or a count below 1."""
    # Not operator settings (no config key): the script's env override and the tests point at a fixture.
    meminfo_path: str = MEMINFO_PATH
    # docker kill returns at once (no stop grace: a host short of unified memory wedges in seconds); this bounds a
    # hung daemon or an unreachable peer, each docker and ssh call.
    stop_timeout_s: int = 30
    peers: tuple[WatchdogPeer, ...] = ()
    """Every other rank's node: stopped through its forced-command key when this watchdog trips."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.meminfo_path.startswith("/") or "'" in self.meminfo_path:
            raise ValueError(f"watchdog meminfo_path {self.meminfo_path!r} must be an absolute path without quotes")

    @property
    def floor_kib(self) -> int:
        """/proc/meminfo counts in KiB (it prints `kB`)."""
        return int(self.watchdog.mem_available_floor_gib * 1024 * 1024)


def known_hosts_text(peers: Sequence[WatchdogPeer]) -> str:
    """The watchdog's known_hosts: each peer's pinned key under the name ssh looks up (`[host]:port` off 22)."""
    return "".join(f"{p.host if p.port == 22 else f'[{p.host}]:{p.port}'} {p.host_key}\n" for p in peers)


def peers_text(peers: Sequence[WatchdogPeer]) -> str:
    """The watchdog's PEERS value: one `node user host port` line per other rank (each word validated plain)."""
    return "".join(f"{p.node_name} {p.user} {p.host} {p.port}\n" for p in peers)


def render_watchdog_script(s: WatchdogSettings) -> str:
    """The loop that runs on the node (`watchdog.sh`). Env overrides (configuration, e.g. for a node without
    /proc or a docker behind sudo): DSV41_WATCHDOG_MEMINFO, DSV41_WATCHDOG_DOCKER, DSV41_WATCHDOG_INTERVAL_S."""
    return scripts.render(
        "watchdog/watchdog.sh",
        {
            "NODE": s.node_name,
            "CONTAINER": s.container_name,
            "FLOOR_KIB": s.floor_kib,
            "SAMPLES": s.watchdog.consecutive_samples,
            "STOP_TIMEOUT": s.stop_timeout_s,
            "SAMPLE_INTERVAL_S": s.watchdog.sample_seconds,
            "MEMINFO_PATH": s.meminfo_path,
            "STATE_DIR": s.state_dir,
            "KEY_NAME": s.key_name,
            "PID_NAME": s.pid_name,
            "SYSLOG_TAG": SYSLOG_TAG,
            "TOP_HOLDERS": TOP_HOLDERS,
            "PEERS": scripts.text_value(peers_text(s.peers)),
            "KNOWN_HOSTS": scripts.text_value(known_hosts_text(s.peers)),
        },
    )


def render_peer_stop_script(s: WatchdogSettings) -> str:
    """The forced command of the peers' watchdog keys on this node (`peer_stop.sh`): log who asked, kill this
    stack's rank on the host it runs on (found by its labels on that host's docker, so a line of another node's,
    matched first in a shared home's authorized_keys, still stops the rank that was asked). Its one argument
    names the peer; it comes from this node's authorized_keys line."""
    return scripts.render(
        "watchdog/peer_stop.sh",
        {
            "NODE": s.node_name,
            "CONTAINER": s.container_name,
            "STACK": s.stack_label,
            "STACK_LABEL_KEY": labels.STACK_LABEL,
            "RANK_LABEL_KEY": labels.RANK_LABEL,
            "STATE_DIR": s.state_dir,
            "STOP_TIMEOUT": s.stop_timeout_s,
            "SYSLOG_TAG": SYSLOG_TAG,
        },
    )


def from_pattern(host: str) -> str | None:
    """sshd's `from=` for a peer that this node knows by `host` (its SSH address): the address its watchdog
    connects from. A loopback peer shares this machine's kernel (the simulated cluster), which sends from
    127.0.0.1 whatever 127.0.0.N it connects to: the loopback range. A hostname: None, since sshd matches names
    only with UseDNS (off by default) and the line would refuse every stop; the per-node key still binds it."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.is_loopback:
        return "127.0.0.0/8" if address.version == 4 else "::1"
    return host


def authorized_key_line(s: WatchdogNames, peer: WatchdogPeer, public_key: str) -> str:
    """One authorized_keys line: the peer's key, from the peer's address, may only run this node's peer-stop
    script (the forced command of this line)."""
    key = " ".join(public_key.strip().split()[:2])
    if not _PUBKEY.match(key):
        raise ValueError(
            f"watchdog on {s.node_name}: peer {peer.node_name!r} public key {public_key[:40]!r} is not "
            "an ssh-ed25519 key line"
        )
    command = f"sh {s.share_dir}/{s.peer_stop_name} {peer.node_name}"
    source = from_pattern(peer.host)
    options = "restrict" + (f',from="{source}"' if source else "") + f',command="{command}"'
    return f"{options} {key} {s.key_tag}:from-{peer.node_name}"


def _bounded(timeout_s: int, text: str) -> str:
    """A remote command: the rendered script run by `sh -c`, bounded by `timeout`."""
    return scripts.sh_command(text, timeout_s=timeout_s)


def _key_script(s: WatchdogNames, action: str) -> str:
    return scripts.render(
        "watchdog/key.sh",
        {
            "ACTION": action,
            "NODE": s.node_name,
            "STATE_DIR": s.state_dir,
            "KEY_NAME": s.key_name,
            "LEGACY_KEY_NAME": LEGACY_KEY_NAME,
            "KEY_TAG": s.key_tag,
            "PUBKEY_MARKER": PUBKEY_MARKER,
        },
    )


def render_key_command(s: WatchdogNames, *, timeout_s: int = 30) -> str:
    """Creates this node's watchdog key pair once (kept on the node) and prints the public key."""
    return _bounded(timeout_s, _key_script(s, "create"))


def render_key_remove_command(s: WatchdogNames, *, timeout_s: int = 30) -> str:
    return _bounded(timeout_s, _key_script(s, "remove"))


def parse_public_key(stdout: str, node_name: str) -> str:
    for line in reversed(stdout.splitlines()):
        if line.startswith(PUBKEY_MARKER + " "):
            key = line[len(PUBKEY_MARKER) + 1 :].strip()
            if _PUBKEY.match(key):
                return key
    raise ValueError(
        f"the watchdog key command on {node_name} printed no ssh-ed25519 public key "
        f"(output: {stdout[-200:]!r}); check that ssh-keygen exists there"
    )


def _install_script(
    s: WatchdogSettings,
    *,
    action: str,
    manage_peers: bool,
    authorized: Sequence[str] = (),
    watchdog: str = "",
    peer_stop: str = "",
) -> str:
    return scripts.render(
        "watchdog/install.sh",
        {
            "ACTION": action,
            "NODE": s.node_name,
            "CONTAINER": s.container_name,
            "STATE_DIR": s.state_dir,
            "SHARE_DIR": s.share_dir,
            "SCRIPT_NAME": s.script_name,
            "PID_NAME": s.pid_name,
            "PEER_STOP_NAME": s.peer_stop_name,
            "LOG_PATH": s.log_path,
            "KEY_TAG": s.key_tag,
            "MANAGE_PEERS": "1" if manage_peers else "",
            "AUTHORIZED_KEYS": scripts.text_value("".join(f"{line}\n" for line in authorized)),
            "WATCHDOG": scripts.text_value(watchdog),
            "PEER_STOP": scripts.text_value(peer_stop),
            "LEGACY_STATE_DIR": _LEGACY_STATE_DIR,
            "LEGACY_SHARE_DIR": _LEGACY_SHARE_DIR,
        },
    )


def render_install_command(
    s: WatchdogSettings, *, timeout_s: int = 60, peer_keys: Sequence[tuple[str, str]] = ()
) -> str:
    """Idempotent: writes the script, stops a running copy, starts it again, confirms it is alive.

    `peer_keys`: (peer node, its watchdog public key); each may then stop this node's container."""
    by_name = {p.node_name: p for p in s.peers}
    unknown = sorted({name for name, _ in peer_keys} - set(by_name))
    if unknown:
        raise ValueError(
            f"watchdog on {s.node_name}: keys of {unknown} that are not among its peers "
            f"{sorted(by_name)}: a line needs the peer's address (from=)"
        )
    lines = [authorized_key_line(s, by_name[name], key) for name, key in peer_keys]
    manage = bool(s.peers or lines)
    return _bounded(
        timeout_s,
        _install_script(
            s,
            action="install",
            manage_peers=manage,
            authorized=lines,
            watchdog=render_watchdog_script(s),
            peer_stop=render_peer_stop_script(s) if manage else "",
        ),
    )


def render_remove_command(s: WatchdogSettings, *, timeout_s: int = 30) -> str:
    """Stops the watchdog and removes its script; the log stays (it may explain a past stop)."""
    return _bounded(timeout_s, _install_script(s, action="remove", manage_peers=bool(s.peers)))


@dataclass(frozen=True, kw_only=True)
class MemoryWatchdogArgs:
    """Inputs of MemoryWatchdog."""

    node_name: str
    connection: pulumi.Input[remote.ConnectionArgs]
    container_name: str
    stack_prefix: str
    watchdog: Watchdog
    """The stack's `watchdog` section."""
    meminfo_path: str = MEMINFO_PATH
    rerun_on: Sequence[pulumi.Input[str]]
    """The serving containers' ids: the watchdog is reinstalled whenever they are replaced (e.g. recreated
    after a reboot)."""
    peers: Sequence[WatchdogPeer] = ()
    """The other ranks' nodes: a trip here stops their containers too."""
    peer_public_keys: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)
    """Per peer node name, its `WatchdogKey.public_key`: that peer's watchdog may stop this node's container."""

    def settings(self) -> WatchdogSettings:
        return WatchdogSettings(
            node_name=self.node_name,
            container_name=self.container_name,
            stack_prefix=self.stack_prefix,
            watchdog=self.watchdog,
            meminfo_path=self.meminfo_path,
            peers=tuple(self.peers),
        )

    def __post_init__(self) -> None:
        self.settings()  # validate now, at program time, with the node named in the message


# The components the install and the key had until issue 36; their commands keep aliases to them
# (components/wiring.py).
WATCHDOG_COMPONENT = "dsv41-exl3:watchdog:MemoryWatchdog"
KEY_COMPONENT = "dsv41-exl3:watchdog:WatchdogKey"


class MemoryWatchdog:
    """Installs and runs the MemAvailable watchdog on one node: one command named `<name>-install`; `opts`
    places it (no component of its own: it would only add a registration per node)."""

    command: remote.Command
    status: pulumi.Output[str]
    """What the install reported (pid and log path)."""
    log_path: str
    """Where the watchdog records why it stopped a container (on the node)."""
    script_path: str
    """Where the watchdog script lives on the node."""

    def __init__(self, name: str, args: MemoryWatchdogArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        settings = args.settings()
        names = list(args.peer_public_keys)
        install: pulumi.Input[str] = render_install_command(settings)
        if names:
            install = pulumi.Output.all(*[args.peer_public_keys[n] for n in names]).apply(
                lambda keys: render_install_command(settings, peer_keys=list(zip(names, keys, strict=True)))
            )
        # delete_before_replace: the old copy's delete must not run after the new copy started
        # (both share the node's pidfile).
        self.command = remote.Command(
            f"{name}-install",
            remote.CommandArgs(
                connection=args.connection,
                create=install,
                update=install,
                delete=render_remove_command(settings),
                triggers=list(args.rerun_on),
                add_previous_output_in_env=False,
            ),
            pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(delete_before_replace=True)),
        )
        self.status = self.command.stdout
        self.log_path = settings.log_path
        self.script_path = settings.script_path


@dataclass(frozen=True, kw_only=True)
class WatchdogKeyArgs:
    node_name: str
    connection: pulumi.Input[remote.ConnectionArgs]
    container_name: str
    stack_prefix: str


class WatchdogKey:
    """This node's watchdog key pair, made on the node (the private key never leaves it): one command named
    `<name>-keygen`; `opts` places it."""

    command: remote.Command
    public_key: pulumi.Output[str]
    """`ssh-ed25519 AAAA...`: the peers authorize it to stop their serving containers, nothing else."""

    def __init__(self, name: str, args: WatchdogKeyArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        names = WatchdogNames(
            node_name=args.node_name, container_name=args.container_name, stack_prefix=args.stack_prefix
        )
        self.command = remote.Command(
            f"{name}-keygen",
            remote.CommandArgs(
                connection=args.connection,
                create=render_key_command(names),
                delete=render_key_remove_command(names),
                add_previous_output_in_env=False,
            ),
            opts,
        )
        self.public_key = self.command.stdout.apply(lambda out: parse_public_key(out, args.node_name))
