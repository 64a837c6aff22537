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
The image's base root filesystem, the registry's storage and each node's docker data root (its pulled images) are
cached in ${DSV41_CACHE:-~/.cache/dsv41-exl3}/sim and never deleted here.

The commands are here; what they use is in the modules beside this one: cluster_layout (the sim's facts
and paths), cluster_procs (processes, cgroups, the power cut), cluster_network (probes, node names),
cluster_images (the images and the registry) and cluster_daemons (the daemons, keys and a node's reboot).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from sim.cluster_daemons import (
    data_root_holder,
    ensure_keys,
    ensure_packages,
    reboot,
    require_root,
    sshd_config,
    start_dockerd,
    start_hub,
    start_registry,
    start_sshd,
    wait_ready,
)
from sim.cluster_images import build_image, image_ref, registry_digest
from sim.cluster_layout import (
    DEFAULT_NODES,
    HUB_ADDR,
    IMAGES,
    MAX_NODES,
    NODE_TAG,
    REGISTRY_ADDR,
    SSH_PORT,
    Layout,
    SimError,
    default_layout,
    log,
    tool,
)
from sim.cluster_network import (
    HOSTS_BEGIN,
    HOSTS_END,
    docker_ping,
    http_ok,
    machine_hosts,
    node_hosts,
    tcp_open,
    write_machine_hosts,
)
from sim.cluster_procs import (
    cgroup2_root,
    daemon_env,
    descendants,
    pid_alive,
    power_cut,
    running_pid,
    stop_pid,
    unmount_leftovers,
    wait_until,
)

# The commands below, and what the end-to-end tests (tests/integration) reach as `cluster.<name>` from the
# modules above.
__all__ = [
    "clean",
    "describe",
    "down",
    "env_text",
    "image",
    "main",
    "node_index",
    "remove_containers",
    "reset_node",
    "start_nodes",
    "status",
    "up",
    "up_nodes",
    "HOSTS_BEGIN",
    "HOSTS_END",
    "Layout",
    "NODE_TAG",
    "SSH_PORT",
    "cgroup2_root",
    "daemon_env",
    "data_root_holder",
    "default_layout",
    "descendants",
    "image_ref",
    "machine_hosts",
    "node_hosts",
    "pid_alive",
    "power_cut",
    "reboot",
    "registry_digest",
    "running_pid",
    "sshd_config",
    "start_dockerd",
    "stop_pid",
    "SimError",
]


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


def start_nodes(layout: Layout, indices: Sequence[int]) -> list[int]:
    """As root, with the Debian packages installed: these nodes' directories, ssh keys (and every keyed node's
    known_hosts and config entries) and names, then each one's dockerd and sshd (not waited for). Returns the
    nodes whose dockerd it started (the others were running and are left as they are)."""
    require_root()
    ensure_packages()
    for i in indices:
        layout.node_dir(i).mkdir(parents=True, exist_ok=True)
    ensure_keys(layout, indices)
    write_machine_hosts(True)
    started = []
    for i in indices:
        if start_dockerd(layout, i):
            started.append(i)
        start_sshd(layout, i)
    return started


def reset_node(layout: Layout, i: int) -> None:
    """A node `up` started: what an earlier run left in its (cached) data root goes, but the images. Containers
    with a restart policy came back with the daemon, as after a reboot; an `up` is a fresh cluster, not a reboot."""
    remove_containers(layout, i)
    host, docker = layout.docker_host(i), tool("docker")

    def listed(*what: str) -> list[str]:
        out = subprocess.run([docker, "--host", host, *what], capture_output=True, text=True, timeout=60)
        return out.stdout.split() if out.returncode == 0 else []

    volumes = listed("volume", "ls", "-q")
    if volumes:
        subprocess.run([docker, "--host", host, "volume", "rm", "-f", *volumes], capture_output=True, timeout=120)
    networks = listed("network", "ls", "-q", "--filter", "type=custom")
    if networks:
        subprocess.run([docker, "--host", host, "network", "rm", *networks], capture_output=True, timeout=120)
    # Builds replaced under the same tag (cluster_images.build_image untags them): the disk is not the cache's.
    subprocess.run([docker, "--host", host, "image", "prune", "-f"], capture_output=True, timeout=300)
    if volumes or networks:
        log(f"node {i}: removed {len(volumes)} volume(s), {len(networks)} network(s) an earlier run left")


def up(layout: Layout, nodes: int, build: bool = True) -> None:
    if not 1 <= nodes <= MAX_NODES:
        raise SimError(f"SIM_NODES={nodes} out of range; use 1..{MAX_NODES} (default {DEFAULT_NODES})")
    indices = list(range(1, nodes + 1))
    started = start_nodes(layout, indices)
    start_registry(layout)
    start_hub(layout)
    wait_ready(layout, indices)
    for i in started:
        reset_node(layout, i)
    (layout.state / "sim.json").write_text(json.dumps(describe(layout, indices), indent=2) + "\n")
    if build:
        build_image(layout)
    log(f"up: {nodes} node(s); `python3 -m sim.cluster env` prints how to reach them")


def up_nodes(layout: Layout, indices: Sequence[int]) -> None:
    """Start only these nodes (dockerd + sshd), e.g. an extra node beside a running sim; the registry, the hub,
    the image and sim.json are left as they are (a node pulls from whichever registry serves 127.0.0.1:5000)."""
    started = start_nodes(layout, indices)
    wait_ready(layout, indices, with_registry=False)
    for i in started:
        reset_node(layout, i)
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
    """down, then delete the state dir (keys, sockets, logs); the cache stays (base tarballs, the registry's
    storage, the nodes' docker data roots: cache_dir())."""
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
