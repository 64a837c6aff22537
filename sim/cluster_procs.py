"""The simulated cluster's processes (stdlib only, as sim/cluster.py).

Pidfiles and /proc (is a daemon really the one it names, what runs below it), each node's cgroup (what a node
holds, found again for a power cut), starting a detached daemon and stopping one, the power cut itself, and the
mounts a node's dockerd leaves behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sim.cluster_layout import NODE_TAG, REPO, Layout, SimError, log
from sim.cluster_network import running_containers

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


# --- mounts ----------------------------------------------------------------------------------------


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
