"""The per-node preflight: renders preflight.sh (beside this file), run on a node over SSH, and parses its output.

Pure logic: no resources. Every pass/fail decision is made by the script ON THE NODE, so a
refusal exits non-zero and the remote command records nothing (the next `up` checks
again); see components/preflight/gid.py for why the GID decision lives there too. The program only
parses the one JSON line the script prints on success.

What the script does, in order (all problems are reported together, not the first only):
1. docker reachable;
   head only: the head's address (`nodes[0].host` as the operator's machine resolved it,
   components/access/addresses.py) is one of the node's own (`ip route get` says `local`): Prometheus, the
   supervisor's second listener and the endpoint's clients use it, and a listener cannot bind another machine's;
2. no enabled user systemd unit that starts vllm, sglang or ray (recipe gotcha 4);
3. no container of anyone else holding the GPU or /dev/infiniband;
4. head only: free disk at the weights root plus what is already staged there;
   with the NFS share, every existing directory from / down to the weights root (and its model/,
   engram-src/ and engram-vllm/) traversable by others (o+x): the workers mount the export with root squashed,
   and Ubuntu 24.04 creates home directories 0750, so the mount would fail after hours of staging;
5. RDMA: /dev/infiniband exists, each HCA's port is ACTIVE, and the RoCE v2 GID index;
6. this stack's own running containers (label dsv41-exl3.stack=<stack label>) of another generation: they hold
   ~113 GiB of unified memory, so the memory check below would refuse every update. They are stopped only in the
   stop phase (`stop`), and only when nothing above refused; the check phase leaves them serving;
7. MemAvailable (never "used") >= the minimum, waiting a bounded time after a stop for the memory to come
   back; skipped while the old containers still serve (the stop phase checks it).

Each node runs the script twice on an update that replaces its container: the check phase as soon as the node is
reachable (a refusal fails the update in seconds, the old ranks still serving), the stop phase once every node
holds the image and passed its check phase, so an image change keeps serving while the new image downloads.

Paths are overridable through env variables (tests point them at fixture trees); the
defaults are the real ones and the Pulumi args never carry them.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os.path
from dataclasses import dataclass, field
from typing import Any

from components import labels, scripts
from components.access.addresses import Addresses
from components.config import Node, Settings
from components.preflight.gid import GidWanted, check_gid_wanted, check_hca_name, ipv4_mapped_gid, render_gid_check

STACK_LABEL_KEY = labels.STACK_LABEL
CONFIG_LABEL_KEY = labels.CONFIG_LABEL
MEMINFO_ENV = "DSV41_MEMINFO"
DEV_ROOT_ENV = "DSV41_DEV_ROOT"

# One line per running container: name|gpu capabilities|device paths|this project's stack label.
# The label goes last: a label value may contain '|', a container name may not.
# What of a rank's container shape replaces it without moving the generation: docker inspect prints it, and
# container_shape() writes what this update asks for in the same form.
SHAPE_FORMAT = '{{.HostConfig.IpcMode}} {{range .HostConfig.Ulimits}}{{if eq .Name "memlock"}}{{.Hard}}{{end}}{{end}}'


def container_shape(ipc_mode: str, memlock_bytes: int) -> str:
    """The shape a rank container gets (container.ipcMode, container.memlockBytes), as SHAPE_FORMAT prints it."""
    return f"{ipc_mode} {memlock_bytes}"


INSPECT_FORMAT = (
    "{{.Name}}|"
    "{{range .HostConfig.DeviceRequests}}{{range .Capabilities}}{{range .}}{{.}} {{end}}{{end}}{{end}}|"
    "{{range .HostConfig.Devices}}{{.PathOnHost}} {{end}}|"
    f'{{{{index .Config.Labels "{STACK_LABEL_KEY}"}}}}'
)

# Seconds the `timeout` wrapper adds after the deadline before it sends SIGKILL.
_KILL_AFTER_S = 10
# What the script needs beyond the stop and the memory wait: docker calls, systemctl, du, sysfs.
_CHECKS_BUDGET_S = 30


@dataclass(frozen=True, kw_only=True)
class OwnAddress:
    """An address the program binds listeners to on this node, to be checked as the node's own."""

    key: str
    """The config key it comes from, e.g. `nodes[0].host`: what a refusal names."""
    host: str
    """The key's value (a name, or the address itself)."""
    address: str
    """The IP address the program renders (`host` resolved on the operator's machine)."""


@dataclass(frozen=True, kw_only=True)
class PreflightSpec:
    """Everything the script needs, as plain values (no secrets: the script text is visible)."""

    node_name: str
    fabric_ip: str
    ib_hcas: tuple[str, ...]
    """RDMA devices NCCL will use on this node, e.g. ("rocep1s0f1",); empty: no RDMA checks."""
    gid_index: GidWanted
    """"auto" resolves the node's RoCE v2 index; an int is checked and refused if it moved."""
    check_rdma: bool
    """False where the node has no /dev/infiniband (the simulated cluster)."""
    min_mem_available_gib: float
    weights_root: str | None
    """Head only: where weights are staged; its free disk plus what is staged is checked."""
    min_free_disk_gib: float | None
    stack_label: str
    """Value of label dsv41-exl3.stack on this stack's own containers: those are stopped, others never."""
    generation: str
    """Config generation the update asks for: own containers already on it are left running."""
    container_shape: str
    """container_shape() of this update: an own container on the generation but of another shape is stopped."""
    check_export_path: bool
    """Head with the NFS share: every directory on the weights root's path must be o+x."""
    own_address: OwnAddress | None
    """The head: the address its listeners bind, which must be local to it; None on the workers."""
    fabric_interface: str = ""
    """The node's fabric interface: its rx bytes are one of the stall rule's signals, so it must have them; empty:
    not checked."""
    stop: bool = True
    """The stop phase (stop this stack's containers of another generation, then check memory); False: the check
    phase, which leaves them serving."""
    report: bool = False
    """`dsv41-exl3 doctor`: the check phase reporting every check's result and exiting 0 (parse_report)."""
    # The bounds below are the preflight's own steps, not operator settings (no config key): tests shorten them.
    command_timeout_s: int = 120
    stop_timeout_s: int = 30
    """docker stop -t: seconds this stack's containers get to exit before SIGKILL."""
    mem_settle_s: int = 45
    """After a stop, how long to wait for MemAvailable to climb back over the minimum."""
    docker_timeout_s: int = 20
    """Bound on each docker / systemctl call, so a wedged daemon is named instead of timing out silently."""

    def __post_init__(self) -> None:
        errors: list[str] = []

        def check(ok: bool, message: str) -> None:
            if not ok:
                errors.append(message)

        # Invariants: components/config refuses an empty name, a fabricIp that is not IPv4, a gidIndex out of range,
        # an ibHcas entry that is no device name, a negative or non-finite minimum and a relative weights root.
        # The checks stay because these values are rendered into a shell script.
        check(bool(self.node_name.strip()), "node_name is empty; give the node's name as in the cluster config")
        try:
            ipv4_mapped_gid(self.fabric_ip)
        except ValueError as e:
            errors.append(str(e))
        for hca in self.ib_hcas:
            try:
                check_hca_name(hca)
            except ValueError as e:
                errors.append(str(e))
        try:
            check_gid_wanted(self.gid_index)
        except ValueError as e:
            errors.append(str(e))
        check(
            not (self.check_rdma and not self.ib_hcas),
            f"node {self.node_name}: check_rdma is true but ib_hcas is empty; list the node's ACTIVE "
            'HCAs (e.g. ["rocep1s0f1"]) or set check_rdma false',
        )
        check(
            math.isfinite(self.min_mem_available_gib) and self.min_mem_available_gib >= 0,
            f"min_mem_available_gib {self.min_mem_available_gib!r} must be a non-negative number of GiB (e.g. 111.5)",
        )
        check(
            (self.weights_root is None) == (self.min_free_disk_gib is None),
            f"weights_root {self.weights_root!r} and min_free_disk_gib {self.min_free_disk_gib!r} go together: "
            "set both on the head, neither on a worker",
        )
        if self.weights_root is not None:
            root = self.weights_root
            check(
                os.path.isabs(root) or root == "~" or root.startswith("~/"),
                f"weights_root {root!r} must be an absolute path or start with ~/ (the SSH user's home)",
            )
        check(
            not (self.check_export_path and self.weights_root is None),
            "check_export_path needs weights_root: the NFS export lives under it (head only)",
        )
        if self.min_free_disk_gib is not None:
            check(
                math.isfinite(self.min_free_disk_gib) and self.min_free_disk_gib >= 0,
                f"min_free_disk_gib {self.min_free_disk_gib!r} must be a non-negative number of GiB",
            )
        check(not (self.report and self.stop), "report runs the check phase only: set stop False with report")
        check(bool(self.stack_label), "stack_label is empty; it must match the label on this stack's containers")
        if self.own_address is not None:
            try:
                ipaddress.ip_address(self.own_address.address)
            except ValueError:
                errors.append(
                    f"own_address {self.own_address.address!r} ({self.own_address.key}) must be an IP address: "
                    "resolve the name first (components/access/addresses.py)"
                )
        for name in ("stop_timeout_s", "mem_settle_s", "docker_timeout_s"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"{name} {value!r} must be a positive integer of seconds")
        needed = self.stop_timeout_s + self.mem_settle_s + _CHECKS_BUDGET_S
        check(
            self.command_timeout_s >= needed,
            f"command_timeout_s {self.command_timeout_s} is shorter than stop_timeout_s + mem_settle_s + "
            f"{_CHECKS_BUDGET_S} = {needed}; raise it to at least {needed}",
        )
        if errors:
            raise ValueError(f"preflight for node {self.node_name!r}: " + "; ".join(errors))


def node_spec(s: Settings, addresses: Addresses, stack: str, generation: str, n: Node) -> PreflightSpec:
    """What the preflight checks on node `n`: the program's two phases and `dsv41-exl3 doctor` (operator/doctor.py)
    run the same script from this one spec (the phase and `report` set by each)."""
    copy_mode = s.weights.share == "copy"
    own = addresses.of(n.name)
    return PreflightSpec(
        node_name=n.name,
        fabric_ip=n.fabric_ip,
        fabric_interface=n.fabric_interface,
        ib_hcas=tuple(n.ib_hcas),
        gid_index=n.gid_index,
        check_rdma=bool(n.rdma_devices and n.ib_hcas),
        # The head's includes the observability layer's bounds; each rank's start checks the same figure.
        min_mem_available_gib=s.min_mem_available_gib_of(n),
        # The head stages the weights; in copy mode each worker keeps its own copy: its disk is checked too.
        weights_root=s.weights.root if n is s.head else (s.copy_root_of(n) if copy_mode else None),
        min_free_disk_gib=s.preflight.min_free_disk_gib if n is s.head or copy_mode else None,
        # The workers' root-squashed NFS mount must traverse every directory down to the export.
        check_export_path=n is s.head and s.weights.share == "nfs",
        stack_label=stack,
        generation=generation,
        container_shape=container_shape(s.container.ipc_mode, s.container.memlock_bytes),
        # The head's listeners bind its address: it must be one of the head's own. A worker's is SSH's only.
        own_address=OwnAddress(key=own.key, host=own.host, address=own.address) if n is s.head else None,
    )


def render_script(spec: PreflightSpec) -> str:
    """preflight.sh for one node under its one-line header of quoted values."""
    return scripts.render(
        "preflight/preflight.sh",
        {
            "NODE": spec.node_name,
            "STACK_LABEL": spec.stack_label,
            "LABEL_KEY": STACK_LABEL_KEY,
            "CONFIG_LABEL_KEY": CONFIG_LABEL_KEY,
            "GENERATION": spec.generation,
            "STOP": "1" if spec.stop else "0",
            "REPORT": "1" if spec.report else "0",
            "SHAPE": spec.container_shape,
            "SHAPE_FORMAT": SHAPE_FORMAT,
            "INSPECT_FORMAT": INSPECT_FORMAT,
            "MIN_MEM": f"{spec.min_mem_available_gib:g}",
            "WEIGHTS_ROOT": spec.weights_root or "",
            "MIN_DISK": f"{spec.min_free_disk_gib:g}" if spec.min_free_disk_gib is not None else "",
            "CHECK_RDMA": "1" if spec.check_rdma else "0",
            "CHECK_EXPORT": "1" if spec.check_export_path else "0",
            "ADDRESS": spec.own_address.address if spec.own_address else "",
            "ADDRESS_KEY": spec.own_address.key if spec.own_address else "",
            "ADDRESS_HOST": spec.own_address.host if spec.own_address else "",
            "HCAS": " ".join(spec.ib_hcas),
            "FABRIC_IF": spec.fabric_interface,
            "STOP_TIMEOUT_S": spec.stop_timeout_s,
            "MEM_SETTLE_S": spec.mem_settle_s,
            "DOCKER_TIMEOUT_S": spec.docker_timeout_s,
        },
    )


def wrap_in_timeout(script: str, timeout_s: int, *args: str) -> str:
    """The remote command text: `sh -c script` under `timeout`, since Pulumi's timeouts do not stop it.

    `args` become the script's $1...; $0 names the script as its header does.
    """
    return scripts.sh_command(
        script, *args, timeout_s=timeout_s, kill_after_s=_KILL_AFTER_S, name="components/preflight/preflight.sh"
    )


def render_command(spec: PreflightSpec) -> str:
    """What the remote.Command runs on the node: preflight.sh, given the rendered gid_check.sh as $1."""
    gid = (
        [render_gid_check(hcas=spec.ib_hcas, fabric_ip=spec.fabric_ip, wanted=spec.gid_index)]
        if spec.check_rdma
        else []
    )
    return wrap_in_timeout(render_script(spec), spec.command_timeout_s, *gid)


@dataclass(frozen=True, kw_only=True)
class PreflightResult:
    """What the node reported after every check passed."""

    node: str
    mem_available_gib: float
    gid_index: int | None
    stopped: tuple[str, ...] = field(default_factory=tuple)
    findings: tuple[str, ...] = field(default_factory=tuple)


def _str_list(obj: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = obj.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: field {key!r} is {value!r}, expected a list of strings")
    return tuple(value)


def parse_output(stdout: str, spec: PreflightSpec) -> PreflightResult:
    """Parse the script's last stdout line; raise a one-line error naming the node if it is malformed."""
    where = f"preflight output of node {spec.node_name}"
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{where} is empty; fix: run the preflight by hand on the node and read its stderr")
    last = lines[-1]
    try:
        obj = json.loads(last)
    except json.JSONDecodeError:
        raise ValueError(f"{where} does not end in a JSON line (last line: {last[:200]!r})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {last[:200]!r}")
    mem = obj.get("mem_available_gib")
    if isinstance(mem, bool) or not isinstance(mem, int | float):
        raise ValueError(f"{where}: mem_available_gib is {mem!r}, expected a number")
    gid = obj.get("gid_index")
    if gid is not None and (isinstance(gid, bool) or not isinstance(gid, int)):
        raise ValueError(f"{where}: gid_index is {gid!r}, expected an integer or null")
    node = obj.get("node")
    if node != spec.node_name:
        raise ValueError(f"{where} names node {node!r}; the command ran on the wrong host")
    # Guards that the script and the program agree; the decisions themselves were made on the node.
    if spec.check_rdma and gid is None:
        raise ValueError(f"{where} has no gid_index although check_rdma is true")
    if not spec.check_rdma and gid is not None:
        raise ValueError(f"{where} has gid_index {gid} although check_rdma is false")
    if isinstance(spec.gid_index, int) and spec.check_rdma and gid != spec.gid_index:
        raise ValueError(f"{where} reports gid_index {gid}, configured {spec.gid_index}")
    return PreflightResult(
        node=node,
        mem_available_gib=float(mem),
        gid_index=gid,
        stopped=_str_list(obj, "stopped", where),
        findings=_str_list(obj, "findings", where),
    )


def format_report(result: PreflightResult, spec: PreflightSpec) -> str:
    """One human line for the stack output."""
    parts = [f"{result.mem_available_gib:.1f} GiB MemAvailable (need {spec.min_mem_available_gib:g})"]
    if result.gid_index is not None:
        how = "resolved" if spec.gid_index == "auto" else "checked"
        parts.append(f"RoCE v2 GID index {result.gid_index} ({how}) on {' '.join(spec.ib_hcas)}")
    else:
        parts.append("RDMA not checked")
    if result.stopped:
        parts.append(f"stopped {' '.join(result.stopped)}")
    return f"preflight {result.node}: ok: " + "; ".join(parts)


@dataclass(frozen=True)
class CheckResult:
    """One check of the script on one node, as `dsv41-exl3 doctor` shows it."""

    check: str
    """The script's step id (`docker`, `disk`, `rdma`, `memory`, ...)."""
    ok: bool
    details: tuple[str, ...]
    """What the node said: the refusals (each with its fix) when not ok, else its findings."""


def parse_report(stdout: str, spec: PreflightSpec) -> list[CheckResult]:
    """Every check the script ran with REPORT=1, in its order; a one-line ValueError on a malformed output."""
    where = f"preflight report of node {spec.node_name}"
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{where} is empty; fix: run the preflight by hand on the node and read its stderr")
    try:
        obj = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise ValueError(f"{where} does not end in a JSON line (last line: {lines[-1][:200]!r})") from None
    if not isinstance(obj, dict) or obj.get("node") != spec.node_name:
        raise ValueError(f"{where} is not this node's report: {lines[-1][:200]!r}")
    order: list[str] = []
    said: dict[str, list[str]] = {}
    failed: set[str] = set()
    for entry in _str_list(obj, "results", where):
        check, status, text = (entry.split("|", 2) + ["", ""])[:3]
        if not check or status not in ("ok", "fail"):
            raise ValueError(f"{where}: result {entry[:200]!r} is not check|ok|text or check|fail|text")
        if check not in said:
            order.append(check)
            said[check] = []
        if status == "fail":
            if check not in failed:  # a refusal replaces what the check noted before it
                said[check] = []
            failed.add(check)
        if text and (status == "fail" or check not in failed):
            said[check].append(text)
    return [CheckResult(check=c, ok=c not in failed, details=tuple(said[c])) for c in order]
