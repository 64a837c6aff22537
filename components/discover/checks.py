"""Discovery's node checks: memory, the weights root and its disk, docker access, the GPU, the NFS server and sudo
on the head, and containers a stack left. Runs on the operator's machine, on the probe's report."""

from __future__ import annotations

from dataclasses import dataclass

from components.discover.findings import EXPORT_COMMANDS, GIB_KIB, SUDOERS_FILE, WEIGHTS_DIR, Finding, Undecided
from components.discover.parse import Probe

# --- memory, disk, docker, GPU, NFS, leftovers ------------------------------------------------------------------


def decide_memory(probe: Probe, min_gib: float) -> Finding:
    kib = probe.mem_available_kib
    if kib is None:
        return Finding(warnings=(f"MemAvailable not read ({probe.unavailable.get('meminfo', 'no meminfo')})",))
    gib = kib / GIB_KIB
    if gib >= min_gib:
        return Finding(found=(f"memory: MemAvailable {gib:.1f} GiB (preflight needs {min_gib:g} GiB)",))
    return Finding(
        found=(f"memory: MemAvailable {gib:.1f} GiB",),
        warnings=(
            f"MemAvailable {gib:.1f} GiB is below preflight.minMemAvailableGiB {min_gib:g}: the up refuses this node "
            "until it has that much; a busy node must be idle before the up (what holds memory: `docker ps`, "
            "`ps aux --sort=-rss | head`)",
        ),
    )


@dataclass(frozen=True)
class Root:
    """The proposed `weights.root` and the one command that makes it, if one is needed."""

    root: str | None
    create: str | None = None
    finding: Finding = Finding()


def decide_disk(probe: Probe, user: str, *, head: bool, min_gib: float) -> Root:
    """The candidate with the most free space (the first listed of equals: /srv, /opt, /var/lib, then $HOME).

    /srv before the home on a tie: staging writes the root as the SSH user, but with `share: nfs` every directory
    above the root must be o+x, which an Ubuntu home (0750) is not. The home itself is never proposed."""
    if probe.disk is None:
        reason = probe.unavailable.get("disk", "not read")
        if head:
            return Root(
                None,
                finding=Finding(
                    undecided=(Undecided("weights.root", f"disk not read ({reason})", "check `df -P -k` on the head"),)
                ),
            )
        return Root(None, finding=Finding(warnings=(f"disk not read ({reason})",)))
    measured = [c for c in probe.disk.candidates if c.available_kib is not None]
    if not measured:
        what = "no candidate weights root could be measured (/srv, /opt, /var/lib, $HOME)"
        if head:
            return Root(
                None, finding=Finding(undecided=(Undecided("weights.root", what, "check `df -P -k` on the head"),))
            )
        return Root(None, finding=Finding(warnings=(what,)))
    best = max(measured, key=lambda c: c.available_kib or 0)  # max keeps the first of equals
    free = (best.available_kib or 0) / GIB_KIB
    home = probe.user.home if probe.user else ""
    at_home = bool(home) and best.path == home
    shown = "~" if at_home else best.path
    where = f"{shown}: {free:.1f} GiB free ({best.fstype} on {best.filesystem}, mounted at {best.mount})"
    if not head:
        return Root(
            None, finding=Finding(found=(f"disk: most free at {where}; a worker needs it only with `share: copy`",))
        )
    if free < min_gib:
        return Root(
            None,
            finding=Finding(
                found=(f"disk: most free at {where}",),
                undecided=(
                    Undecided(
                        "weights.root",
                        f"no candidate root has preflight.minFreeDiskGiB {min_gib:g} GiB free (most: {where})",
                        "free space or mount a larger disk, then set weights.root to a directory on it",
                    ),
                ),
            ),
        )
    if at_home:
        root = f"~/{WEIGHTS_DIR}"
        return Root(
            root,
            finding=Finding(
                found=(
                    f"disk: most free at {where}: enough for the weights ({min_gib:g} GiB)",
                    f"weights.root: {root} (staging creates it; with `share: nfs` the home must be o+x: `chmod o+x ~`)",
                )
            ),
        )
    root = f"{best.path.rstrip('/')}/{WEIGHTS_DIR}"
    create = f"sudo install -d -o {user} -m 0755 {root}"
    return Root(
        root,
        create,
        Finding(
            found=(
                f"disk: most free at {where}: enough for the weights ({min_gib:g} GiB)",
                f"weights.root: {root}; create it first: {create}",
            )
        ),
    )


def decide_docker(probe: Probe, user: str) -> Finding:
    d = probe.docker
    if d is None:
        reason = probe.unavailable.get("docker", "not read")
        return Finding(
            undecided=(
                Undecided(
                    "user",
                    f"docker is not usable on this node ({reason})",
                    "install Docker and the NVIDIA Container Toolkit (DGX OS ships both)",
                ),
            )
        )
    if not d.usable:
        said = d.errors[0] if d.errors else f"docker info exited {d.exit_code}"
        lowered = said.lower()
        if "permission denied" in lowered:
            fix = (
                f"`sudo usermod -aG docker {user}`, then log in again (a new SSH connection; this tool's shared one "
                "closes 2 minutes after it ends)"
            )
        elif "cannot connect" in lowered or "is the docker daemon running" in lowered:
            fix = "start the daemon: `sudo systemctl enable --now docker`"
        else:
            fix = f"run `docker info` as {user} on the node and fix what it says"
        return Finding(undecided=(Undecided("user", f"docker is not usable by {user}: {said}", fix),))
    runtimes = ", ".join(d.runtimes) or "none listed"
    found = (f"docker: server {d.server_version}, usable by {user}; runtimes: {runtimes}",)
    if "nvidia" in d.runtimes:
        return Finding(found=found)
    return Finding(
        found=found,
        warnings=(
            "docker lists no `nvidia` runtime: `gpus: all` needs the NVIDIA Container Toolkit (`sudo nvidia-ctk "
            "runtime configure --runtime=docker && sudo systemctl restart docker`)",
        ),
    )


def decide_gpu(probe: Probe) -> Finding:
    g = probe.gpu
    if g is None:
        return Finding(warnings=(f"GPU not checked ({probe.unavailable.get('gpu', 'not read')})",))
    if g.gpus:
        return Finding(found=tuple(f"gpu: {line}" for line in g.gpus))
    said = g.said or f"nvidia-smi -L exited {g.exit_code}"
    return Finding(
        undecided=(
            Undecided(
                "gpus",
                f"nvidia-smi lists no GPU ({said})",
                "check the NVIDIA driver (`nvidia-smi`); reboot after an update",
            ),
        )
    )


def decide_nfs(probe: Probe, user: str) -> Finding:
    """The head, for `share: nfs`: nfs-kernel-server installed, and root or `sudo -n` for what the export runs."""
    found: list[str] = []
    warnings: list[str] = []
    undecided: list[Undecided] = []
    copy = "or `share: copy` (each worker keeps its own copy; no NFS)"
    if probe.nfs is None:
        warnings.append(
            f"nfs-kernel-server not checked ({probe.unavailable.get('nfs', 'not read')}): `share: nfs` needs an NFS "
            "server on the head"
        )
    elif probe.nfs.installed:
        found.append("nfs: nfs-kernel-server installed")
    else:
        undecided.append(
            Undecided(
                "weights.share",
                f"nfs-kernel-server is not installed on the head (dpkg: {probe.nfs.status or 'no status'})",
                f"`sudo apt-get install nfs-kernel-server`, {copy}",
            )
        )
    sudoers = (
        f"`{user} ALL=(root) NOPASSWD: {', '.join(EXPORT_COMMANDS)}` in {SUDOERS_FILE} (`sudo visudo -f "
        f"{SUDOERS_FILE}`; those tools can write any file as root: a user who should not be root uses `share: copy`)"
    )
    if probe.user is not None and probe.user.uid == 0:
        found.append("sudo: not needed (root)")
    elif probe.sudo is None:
        undecided.append(
            Undecided(
                "weights.share",
                f"the export runs exportfs as root, and {user} is not root "
                f"({probe.unavailable.get('sudo', 'no sudo')})",
                f"install sudo and add {sudoers}, {copy}",
            )
        )
    elif probe.sudo.sudo_true == 0:
        found.append("sudo: `sudo -n` allowed (no password)")
    else:
        listed = dict(probe.sudo.listed)
        refused = [c for c in EXPORT_COMMANDS if listed.get(c, 1) != 0]
        if refused:
            undecided.append(
                Undecided(
                    "weights.share",
                    f"`sudo -n` is refused for {', '.join(refused)} (the export runs them as root)",
                    f"add {sudoers}",
                )
            )
        else:
            found.append(f"sudo: `sudo -n` allowed for {', '.join(c.rsplit('/', 1)[-1] for c in EXPORT_COMMANDS)}")
    return Finding(tuple(found), tuple(warnings), tuple(undecided))


def decide_leftovers(probe: Probe) -> Finding:
    left = probe.leftovers
    if left is None or left.exit_code != 0:
        return Finding()  # no docker: decide_docker already says so
    if not left.containers:
        return Finding(found=("leftovers: no container of any stack",))
    names = " ".join(c.name for c in left.containers)
    listed = ", ".join(f"{c.name} ({c.status}; stack {c.stack or '?'})" for c in left.containers)
    return Finding(
        warnings=(
            f"containers left by a stack: {listed}; `pulumi up` stops this stack's own, another stack's keep the GPU. "
            f"Only if you mean to remove them: `docker rm -f {names}` (or `pulumi destroy` of their stack)",
        )
    )


# --- what `dsv41-exl3 doctor` asks besides (the same probe, the same report) --------------------------------------

# Copy-on-write drivers: an image's layers are stored once. `vfs` copies every layer in full (the 22.5 GiB serving
# image several times over) and is what docker falls back to when overlay is not supported by the filesystem.
COW_DRIVERS = ("overlay2", "overlayfs", "btrfs", "zfs", "fuse-overlayfs", "io.containerd.snapshotter.v1")
NO_LOGIN = ("nologin", "false")


def decide_storage_driver(probe: Probe) -> Finding:
    d = probe.docker
    if d is None or not d.usable:
        return Finding()  # decide_docker says why
    driver = d.storage_driver
    if driver is None:
        return Finding(warnings=("docker's storage driver not reported (`docker info` has no Driver)",))
    if driver in COW_DRIVERS:
        return Finding(found=(f"storage driver: {driver}",))
    return Finding(
        warnings=(
            f"docker's storage driver is {driver}: every layer of the 22.5 GiB serving image is copied in full, and "
            "an extract can take longer than the pull; put /var/lib/docker on ext4 or xfs so docker uses overlay2 "
            "(`docker info | grep -i 'storage driver'`)",
        )
    )


def decide_memfree(probe: Probe, min_gib: float) -> Finding:
    """MemFree against the preflight floor: page cache counts as available, but the GB10 driver does not reclaim it
    by itself (docs/hardware.md), so a node full of the weights' cache passes MemAvailable and fails its load."""
    free, available = probe.mem_free_kib, probe.mem_available_kib
    if free is None:
        return Finding(warnings=(f"MemFree not read ({probe.unavailable.get('memfree', 'no meminfo')})",))
    gib = free / GIB_KIB
    if gib >= min_gib:
        return Finding(found=(f"memory: MemFree {gib:.1f} GiB (preflight needs {min_gib:g} GiB)",))
    cache = f", MemAvailable {available / GIB_KIB:.1f} GiB" if available is not None else ""
    return Finding(
        warnings=(
            f"MemFree {gib:.1f} GiB{cache} is below preflight.minMemAvailableGiB {min_gib:g}: the difference is "
            "mostly page cache, which the GB10 driver does not give back to a CUDA allocation by itself; before "
            "the up: `sync; echo 3 | sudo tee /proc/sys/vm/drop_caches`",
        )
    )


def decide_login_shell(probe: Probe) -> Finding:
    u = probe.user
    if u is None or u.shell is None:
        return Finding(warnings=("login shell not read (no getent on the node)",))
    if not u.shell or u.shell.rsplit("/", 1)[-1] in NO_LOGIN:
        return Finding(
            undecided=(
                Undecided(
                    "nodes[].user",
                    f"{u.name}'s login shell is {u.shell or 'empty'}: ssh runs no command as {u.name}",
                    f"`sudo chsh -s /bin/bash {u.name}`, or give nodes[].user a user that can log in",
                ),
            )
        )
    return Finding(found=(f"login shell: {u.shell}",))


def decide_nfs_server(probe: Probe) -> Finding:
    """The head, for `share: nfs`: the server running (installed is decide_nfs's)."""
    server = probe.nfs_server
    if server is None:
        return Finding(warnings=(f"nfs-server not checked ({probe.unavailable.get('nfsserver', 'not read')})",))
    if server.active:
        return Finding(found=("nfs-server: active",))
    return Finding(
        undecided=(
            Undecided(
                "weights.share",
                f"nfs-server is {server.state} on the head: the export would fail after staging",
                "`sudo systemctl enable --now nfs-server`, or `share: copy`",
            ),
        )
    )
