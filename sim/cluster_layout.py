"""The simulated cluster's fixed facts and where its state lives (stdlib only, as sim/cluster.py).

The addresses, ports and image names of the sim, the Debian package of each command it runs, `Layout` (every
path of the sim under its state directory) and `default_layout`, and the small helpers all of sim/cluster.py's
modules share: `SimError`, `log`, finding a command (`which`, `tool`) and `write_if_changed`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
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

    @staticmethod
    def data_root(i: int) -> Path:
        """Node i's docker data root, outside the work tree like the registry's storage: a node keeps the images
        it pulled across clones, as a Spark keeps its own (a fresh clone's first real-vLLM up does not pull ~6 GB
        onto every node again). `up` removes what a previous run left in it but the images (cluster.reset_node)."""
        return cache_dir() / "sim" / "nodes" / f"node-{i}"

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


def cache_dir() -> Path:
    """What the sim keeps between clones: base tarballs, the registry's storage, the nodes' docker data roots."""
    return Path(os.environ.get("DSV41_CACHE") or Path.home() / ".cache" / "dsv41-exl3")


def default_layout() -> Layout:
    return Layout(state=Path(os.environ.get("SIM_STATE_DIR") or REPO / ".state" / "sim").resolve())


# --- commands and files ----------------------------------------------------------------------------


def which(cmd: str) -> str | None:
    return shutil.which(cmd, path=f"{os.environ.get('PATH', '')}:{SBIN_PATH}")


def tool(cmd: str) -> str:
    path = which(cmd)
    if path is None:
        raise SimError(f"{cmd} not found; install Debian package {PACKAGES.get(cmd, cmd)} (make sim-up does, as root)")
    return path


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
