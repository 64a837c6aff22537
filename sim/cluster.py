"""The simulated cluster on loopback addresses, started and stopped by this script (stdlib only).

Node i (1..N) is 127.0.0.(i+1): its own dockerd (unix socket under the state dir, no bridge, no iptables) and
its own sshd on :2222 whose sessions reach that dockerd through `SetEnv DOCKER_HOST=...`. Shared by all
nodes: an image registry on 127.0.0.1:5000 and the Hugging Face hub stand-in on 127.0.0.1:5080. Every node's
filesystem is the host's (the sim deploys with `weights.share: bind`).

    python3 -m sim.cluster up [--nodes N]   start what is not running (pidfile + liveness), build/push the image
    python3 -m sim.cluster up --node I ...  start only node I (its dockerd and sshd): an extra node
    python3 -m sim.cluster image            registry + node 1 only, then build/push the image
    python3 -m sim.cluster down [--node I]  remove containers, stop every daemon the sim started (or node I's)
    python3 -m sim.cluster reboot I         power-cut node I (SIGKILL all it holds), then boot it again
    python3 -m sim.cluster status | env | clean

State lives in <repo>/.state/sim (SIM_STATE_DIR overrides); sim.json there describes the running sim.
The image's base root filesystem is cached in ${DSV41_CACHE:-~/.cache/dsv41-exl3}/sim and never deleted here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SSH_PORT = 2222
REGISTRY_ADDR = ("127.0.0.1", 5000)
HUB_ADDR = ("127.0.0.1", 5080)
IMAGE_NAME = "dsv41-exl3/standin:2.9bpw"
# Real vLLM for CPUs (sim/image/vllm-requirements.txt): what the sim serves by default.
REAL_IMAGE_NAME = "dsv41-exl3/vllm-cpu:0.32.0"
IMAGES = {"standin": IMAGE_NAME, "real": REAL_IMAGE_NAME}
# Prometheus and node_exporter (the observability layer's sim images: one image runs both), built by
# sim/image/prometheus.sh from this machine's Debian binaries, tagged with their Prometheus version.
PROMETHEUS_REPO = "dsv41-exl3/prometheus"
PROMETHEUS_BIN = "/usr/bin/prometheus"
DEFAULT_NODES = 2
MAX_NODES = 200  # 127.0.0.2 .. 127.0.0.201
# command -> Debian package that provides it
PACKAGES = {
    "unshare": "util-linux",
    "mount": "mount",
    "dockerd": "docker.io",
    "docker": "docker.io",
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "docker-registry": "docker-registry",
    "debootstrap": "debootstrap",
    "prometheus": "prometheus",
    "prometheus-node-exporter": "prometheus-node-exporter",
}
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"
# Set by each node's sshd in its sessions' environment (SetEnv): a fallback to find what they started.
NODE_TAG = "DSV41_SIM_NODE"


class SimError(Exception):
    """A failure the operator can act on: the message names the daemon, the value and the fix."""


def log(msg: str) -> None:
    print(f"sim: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Layout:
    """Where everything of the sim lives; pure paths, nothing started."""

    state: Path

    def node_dir(self, i: int) -> Path:
        return self.state / f"node-{i}"

    @staticmethod
    def node_ip(i: int) -> str:
        if not 1 <= i <= MAX_NODES:
            raise SimError(f"node index {i} out of range 1..{MAX_NODES}")
        return f"127.0.0.{i + 1}"

    def socket(self, i: int) -> Path:
        return self.node_dir(i) / "docker.sock"

    def cgroup_name(self, i: int) -> str:
        """Node i's cgroup v2 directory name, unique per state dir (two checkouts may each have a node i)."""
        return f"dsv41-sim-node-{i}-{hashlib.sha1(str(self.state).encode()).hexdigest()[:8]}"

    def node_tag(self, i: int) -> str:
        """NAME=VALUE in the environment of every session of node i's sshd (and what they start)."""
        return f"{NODE_TAG}={self.node_dir(i)}"

    def docker_host(self, i: int) -> str:
        return f"unix://{self.socket(i)}"

    @staticmethod
    def node_name(i: int) -> str:
        """Node i's host name: what an owner's `spark-1` is (the operator resolves it to the node's address)."""
        return f"dsv41-sim-node-{i}"

    def hosts(self, i: int) -> Path:
        """Node i's own /etc/hosts, as Ubuntu writes one: the node's own name on 127.0.1.1 (docs/hardware.md)."""
        return self.node_dir(i) / "hosts"

    def mountstats(self, i: int) -> Path:
        """Node i's /proc/self/mountstats: the nodes share one kernel, so each node's NFS client counters (what a
        GB10 worker's silent load moves) are a file of its own, written by whoever plays its NFS reads."""
        return self.node_dir(i) / "mountstats"

    @property
    def ssh_dir(self) -> Path:
        return self.state / "ssh"

    @property
    def client_key(self) -> Path:
        return self.ssh_dir / "id_ed25519"

    @property
    def authorized_keys(self) -> Path:
        return self.ssh_dir / "authorized_keys"

    @property
    def known_hosts(self) -> Path:
        return self.ssh_dir / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.ssh_dir / "config"

    @property
    def bin_dir(self) -> Path:
        """Holds an `ssh` wrapper that uses ssh_config: put it first on PATH for `docker -H ssh://...`."""
        return self.state / "bin"

    @property
    def registry_dir(self) -> Path:
        return self.state / "registry"

    @property
    def hub_dir(self) -> Path:
        return self.state / "hub"

    @property
    def hub_faults(self) -> Path:
        return self.hub_dir / "missing"

    def existing_nodes(self) -> list[int]:
        found = []
        for d in self.state.glob("node-*"):
            suffix = d.name.removeprefix("node-")
            if suffix.isdigit():
                found.append(int(suffix))
        return sorted(found)


def default_layout() -> Layout:
    return Layout(state=Path(os.environ.get("SIM_STATE_DIR") or REPO / ".state" / "sim").resolve())


# --- processes -------------------------------------------------------------------------------------


def read_pid(pidfile: Path) -> int | None:
    try:
        text = pidfile.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def pid_alive(pid: int, name: str) -> bool:
    """The process exists, is not a zombie, and its command line names `name` (guards against pid reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rpartition(")")[2].split()[0] == "Z":
        return False
    return any(name.encode() in part for part in cmdline[:4])


def running_pid(pidfile: Path, name: str) -> int | None:
    pid = read_pid(pidfile)
    return pid if pid is not None and pid_alive(pid, name) else None


def wait_until(what: str, check: Callable[[], bool], timeout_s: float, logfile: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    hint = f"; see {logfile}" if logfile else ""
    raise SimError(f"{what} not ready after {timeout_s:.0f}s{hint}")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out


# --- node cgroups: what a node holds ------------------------------------------------------------------
#
# Every process a node holds must be found for a power cut, including what a session started with nohup or
# setsid (re-parented to init, so no longer below the sshd) and containerd's shims (re-parented to init too).
# Each node's dockerd and sshd therefore start in a cgroup v2 directory of their own: children inherit it,
# no re-parenting, setsid or env scrubbing leaves it, and `cgroup.kill` ends all of it at once. Containers'
# processes are moved out by runc (into docker's own cgroups); they are the descendants of the node's shims.
# Where no cgroup v2 hierarchy is writable (or for daemons started before this), the fallback is the pid trees
# of sshd and dockerd, the shims naming the node's containerd socket and the NODE_TAG environment variable.


def cgroup2_root() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (pure v2: /sys/fs/cgroup; hybrid: /sys/fs/cgroup/unified)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2" and os.access(fields[1], os.W_OK):
                return Path(fields[1].encode().decode("unicode_escape"))
    return None


def node_cgroup(layout: Layout, i: int) -> Path | None:
    """Node i's cgroup (created here), or None where there is no writable cgroup v2 hierarchy."""
    root = cgroup2_root()
    if root is None:
        return None
    path = root / layout.cgroup_name(i)
    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        log(f"node {i}: no cgroup {path} ({exc}); a reboot finds its processes by pid tree and {NODE_TAG}")
        return None
    return path


def join_cgroup(cgroup: Path | None) -> Callable[[], None] | None:
    """A preexec_fn that moves the new process into `cgroup` before it execs (None: no cgroup)."""
    if cgroup is None:
        return None
    procs = str(cgroup / "cgroup.procs")

    def join() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    return join


def adopt(cgroup: Path | None, pids: Sequence[int]) -> None:
    """Move running processes (a daemon started outside its node's cgroup) into it; what they fork later follows."""
    if cgroup is None:
        return
    for pid in pids:
        with contextlib.suppress(OSError):
            if f"::/{cgroup.name}\n" not in Path(f"/proc/{pid}/cgroup").read_text():
                (cgroup / "cgroup.procs").write_text(str(pid))


def cgroup_pids(cgroup: Path | None) -> set[int]:
    """Every process in `cgroup` and the cgroups below it."""
    pids: set[int] = set()
    if cgroup is None or not cgroup.is_dir():
        return pids
    for procs in [cgroup / "cgroup.procs", *cgroup.rglob("*/cgroup.procs")]:
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in procs.read_text().split())
    return pids


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start: int  # clock ticks since boot: with the pid, names a process even if the pid is reused later
    comm: str
    cmdline: tuple[str, ...]
    zombie: bool


def proc_table() -> dict[int, Proc]:
    table = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmdline = (d / "cmdline").read_bytes()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(d.name)] = Proc(
            int(d.name),
            int(fields[1]),
            int(fields[19]),
            comm,
            tuple(a.decode(errors="replace") for a in cmdline.split(b"\0") if a),
            fields[0] == "Z",
        )
    return table


def has_env(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


SHIM_PREFIX = "containerd-shim"
DOCKER_SIDE = ("dockerd", "containerd", "docker-proxy", "runc")


def node_processes(layout: Layout, i: int) -> dict[int, Proc]:
    """Every live process node i holds: its cgroup, its sshd's and dockerd's pid trees, its shims (by their
    containerd socket) and what carries its NODE_TAG, plus all their descendants (the containers' processes).
    Never this process or its ancestors (a reboot run from a session on the node survives it)."""
    table = proc_table()
    d = layout.node_dir(i)
    roots = cgroup_pids(node_cgroup(layout, i))
    for pidfile, name in ((d / "sshd.pid", "sshd"), (d / "dockerd.pid", "dockerd")):
        pid = running_pid(pidfile, name)
        if pid is not None:
            roots.add(pid)
    address = str(d / "exec" / "containerd" / "containerd.sock")
    tag = layout.node_tag(i)
    for proc in table.values():
        shim = proc.comm.startswith(SHIM_PREFIX) and address in proc.cmdline
        if shim or (not proc.zombie and proc.pid not in roots and has_env(proc.pid, tag)):
            roots.add(proc.pid)
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found, todo = set(), [p for p in roots if p in table]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    spare, pid = set(), os.getpid()
    while pid > 1 and pid in table:
        spare.add(pid)
        pid = table[pid].ppid
    return {p: table[p] for p in found - spare - {1} if not table[p].zombie}


def classify(procs: dict[int, Proc]) -> dict[str, int]:
    """Counts of what a node held: its containers' processes (below a shim), sshd's own processes (listener and
    one per connection), the docker side (dockerd, containerd, shims) and everything else its sessions ran."""
    shims = {p for p, proc in procs.items() if proc.comm.startswith(SHIM_PREFIX)}
    counts = {"container processes": 0, "sshd": 0, "session processes": 0, "docker daemons": 0}
    for pid, proc in procs.items():
        up, in_container = proc.ppid, False
        while up in procs:
            if up in shims:
                in_container = True
                break
            up = procs[up].ppid
        if in_container:
            counts["container processes"] += 1
        elif proc.comm == "sshd":
            counts["sshd"] += 1
        elif pid in shims or proc.comm in DOCKER_SIDE:
            counts["docker daemons"] += 1
        else:
            counts["session processes"] += 1
    return counts


def alive(proc: Proc) -> bool:
    """The very process (same pid, same start time) still exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] != "Z" and int(fields[19]) == proc.start


def signal_all(procs: Sequence[Proc], sig: signal.Signals) -> None:
    for proc in procs:
        if alive(proc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)


def running_containers(sock: Path) -> int | None:
    """How many containers node's daemon runs, or None when it does not answer."""
    try:
        conn = _UnixHTTPConnection(sock)
        conn.request("GET", "/containers/json")
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
    except OSError:
        return None
    return len(json.loads(body)) if resp.status == 200 else None


def power_cut(layout: Layout, i: int) -> dict[str, int]:
    """End every process node i holds at once, as a power cut would: freeze (cgroup) and SIGSTOP them all, so
    none reacts to another's death or forks past the sweep, then SIGKILL them all; then what a boot finds
    gone with /run: the node's mounts and its exec root. Counts what it ended."""
    containers = running_containers(layout.socket(i))
    cgroup = node_cgroup(layout, i)
    freeze = cgroup / "cgroup.freeze" if cgroup is not None else None
    if freeze is not None:
        with contextlib.suppress(OSError):
            freeze.write_text("1")
    procs: dict[int, Proc] = {}
    for _ in range(10):  # until a sweep finds nothing new: what was forking when it was stopped
        found = node_processes(layout, i)
        new = [proc for pid, proc in found.items() if pid not in procs]
        if not new:
            break
        procs.update((proc.pid, proc) for proc in new)
        signal_all(new, signal.SIGSTOP)
    signal_all(list(procs.values()), signal.SIGKILL)
    if cgroup is not None:
        with contextlib.suppress(OSError):
            (cgroup / "cgroup.kill").write_text("1")
        with contextlib.suppress(OSError):
            assert freeze is not None
            freeze.write_text("0")
    wait_until(f"node {i}'s processes to end", lambda: not any(alive(p) for p in procs.values()), 30)
    d = layout.node_dir(i)
    unmount_leftovers(d)  # container rootfs (overlay), shm, netns: a boot starts without them
    if mounts_under(d / "exec"):
        raise SimError(f"node {i}: {mounts_under(d / 'exec')[0]} is still mounted after the power cut")
    subprocess.run(["rm", "-rf", "--one-file-system", str(d / "exec")], check=True, timeout=120)
    for name in ("dockerd.pid", "sshd.pid"):
        (d / name).unlink(missing_ok=True)
    counts = classify(procs)
    counts["processes"] = len(procs)
    counts["containers"] = (
        containers if containers is not None else sum(1 for proc in procs.values() if proc.comm.startswith(SHIM_PREFIX))
    )
    return counts


def ssh_banner(host: str, port: int) -> bool:
    """sshd accepts a connection and greets it (a listener that is up, not just a port that is bound)."""
    try:
        with socket.create_connection((host, port), timeout=2) as conn:
            conn.settimeout(2)
            return conn.recv(256).startswith(b"SSH-")
    except OSError:
        return False


def reboot(layout: Layout, i: int) -> dict[str, float]:
    """Power-cut node i, then boot it: its dockerd (docker's restart policies then apply, as on a real boot)
    and its sshd start again; returns once docker answers and sshd greets a connection."""
    require_root()
    ip, d = layout.node_ip(i), layout.node_dir(i)
    if not (d / "ssh_host_ed25519_key").exists():
        raise SimError(f"node {i} was never started here ({d}); `python3 -m sim.cluster up --node {i}` first")
    started = time.monotonic()
    ended = power_cut(layout, i)
    cut = time.monotonic()
    start_dockerd(layout, i)
    start_sshd(layout, i)
    wait_until(f"node {i} dockerd", lambda: docker_ping(layout.socket(i)), 90, d / "dockerd.log")
    docker_at = time.monotonic()
    wait_until(f"node {i} sshd", lambda: ssh_banner(ip, SSH_PORT), 30, d / "sshd.log")
    done = time.monotonic()
    print(
        f"node {i} rebooted in {done - started:.1f}s: ended {ended['processes']} process(es) "
        f"[{ended['containers']} running container(s) with {ended['container processes']} process(es), "
        f"{ended['sshd']} sshd, {ended['session processes']} started by sessions, "
        f"{ended['docker daemons']} dockerd/containerd/shim]; power cut {cut - started:.1f}s, "
        f"docker answered {docker_at - cut:.1f}s later, sshd {done - docker_at:.1f}s after that",
        flush=True,
    )
    return {
        **{k: float(v) for k, v in ended.items()},
        "cut_s": cut - started,
        "docker_s": docker_at - cut,
        "total_s": done - started,
    }


def stop_pid(pidfile: Path, name: str, timeout_s: float = 30.0, *, with_sessions: bool = False) -> bool:
    """SIGTERM the process named in pidfile (only if it is really `name`), SIGKILL after timeout_s.

    `with_sessions`: also end the processes it forked (an sshd's open sessions, multiplexed masters'
    included), as a node going down would; otherwise a client's ControlMaster keeps reaching the
    old node's daemon through a session that outlived its listener.
    """
    pid = running_pid(pidfile, name)
    if pid is None:
        pidfile.unlink(missing_ok=True)
        return False
    for child in descendants(pid) if with_sessions else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(pid, name):
        time.sleep(0.2)
    if pid_alive(pid, name):
        log(f"{name} (pid {pid}) ignored SIGTERM for {timeout_s:.0f}s; sending SIGKILL")
        os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
    return True


def daemon_env() -> dict[str, str]:
    """This environment minus proxy settings (the sim's daemons only ever talk to loopback addresses) and minus
    XDG_* directories: a daemon outlives its caller, and a caller's runtime directory (a login session's, a test
    session's) goes away with it; runc keeps its exec files there, and every later `docker exec` fails."""
    return {
        k: v
        for k, v in os.environ.items()
        if "proxy" not in k.lower() and k != "PYTHONPATH" and not k.startswith("XDG_")
    }


def spawn(argv: Sequence[str], logfile: Path, cgroup: Path | None = None) -> subprocess.Popen[bytes]:
    """A daemon detached from this process (own session), so it outlives `make`; in `cgroup` from its first
    instruction on (so everything it ever forks is there too) when one is given."""
    with logfile.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
            env=daemon_env(),
            preexec_fn=join_cgroup(cgroup),
        )


def tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


# Never through a proxy: every URL here is a loopback address.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str) -> bool:
    try:
        with _OPENER.open(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=2)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(2)
        self.sock.connect(self._path)


def docker_ping(sock: Path) -> bool:
    try:
        conn = _UnixHTTPConnection(sock)
        conn.request("GET", "/_ping")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


# --- packages and keys -----------------------------------------------------------------------------


def which(cmd: str) -> str | None:
    return shutil.which(cmd, path=f"{os.environ.get('PATH', '')}:{SBIN_PATH}")


def tool(cmd: str) -> str:
    path = which(cmd)
    if path is None:
        raise SimError(f"{cmd} not found; install Debian package {PACKAGES.get(cmd, cmd)} (make sim-up does, as root)")
    return path


def ensure_packages() -> None:
    """apt-get install the Debian packages whose commands are missing (only then: no apt call when warm)."""
    missing = sorted({pkg for cmd, pkg in PACKAGES.items() if which(cmd) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise SimError(f"missing packages {' '.join(missing)}; run `sudo apt-get install -y {' '.join(missing)}`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    log(f"installing {' '.join(missing)}")
    if subprocess.run(install, env=env, stdout=subprocess.DEVNULL, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL, check=True, timeout=300)
        subprocess.run(install, env=env, stdout=subprocess.DEVNULL, check=True, timeout=900)


def ssh_keygen(key: Path, comment: str) -> None:
    if not key.exists():
        subprocess.run(
            [tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)], check=True, timeout=30
        )


def write_if_changed(path: Path, text: str, mode: int | None = None) -> None:
    """Replace `path` atomically, and only when its content changes: sshd and ssh clients of running nodes read
    these files at any moment, and must never see one half written."""
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    if mode is not None:
        tmp.chmod(mode)
    os.replace(tmp, path)


def ensure_keys(layout: Layout, nodes: Sequence[int]) -> None:
    """Client key, host keys of `nodes`, and known_hosts + ssh config naming them and every other node that
    already has a host key (an `up` with fewer nodes, or of one extra node, keeps the others reachable)."""
    layout.ssh_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    ssh_keygen(layout.client_key, "dsv41-exl3-sim-client")
    write_if_changed(layout.authorized_keys, layout.client_key.with_suffix(".pub").read_text(), 0o600)
    known, config = [], []
    keyed = {i for i in layout.existing_nodes() if (layout.node_dir(i) / "ssh_host_ed25519_key.pub").exists()}
    for i in sorted(set(nodes) | keyed):
        host_key = layout.node_dir(i) / "ssh_host_ed25519_key"
        ssh_keygen(host_key, f"dsv41-exl3-sim-node-{i}")
        kind, blob = host_key.with_suffix(".pub").read_text().split()[:2]
        ip = layout.node_ip(i)
        known.append(f"[{ip}]:{SSH_PORT},[{layout.node_name(i)}]:{SSH_PORT} {kind} {blob}\n")
        config.append(
            f"Host sim-node-{i} {ip} {layout.node_name(i)}\n  HostName {ip}\n  Port {SSH_PORT}\n  User root\n"
            f"  IdentityFile {layout.client_key}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {layout.known_hosts}\n  StrictHostKeyChecking yes\n"
            f"  BatchMode yes\n  ConnectTimeout 10\n\n"
        )
    write_if_changed(layout.known_hosts, "".join(known))
    write_if_changed(layout.ssh_config, "# generated by sim/cluster.py: the sim's nodes\n" + "".join(config))
    layout.bin_dir.mkdir(parents=True, exist_ok=True)
    write_if_changed(
        layout.bin_dir / "ssh",
        f"#!/bin/sh\n# ssh with the sim's config (for `docker -H ssh://root@127.0.0.x:{SSH_PORT}`)\n"
        f'exec {tool("ssh")} -F "{layout.ssh_config}" "$@"\n',
        0o755,
    )


# --- names ---------------------------------------------------------------------------------------------
# Owners give their nodes by name (`spark-1`), and Ubuntu maps a machine's own name to 127.0.1.1 in its
# /etc/hosts, which a container on the host network gets a copy of. The sim does the same: on this machine (the
# operator's side) each node's name resolves to its address, from a marked block in /etc/hosts; on node i (its
# dockerd, so its containers, and its sshd, so its sessions, run in a mount namespace with the node's own file
# bound over /etc/hosts) its own name and the machine's resolve to 127.0.1.1, the other nodes' to theirs.

HOSTS = Path("/etc/hosts")
HOSTS_BEGIN = "# >>> dsv41-exl3 sim nodes (sim/cluster.py) >>>"
HOSTS_END = "# <<< dsv41-exl3 sim nodes <<<"


def _names(skip: int = 0) -> str:
    return "".join(f"{Layout.node_ip(j)} {Layout.node_name(j)}\n" for j in range(1, MAX_NODES + 1) if j != skip)


def machine_hosts(text: str, with_nodes: bool) -> str:
    """/etc/hosts text with the sim's block replaced (with_nodes) or removed; the rest kept as it is."""
    lines = text.splitlines(keepends=True)
    if HOSTS_BEGIN in text and HOSTS_END in text:
        begin = next(k for k, line in enumerate(lines) if line.rstrip("\n") == HOSTS_BEGIN)
        end = next(k for k, line in enumerate(lines) if line.rstrip("\n") == HOSTS_END)
        lines = lines[:begin] + lines[end + 1 :]
    kept = "".join(lines)
    if kept and not kept.endswith("\n"):
        kept += "\n"
    return kept + (f"{HOSTS_BEGIN}\n{_names()}{HOSTS_END}\n" if with_nodes else "")


def write_machine_hosts(with_nodes: bool) -> None:
    """In place (the file may be a bind mount, which a rename would not replace)."""
    try:
        text = HOSTS.read_text()
        new = machine_hosts(text, with_nodes)
        if new != text:
            with HOSTS.open("r+") as f:
                f.write(new)
                f.truncate()
    except OSError as err:
        raise SimError(f"cannot write the sim's node names into {HOSTS}: {err}; the sim needs root") from None


def node_hosts(i: int) -> str:
    own = f"{socket.gethostname()} {Layout.node_name(i)}"
    return (
        f"# generated by sim/cluster.py: node {i}'s /etc/hosts, as Ubuntu's (its own name on 127.0.1.1)\n"
        f"127.0.0.1 localhost\n127.0.1.1 {own}\n::1 localhost ip6-localhost ip6-loopback\n{_names(skip=i)}"
    )


def in_node_namespace(layout: Layout, i: int, argv: Sequence[str]) -> list[str]:
    """argv run in a mount namespace of its own where node i's hosts file is /etc/hosts."""
    write_if_changed(layout.hosts(i), node_hosts(i))
    return [
        tool("unshare"),
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        'mount --bind "$0" /etc/hosts && exec "$@"',
        str(layout.hosts(i)),
        *argv,
    ]


# --- daemons ---------------------------------------------------------------------------------------


def start_dockerd(layout: Layout, i: int) -> None:
    d = layout.node_dir(i)
    pidfile, sock = d / "dockerd.pid", layout.socket(i)
    pid = running_pid(pidfile, "dockerd")
    if pid and docker_ping(sock):
        adopt(node_cgroup(layout, i), [pid, *descendants(pid)])  # dockerd and its containerd
        return
    exec_root = d / "exec"
    if len(str(exec_root / "containerd" / "containerd-debug.sock")) > 100:
        raise SimError(
            f"state dir {layout.state} is too deep for dockerd's unix sockets (max ~100 chars); "
            "set SIM_STATE_DIR to a shorter path"
        )
    for sub in ("root", "exec"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    config = d / "daemon.json"
    config.write_text("{}\n")  # so the host's /etc/docker/daemon.json is never read
    log(f"node {i}: starting dockerd on {sock}")
    spawn(
        in_node_namespace(
            layout,
            i,
            [
                tool("dockerd"),
                "--config-file",
                str(config),
                "--data-root",
                str(d / "root"),
                "--exec-root",
                str(exec_root),
                "--pidfile",
                str(pidfile),
                "--host",
                layout.docker_host(i),
                "--bridge=none",
                "--iptables=false",
                "--ip-forward=false",
                "--ip-masq=false",
                "--userland-proxy=false",
                "--containerd-namespace",
                f"dsv41-sim-node-{i}",
                "--containerd-plugins-namespace",
                f"dsv41-sim-node-{i}-plugins",
                "--label",
                f"dsv41.sim.node=node-{i}",
            ],
        ),
        d / "dockerd.log",
        node_cgroup(layout, i),
    )


def sshd_config(layout: Layout, i: int) -> str:
    d = layout.node_dir(i)
    return f"""# generated by sim/cluster.py: node {i}'s sshd
ListenAddress {layout.node_ip(i)}:{SSH_PORT}
HostKey {d / "ssh_host_ed25519_key"}
PidFile {d / "sshd.pid"}
# The sim's client key, and the user's own file as on any node (the watchdogs authorize their peers there).
AuthorizedKeysFile {layout.authorized_keys} .ssh/authorized_keys
# The key lives in the work tree, whose parent directories' modes are not ours to vouch for.
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
# pulumi's CopyToRemote needs SFTP; docker over ssh opens one connection per API call.
Subsystem sftp internal-sftp
MaxStartups 100:30:200
MaxSessions 100
# Every session on this node, `docker system dial-stdio` included, reaches this node's own daemon.
# {NODE_TAG} marks what those sessions start as this node's (a fallback: see node_processes).
SetEnv DOCKER_HOST={layout.docker_host(i)} {layout.node_tag(i)} DSV41_MOUNTSTATS={layout.mountstats(i)}
PrintMotd no
"""


def start_sshd(layout: Layout, i: int) -> None:
    d = layout.node_dir(i)
    pidfile, ip = d / "sshd.pid", layout.node_ip(i)
    config = d / "sshd_config"
    pid = running_pid(pidfile, "sshd")
    if pid and tcp_open(ip, SSH_PORT):
        adopt(node_cgroup(layout, i), [pid])  # the sessions it forks from now on are the node's too
        if config.exists() and config.read_text() != sshd_config(layout, i):
            # A newer sim's config: sshd re-reads it on SIGHUP and keeps the sessions it has.
            config.write_text(sshd_config(layout, i))
            log(f"node {i}: sshd config changed; reloading")
            os.kill(pid, signal.SIGHUP)
        return
    if tcp_open(ip, SSH_PORT):
        raise SimError(f"{ip}:{SSH_PORT} is taken by a process the sim did not start (no live {pidfile}); stop it")
    config.write_text(sshd_config(layout, i))
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    sshd = tool("sshd")
    check = subprocess.run([sshd, "-t", "-f", str(config)], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise SimError(f"node {i}: sshd rejects {config}: {check.stderr.strip()}")
    log(f"node {i}: starting sshd on {ip}:{SSH_PORT}")
    # sshd daemonizes itself and writes PidFile; in the node's cgroup, every session and whatever a session
    # starts (nohup'd, setsid'd, re-parented to init) stays there.
    subprocess.run(
        in_node_namespace(layout, i, [sshd, "-f", str(config), "-E", str(d / "sshd.log")]),
        check=True,
        timeout=30,
        preexec_fn=join_cgroup(node_cgroup(layout, i)),
    )


def registry_config(layout: Layout) -> str:
    host, port = REGISTRY_ADDR
    return f"""# generated by sim/cluster.py: the sim's image registry (loopback, plain HTTP)
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {registry_storage()}
  delete:
    enabled: true
http:
  addr: {host}:{port}
  headers:
    X-Content-Type-Options: [nosniff]
health:
  storagedriver:
    enabled: false
"""


def start_registry(layout: Layout) -> None:
    d, (host, port) = layout.registry_dir, REGISTRY_ADDR
    pidfile = d / "registry.pid"
    if running_pid(pidfile, "docker-registry") and http_ok(f"http://{host}:{port}/v2/"):
        return
    if tcp_open(host, port):
        raise SimError(f"{host}:{port} is taken by a process the sim did not start (no live {pidfile}); stop it")
    (d / "data").mkdir(parents=True, exist_ok=True)
    config = d / "config.yml"
    config.write_text(registry_config(layout))
    log(f"starting registry on {host}:{port}")
    proc = spawn([tool("docker-registry"), "serve", str(config)], d / "registry.log")
    pidfile.write_text(f"{proc.pid}\n")


def start_hub(layout: Layout) -> None:
    d, (host, port) = layout.hub_dir, HUB_ADDR
    pidfile = d / "hub.pid"
    if running_pid(pidfile, "sim.hub") and http_ok(f"http://{host}:{port}/api/sim/health"):
        return
    if tcp_open(host, port):
        raise SimError(f"{host}:{port} is taken by a process the sim did not start (no live {pidfile}); stop it")
    d.mkdir(parents=True, exist_ok=True)
    log(f"starting hub stand-in on {host}:{port}")
    spawn(
        [
            sys.executable,
            "-m",
            "sim.hub",
            "--host",
            host,
            "--port",
            str(port),
            "--faults",
            str(layout.hub_faults),
            "--pidfile",
            str(pidfile),
        ],
        d / "hub.log",
    )


def wait_ready(layout: Layout, nodes: Sequence[int], with_hub: bool = True, with_registry: bool = True) -> None:
    for i in nodes:
        wait_until(
            f"node {i} dockerd",
            lambda i=i: docker_ping(layout.socket(i)),  # type: ignore[misc]
            90,
            layout.node_dir(i) / "dockerd.log",
        )
        wait_until(
            f"node {i} sshd",
            lambda i=i: tcp_open(layout.node_ip(i), SSH_PORT),  # type: ignore[misc]
            30,
            layout.node_dir(i) / "sshd.log",
        )
    if not with_registry:
        return
    host, port = REGISTRY_ADDR
    wait_until("registry", lambda: http_ok(f"http://{host}:{port}/v2/"), 30, layout.registry_dir / "registry.log")
    if with_hub:
        host, port = HUB_ADDR
        wait_until(
            "hub stand-in", lambda: http_ok(f"http://{host}:{port}/api/sim/health"), 30, layout.hub_dir / "hub.log"
        )


def registry_storage() -> Path:
    """The registry's storage, outside the work tree (like the base tarballs): the images in it are keyed by
    their inputs, so a fresh clone's sim pushes nothing it already holds (the real image is ~6 GB)."""
    cache = Path(os.environ.get("DSV41_CACHE") or Path.home() / ".cache" / "dsv41-exl3")
    return cache / "sim" / "registry"


def prometheus_version() -> str:
    """The Prometheus version of this machine's Debian package (`2.42.0` of `2.42.0+ds`): the sim image's tag."""
    try:
        out = subprocess.run([PROMETHEUS_BIN, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise SimError(f"{PROMETHEUS_BIN}: {exc}; install Debian package prometheus (make sim-up does)") from exc
    words = (out.stdout + out.stderr).split()
    version = words[2] if len(words) > 2 and words[:2] == ["prometheus,", "version"] else ""
    version = version.split("+", 1)[0]
    if not version:
        raise SimError(f"cannot read a version from `{PROMETHEUS_BIN} --version`: {out.stdout[:200]!r}")
    return version


def image_name(flavor: str) -> str:
    """The registry path and tag of a flavour's image: `standin`, `real` (serving) or `prometheus`."""
    return f"{PROMETHEUS_REPO}:{prometheus_version()}" if flavor == "prometheus" else IMAGES[flavor]


def image_ref(flavor: str = "standin") -> str:
    return f"{REGISTRY_ADDR[0]}:{REGISTRY_ADDR[1]}/{image_name(flavor)}"


def build_image(layout: Layout, flavors: Sequence[str] = ("standin", "real", "prometheus")) -> None:
    """Build and push each flavour's image (each skips when the registry holds its inputs' build); the Prometheus
    image is built on the stand-in image, so after it."""
    for flavor in flavors:
        env = {
            **daemon_env(),
            "SIM_DOCKER_HOST": layout.docker_host(1),
            "SIM_FLAVOR": flavor,
            "SIM_STAMP_DIR": str(registry_storage() / "stamps"),
            "SIM_REGISTRY": f"{REGISTRY_ADDR[0]}:{REGISTRY_ADDR[1]}",
            "SIM_IMAGE": image_ref(flavor),
        }
        script = "build.sh"
        if flavor == "prometheus":
            script, env["SIM_BASE_IMAGE"] = "prometheus.sh", image_ref("standin")
        before = registry_digest(flavor)
        subprocess.run(["bash", str(REPO / "sim" / "image" / script)], env=env, check=True, timeout=3600)
        if before is not None and registry_digest(flavor) != before:
            # A new build under the same tag: untag the old one on every node, so each pulls the new build
            # (containers keep the image they run). Nodes left on the old build would run two builds at once.
            for i in layout.existing_nodes():
                if docker_ping(layout.socket(i)):
                    subprocess.run(
                        ["docker", "-H", layout.docker_host(i), "image", "rm", "--force", image_ref(flavor)],
                        capture_output=True,
                        timeout=60,
                    )


def registry_digest(flavor: str = "standin") -> str | None:
    """The digest the registry serves for a flavour's tag, or None when it has none yet."""
    host, port = REGISTRY_ADDR
    name, tag = image_name(flavor).rsplit(":", 1)
    request = urllib.request.Request(
        f"http://{host}:{port}/v2/{name}/manifests/{tag}",
        method="HEAD",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            digest: str | None = resp.headers.get("Docker-Content-Digest")
            return digest
    except (urllib.error.URLError, OSError):
        return None


def describe(layout: Layout, nodes: Sequence[int]) -> dict[str, object]:
    return {
        "state": str(layout.state),
        "ssh": {
            "key": str(layout.client_key),
            "config": str(layout.ssh_config),
            "port": SSH_PORT,
            "user": "root",
            "known_hosts": str(layout.known_hosts),
            "bin": str(layout.bin_dir),
        },
        "nodes": [
            {
                "index": i,
                "ip": layout.node_ip(i),
                "name": layout.node_name(i),
                "docker_host": layout.docker_host(i),
                "ssh_docker_host": f"ssh://root@{layout.node_ip(i)}:{SSH_PORT}",
            }
            for i in nodes
        ],
        "registry": f"{REGISTRY_ADDR[0]}:{REGISTRY_ADDR[1]}",
        "image": image_ref("standin"),
        "images": {flavor: image_ref(flavor) for flavor in (*IMAGES, "prometheus")},
        "hub": f"http://{HUB_ADDR[0]}:{HUB_ADDR[1]}",
        "hub_faults": str(layout.hub_faults),
    }


def require_root() -> None:
    if os.geteuid() != 0:
        raise SimError(f"the sim runs dockerd and sshd as root; run it as root (uid is {os.geteuid()})")


def up(layout: Layout, nodes: int, build: bool = True) -> None:
    if not 1 <= nodes <= MAX_NODES:
        raise SimError(f"SIM_NODES={nodes} out of range; use 1..{MAX_NODES} (default {DEFAULT_NODES})")
    require_root()
    ensure_packages()
    indices = list(range(1, nodes + 1))
    for i in indices:
        layout.node_dir(i).mkdir(parents=True, exist_ok=True)
    ensure_keys(layout, indices)
    write_machine_hosts(True)
    for i in indices:
        start_dockerd(layout, i)
        start_sshd(layout, i)
    start_registry(layout)
    start_hub(layout)
    wait_ready(layout, indices)
    (layout.state / "sim.json").write_text(json.dumps(describe(layout, indices), indent=2) + "\n")
    if build:
        build_image(layout)
    log(f"up: {nodes} node(s); `python3 -m sim.cluster env` prints how to reach them")


def up_nodes(layout: Layout, indices: Sequence[int]) -> None:
    """Start only these nodes (dockerd + sshd), e.g. an extra node beside a running sim; the registry, the hub,
    the image and sim.json are left as they are (a node pulls from whichever registry serves 127.0.0.1:5000)."""
    require_root()
    ensure_packages()
    for i in indices:
        layout.node_dir(i).mkdir(parents=True, exist_ok=True)
    ensure_keys(layout, indices)
    write_machine_hosts(True)
    for i in indices:
        start_dockerd(layout, i)
        start_sshd(layout, i)
    wait_ready(layout, indices, with_registry=False)
    log(f"up: node(s) {', '.join(map(str, indices))} ({', '.join(layout.node_ip(i) for i in indices)})")


def image(layout: Layout) -> None:
    require_root()
    ensure_packages()
    layout.node_dir(1).mkdir(parents=True, exist_ok=True)
    start_dockerd(layout, 1)
    start_registry(layout)
    wait_until("node 1 dockerd", lambda: docker_ping(layout.socket(1)), 90, layout.node_dir(1) / "dockerd.log")
    host, port = REGISTRY_ADDR
    wait_until("registry", lambda: http_ok(f"http://{host}:{port}/v2/"), 30, layout.registry_dir / "registry.log")
    build_image(layout)


def remove_containers(layout: Layout, i: int) -> None:
    host = layout.docker_host(i)
    docker = tool("docker")
    ids = subprocess.run([docker, "--host", host, "ps", "-aq"], capture_output=True, text=True, timeout=60)
    if ids.returncode == 0 and ids.stdout.split():
        log(f"node {i}: removing {len(ids.stdout.split())} container(s)")
        subprocess.run(
            [docker, "--host", host, "rm", "-f", *ids.stdout.split()], stdout=subprocess.DEVNULL, timeout=120
        )


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path`, deepest first (mountinfo field 5, octal escapes decoded)."""
    prefix = str(path).rstrip("/") + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point.startswith(prefix):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def unmount_leftovers(path: Path) -> None:
    """dockerd leaves its netns bind mount (exec/netns/default) behind after it exits."""
    for point in mounts_under(path):
        subprocess.run(["umount", "-l", point], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)


def down(layout: Layout, only: Sequence[int] = ()) -> None:
    """Everything, or (`only`) just these nodes' daemons and containers."""
    nodes = list(only) or layout.existing_nodes()
    for i in nodes:
        if running_pid(layout.node_dir(i) / "dockerd.pid", "dockerd") and docker_ping(layout.socket(i)):
            remove_containers(layout, i)
    stopped = []
    if not only and stop_pid(layout.hub_dir / "hub.pid", "sim.hub", 10):
        stopped.append("hub")
    if not only and stop_pid(layout.registry_dir / "registry.pid", "docker-registry", 10):
        stopped.append("registry")
    for i in nodes:
        if stop_pid(layout.node_dir(i) / "sshd.pid", "sshd", 10, with_sessions=True):
            stopped.append(f"node {i} sshd")
        if stop_pid(layout.node_dir(i) / "dockerd.pid", "dockerd", 60):
            stopped.append(f"node {i} dockerd")
        unmount_leftovers(layout.node_dir(i) / "exec")
        cgroup = cgroup2_root()
        with contextlib.suppress(OSError):  # only when empty (a nohup'd leftover keeps it)
            if cgroup is not None:
                (cgroup / layout.cgroup_name(i)).rmdir()
    if not only:
        write_machine_hosts(False)
    log(f"down: stopped {', '.join(stopped) if stopped else 'nothing (not running)'}")


def status(layout: Layout) -> dict[str, bool]:
    result: dict[str, bool] = {}
    for i in layout.existing_nodes():
        d = layout.node_dir(i)
        result[f"node-{i}/dockerd"] = bool(running_pid(d / "dockerd.pid", "dockerd")) and docker_ping(layout.socket(i))
        result[f"node-{i}/sshd"] = bool(running_pid(d / "sshd.pid", "sshd")) and tcp_open(layout.node_ip(i), SSH_PORT)
    result["registry"] = bool(running_pid(layout.registry_dir / "registry.pid", "docker-registry"))
    result["hub"] = bool(running_pid(layout.hub_dir / "hub.pid", "sim.hub"))
    return result


def env_text(layout: Layout) -> str:
    nodes = layout.existing_nodes() or [1]
    ip1 = layout.node_ip(nodes[0])
    return (
        f"# the sim's nodes: {', '.join(layout.node_ip(i) for i in nodes)} (port {SSH_PORT}, user root)\n"
        f"export SIM_SSH_KEY={layout.client_key}\n"
        f"export SIM_SSH_CONFIG={layout.ssh_config}\n"
        f"export HF_ENDPOINT=http://{HUB_ADDR[0]}:{HUB_ADDR[1]}\n"
        f"# ssh -i {layout.client_key} -p {SSH_PORT} -o UserKnownHostsFile={layout.known_hosts} root@{ip1}\n"
        f"# ssh -F {layout.ssh_config} root@{ip1} docker info\n"
        f"# PATH={layout.bin_dir}:$PATH docker -H ssh://root@{ip1}:{SSH_PORT} ps\n"
    )


def clean(layout: Layout) -> None:
    """down, then delete the state dir (registry storage, node data roots, keys); the image cache stays."""
    down(layout)
    if layout.state.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(layout.state)], check=True, timeout=300)
        log(f"removed {layout.state}")


def node_index(text: str) -> int:
    """`3` or `node-3` (as sim/cluster.sh users write it)."""
    digits = text.removeprefix("node-")
    if not digits.isdigit() or not 1 <= int(digits) <= MAX_NODES:
        raise argparse.ArgumentTypeError(f"not a node: {text!r} (use N or node-N, N in 1..{MAX_NODES})")
    return int(digits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m sim.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "image", "down", "reboot", "status", "env", "clean"])
    parser.add_argument("target", nargs="?", type=node_index, help="reboot: the node (N or node-N)")
    parser.add_argument("--nodes", type=int, default=int(os.environ.get("SIM_NODES") or DEFAULT_NODES))
    parser.add_argument(
        "--node",
        type=node_index,
        action="append",
        default=[],
        dest="only",
        help="up/down: only this node (repeatable); registry, hub, image and sim.json stay as they are",
    )
    parser.add_argument("--no-image", action="store_true", help="up: do not build/push the stand-in image")
    ns = parser.parse_args(argv)
    if (ns.command == "reboot") != (ns.target is not None):
        parser.error("reboot takes one node (N or node-N); no other command takes one")
    if ns.only and ns.command not in ("up", "down"):
        parser.error("--node is for up and down")
    layout = default_layout()
    try:
        if ns.command == "up" and ns.only:
            up_nodes(layout, ns.only)
        elif ns.command == "up":
            up(layout, ns.nodes, build=not ns.no_image)
        elif ns.command == "image":
            image(layout)
        elif ns.command == "down":
            down(layout, ns.only)
        elif ns.command == "reboot":
            reboot(layout, ns.target)
        elif ns.command == "clean":
            clean(layout)
        elif ns.command == "env":
            print(env_text(layout), end="")
        else:
            states = status(layout)
            for name, alive in states.items():
                print(f"{name}: {'running' if alive else 'stopped'}")
            return 0 if states and all(states.values()) else 1
    except SimError as exc:
        log(f"error: {exc}")
        return 1
    except subprocess.CalledProcessError as exc:
        log(f"error: {' '.join(map(str, exc.cmd))[:200]} exited {exc.returncode}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
