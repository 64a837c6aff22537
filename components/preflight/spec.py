"""The per-node preflight: the POSIX sh script run on a node over SSH, and the parser of its output.

Pure logic: no resources. Every pass/fail decision is made by the script ON THE NODE, so a
refusal exits non-zero and the remote command records nothing (the next `up` checks
again); see components/preflight/gid.py for why the GID decision lives there too. The program only
parses the one JSON line the script prints on success.

What the script does, in order (all problems are reported together, not the first only):
1. docker reachable;
2. stop this stack's own running containers (label dsv41-exl3.stack=<stack label>): they
   hold ~113 GiB of unified memory and the memory check below would refuse every update;
3. MemAvailable (never "used") >= the minimum, waiting a bounded time after a stop for the
   memory to come back;
4. no enabled user systemd unit that starts vllm, sglang or ray (recipe gotcha 4);
5. no container of anyone else holding the GPU or /dev/infiniband;
6. head only: free disk at the weights root plus what is already staged there;
   with the NFS share, every existing directory from / down to the weights root (and its model/
   and engram-src/) traversable by others (o+x): the workers mount the export with root squashed,
   and Ubuntu 24.04 creates home directories 0750, so the mount would fail after hours of staging;
7. RDMA: /dev/infiniband exists, each HCA's port is ACTIVE, and the RoCE v2 GID index.

Paths are overridable through env variables (tests point them at fixture trees); the
defaults are the real ones and the Pulumi args never carry them.
"""

from __future__ import annotations

import json
import math
import os.path
import shlex
from dataclasses import dataclass, field
from typing import Any

from components import labels
from components.preflight.gid import GidWanted, check_gid_wanted, check_hca_name, ipv4_mapped_gid, render_gid_check

STACK_LABEL_KEY = labels.STACK_LABEL
CONFIG_LABEL_KEY = labels.CONFIG_LABEL
MEMINFO_ENV = "DSV41_MEMINFO"
DEV_ROOT_ENV = "DSV41_DEV_ROOT"

# One line per running container: name|gpu capabilities|device paths|this project's stack label.
# The label goes last: a label value may contain '|', a container name may not.
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
class PreflightSpec:
    """Everything the script needs, as plain values (no secrets: the script text is visible)."""

    node_name: str
    fabric_ip: str
    ib_hcas: tuple[str, ...]
    gid_index: GidWanted
    check_rdma: bool
    min_mem_available_gib: float
    weights_root: str | None
    min_free_disk_gib: float | None
    stack_label: str
    generation: str = ""
    check_export_path: bool = False
    """Head with the NFS share: every directory on the weights root's path must be o+x."""
    """Config generation the update asks for: own containers already on it are left running."""
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
        check(not (self.check_rdma and not self.ib_hcas),
              f"node {self.node_name}: check_rdma is true but ib_hcas is empty; list the node's ACTIVE "
              "HCAs (e.g. [\"rocep1s0f1\"]) or set check_rdma false")
        check(math.isfinite(self.min_mem_available_gib) and self.min_mem_available_gib >= 0,
              f"min_mem_available_gib {self.min_mem_available_gib!r} must be a non-negative number of GiB "
              "(e.g. 111.5)")
        check((self.weights_root is None) == (self.min_free_disk_gib is None),
              f"weights_root {self.weights_root!r} and min_free_disk_gib {self.min_free_disk_gib!r} go together: "
              "set both on the head, neither on a worker")
        if self.weights_root is not None:
            root = self.weights_root
            check(os.path.isabs(root) or root == "~" or root.startswith("~/"),
                  f"weights_root {root!r} must be an absolute path or start with ~/ (the SSH user's home)")
        check(not (self.check_export_path and self.weights_root is None),
              "check_export_path needs weights_root: the NFS export lives under it (head only)")
        if self.min_free_disk_gib is not None:
            check(math.isfinite(self.min_free_disk_gib) and self.min_free_disk_gib >= 0,
                  f"min_free_disk_gib {self.min_free_disk_gib!r} must be a non-negative number of GiB")
        check(bool(self.stack_label), "stack_label is empty; it must match the label on this stack's containers")
        for name in ("stop_timeout_s", "mem_settle_s", "docker_timeout_s"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"{name} {value!r} must be a positive integer of seconds")
        needed = self.stop_timeout_s + self.mem_settle_s + _CHECKS_BUDGET_S
        check(self.command_timeout_s >= needed,
              f"command_timeout_s {self.command_timeout_s} is shorter than stop_timeout_s + mem_settle_s + "
              f"{_CHECKS_BUDGET_S} = {needed}; raise it to at least {needed}")
        if errors:
            raise ValueError(f"preflight for node {self.node_name!r}: " + "; ".join(errors))


_SCRIPT_BODY = r"""
exec 3>&1 1>&2   # stdout carries only the final JSON line; everything else goes to stderr
LC_ALL=C; export LC_ALL   # a '.' decimal point in awk's numbers and English tool messages
MEMINFO="${DSV41_MEMINFO:-/proc/meminfo}"
DEVROOT="${DSV41_DEV_ROOT:-/dev}"
NL='
'
FAILURES=''
FINDINGS=''
STOPPED=''
CURRENT=''
GID_INDEX=''
fail() { FAILURES="$FAILURES$1$NL"; }
note() { FINDINGS="$FINDINGS$1$NL"; }
# Progress on stderr: when the outer timeout kills the script, the last line says where it was.
step() { echo "preflight $NODE: $1"; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 >= b + 0) }'; }
last_line() { printf '%s\n' "$1" | awk 'NF { l = $0 } END { print l }'; }

step "docker"
if out=$(timeout "$DOCKER_T" docker version --format '{{.Server.Version}}' 2>&1); then
  DOCKER_OK=1
  note "docker server $(last_line "$out")"
else
  DOCKER_OK=0
  fail "docker is not reachable ($(last_line "$out")); fix: start the daemon (sudo systemctl start docker)"\
" and let user $(id -un) use it (docker group), then re-run"
fi

if [ "$DOCKER_OK" = 1 ]; then
  step "stopping this stack's running containers (label $LABEL_KEY=$STACK_LABEL)"
  # plain `docker ps` lists running, restarting and paused containers: all of them hold memory
  if listed=$(timeout "$DOCKER_T" docker ps --filter "label=$LABEL_KEY=$STACK_LABEL" \
           --format "{{.ID}} {{.Names}} {{.Label \"$CONFIG_LABEL_KEY\"}}" 2>&1); then
    # A container already on the generation this update asks for is not being replaced: leave it
    # serving, and skip the memory check (a running deployment legitimately leaves ~5 GiB).
    own=$(printf '%s\n' "$listed" | awk -v g="$GENERATION" 'NF && (g == "" || $3 != g)')
    CURRENT=$(printf '%s\n' "$listed" | awk -v g="$GENERATION" 'NF && g != "" && $3 == g { print $2 }')
    if [ -n "$CURRENT" ]; then
      note "$(printf '%s' "$CURRENT" | tr '\n' ' ')already serves generation $GENERATION:"\
" left running, memory check skipped"
    fi
    if [ -n "$own" ]; then
      ids=$(printf '%s\n' "$own" | awk 'NF { print $1 }')
      names=$(printf '%s\n' "$own" | awk 'NF { printf "%s%s", (n++ ? " " : ""), $2 }')
      # shellcheck disable=SC2086 # ids are hex words
      if timeout $((STOP_T + DOCKER_T)) docker stop -t "$STOP_T" $ids >/dev/null; then
        STOPPED=$(printf '%s\n' "$own" | awk 'NF { print $2 }')
        note "stopped this stack's container(s): $names"
      else
        fail "could not stop this stack's container(s) $names; fix: run docker rm -f $names on $NODE, then re-run"
      fi
    fi
  else
    fail "docker ps failed ($(last_line "$listed")); fix: check the docker daemon on $NODE, then re-run"
  fi
fi

step "MemAvailable"
mem_gib() {  # kB in /proc/meminfo are KiB
  awk '$1 == "MemAvailable:" { printf "%.2f", $2 / 1048576; found = 1 } END { exit !found }' "$MEMINFO" 2>/dev/null
}
if MEM=$(mem_gib); then
  if [ -n "$STOPPED" ] && ! ge "$MEM" "$MIN_MEM"; then
    # the stopped containers' unified memory comes back over a few seconds
    deadline=$(( $(date +%s) + SETTLE_S ))
    while ! ge "$MEM" "$MIN_MEM" && [ "$(date +%s)" -lt "$deadline" ]; do
      sleep 1
      MEM=$(mem_gib) || break
    done
  fi
  if [ -z "$CURRENT" ] && ! ge "$MEM" "$MIN_MEM"; then
    fail "MemAvailable is $MEM GiB, below the required $MIN_MEM GiB; fix: stop what holds memory on $NODE"\
" (ps aux --sort=-rss | head; docker ps), or if it is page cache run as root:"\
" sync; echo 3 > /proc/sys/vm/drop_caches"
  fi
else
  MEM=''
  fail "cannot read MemAvailable from $MEMINFO; fix: this preflight needs a Linux /proc/meminfo"
fi

if command -v systemctl >/dev/null 2>&1; then
  step "user systemd units"
  if [ -z "${XDG_RUNTIME_DIR:-}" ] && [ -d "/run/user/$(id -u)" ]; then
    XDG_RUNTIME_DIR="/run/user/$(id -u)"; export XDG_RUNTIME_DIR
  fi
  if units=$(timeout "$DOCKER_T" systemctl --user list-unit-files --state=enabled --no-legend --no-pager 2>&1); then
    bad=$(printf '%s\n' "$units" | awk 'tolower($1) ~ /vllm|sglang|ray/ { printf "%s%s", (n++ ? " " : ""), $1 }')
    if [ -n "$bad" ]; then
      fail "enabled user systemd units would start a competing server: $bad; fix: systemctl --user disable --now $bad"
    fi
  else
    note "user systemd units not checked (systemctl --user: $(last_line "$units"))"
  fi
else
  note "user systemd units not checked (no systemctl)"
fi

if [ "$DOCKER_OK" = 1 ]; then
  step "other containers holding the GPU or RDMA devices"
  if running=$(timeout "$DOCKER_T" docker ps -q 2>&1); then
    if [ -n "$running" ]; then
      # shellcheck disable=SC2086 # ids are hex words
      if info=$(timeout "$DOCKER_T" docker inspect --format "$INSPECT_FORMAT" $running 2>&1); then
        holders=$(printf '%s\n' "$info" | OWN="$STACK_LABEL" awk -F'|' '
          NF >= 4 {
            label = $4; for (j = 5; j <= NF; j++) label = label "|" $j
            if (label == ENVIRON["OWN"]) next
            what = ""
            if ((" " $2) ~ / gpu( |$)/) what = "the GPU"
            if ($3 ~ /\/dev\/infiniband/) what = what (what == "" ? "" : " and ") "/dev/infiniband"
            name = $1; sub(/^\//, "", name)
            if (what != "") print name "\t" what
          }')
        while IFS="$(printf '\t')" read -r name what; do
          [ -n "$name" ] || continue
          fail "container $name (not of this stack) holds $what; fix: stop it (docker stop $name)"\
" or destroy the stack that owns it, then re-run"
        done <<EOF
$holders
EOF
      else
        fail "docker inspect failed ($(last_line "$info")); fix: check the docker daemon on $NODE, then re-run"
      fi
    fi
  else
    fail "docker ps failed ($(last_line "$running")); fix: check the docker daemon on $NODE, then re-run"
  fi
fi

case "$WEIGHTS_ROOT" in  # ~ means the SSH user's home on the node, as in the config
  "~") WEIGHTS_ROOT="$HOME" ;;
  "~/"*) WEIGHTS_ROOT="$HOME/${WEIGHTS_ROOT#"~/"}" ;;
esac
if [ -n "$WEIGHTS_ROOT" ]; then
  step "disk at $WEIGHTS_ROOT"
  d="$WEIGHTS_ROOT"
  while [ ! -e "$d" ]; do d=$(dirname "$d"); done
  free_k=$(df -Pk "$d" | awk 'NR == 2 { print $4 }')
  staged_k=0
  if [ -d "$WEIGHTS_ROOT" ]; then
    staged_k=$(timeout "$DOCKER_T" du -sk "$WEIGHTS_ROOT" 2>/dev/null | awk '{ print $1 }')
  fi
  if [ -z "$free_k" ] || [ -z "$staged_k" ]; then
    fail "cannot measure disk at $d (df/du failed); fix: check that $d is readable on $NODE"
  else
    disk=$(awk -v f="$free_k" -v s="$staged_k" \
      'BEGIN { printf "%.1f %.1f %.1f", f / 1048576, s / 1048576, (f + s) / 1048576 }')
    set -- $disk
    if ge "$3" "$MIN_DISK"; then
      note "disk: $1 GiB free at $d + $2 GiB staged in $WEIGHTS_ROOT"
    else
      fail "disk at $d has $1 GiB free + $2 GiB already staged in $WEIGHTS_ROOT = $3 GiB, below the"\
" required $MIN_DISK GiB; fix: free space on that filesystem or point weights_root at a larger disk"
    fi
  fi
fi

if [ -n "$WEIGHTS_ROOT" ] && [ "$CHECK_EXPORT" = 1 ]; then
  step "NFS export path under $WEIGHTS_ROOT traversable by others"
  # The workers' root is squashed to nobody on the export: it needs o+x on every directory of the
  # path. Checked from the leaves up; directories the staging has not created yet are skipped.
  paths=''
  for d in "$WEIGHTS_ROOT/model" "$WEIGHTS_ROOT/engram-src" "$WEIGHTS_ROOT"; do
    [ -d "$d" ] && paths="$paths$d$NL"
  done
  d=$(dirname "$WEIGHTS_ROOT")
  while :; do
    [ -d "$d" ] && paths="$paths$d$NL"
    [ "$d" = / ] && break
    d=$(dirname "$d")
  done
  while IFS= read -r d; do
    [ -n "$d" ] || continue
    perm=$(ls -ld "$d" 2>/dev/null | awk '{ print $1; exit }')
    case "$perm" in
      ?????????[xt]*) ;;
      '') fail "cannot read the mode of $d on the NFS export path; fix: check that $d exists and is readable" ;;
      *) fail "directory $d on the NFS export path of weights.root ($WEIGHTS_ROOT) is not traversable by"\
" others (mode $perm): the workers' root-squashed NFS mount cannot reach the export; fix: chmod o+x $d"\
" (or set weights.root outside a 0750 home directory)" ;;
    esac
  done <<EOF
$paths
EOF
fi

if [ "$CHECK_RDMA" = 1 ]; then
  step "RDMA: HCA ports and RoCE v2 GID index"
  [ -e "$DEVROOT/infiniband" ] || fail "$DEVROOT/infiniband does not exist; fix: load the RDMA driver"\
" (sudo modprobe mlx5_ib), or set check_rdma false for a node without RDMA"
  decision=$(gid_check)
  while IFS= read -r line; do
    case "$line" in
      "index "*) GID_INDEX=${line#index } ;;
      "fail "*) fail "${line#fail }" ;;
    esac
  done <<EOF
$decision
EOF
  if [ -z "$GID_INDEX" ] && [ -z "$FAILURES" ]; then
    fail "the GID check printed no decision; fix: run the preflight script by hand on $NODE and read its stderr"
  fi
  [ -n "$GID_INDEX" ] && note "RoCE v2 GID index $GID_INDEX on $HCAS"
fi

if [ -n "$FAILURES" ]; then
  printf '%s' "$FAILURES" | awk -v node="$NODE" 'NF { print "preflight refused on node " node ": " $0 }'
  exit 1
fi

json_list() {  # newline-separated values -> JSON array of strings
  printf '%s\n' "$1" | tr '\t\r' '  ' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' |
    awk 'NF { printf "%s\"%s\"", (n++ ? "," : ""), $0 } END { printf "" }'
}
node_json=$(json_list "$NODE")
printf '{"node":%s,"mem_available_gib":%s,"gid_index":%s,"stopped":[%s],"findings":[%s]}\n' \
  "$node_json" "$MEM" "${GID_INDEX:-null}" "$(json_list "$STOPPED")" "$(json_list "$FINDINGS")" >&3
"""


def render_script(spec: PreflightSpec) -> str:
    """The full POSIX sh script for one node; values are quoted, never interpolated raw."""
    values: dict[str, str] = {
        "NODE": spec.node_name,
        "STACK_LABEL": spec.stack_label,
        "LABEL_KEY": STACK_LABEL_KEY,
        "CONFIG_LABEL_KEY": CONFIG_LABEL_KEY,
        "GENERATION": spec.generation,
        "INSPECT_FORMAT": INSPECT_FORMAT,
        "MIN_MEM": f"{spec.min_mem_available_gib:g}",
        "WEIGHTS_ROOT": spec.weights_root or "",
        "MIN_DISK": f"{spec.min_free_disk_gib:g}" if spec.min_free_disk_gib is not None else "",
        "CHECK_RDMA": "1" if spec.check_rdma else "0",
        "CHECK_EXPORT": "1" if spec.check_export_path else "0",
        "HCAS": " ".join(spec.ib_hcas),
        "STOP_T": str(spec.stop_timeout_s),
        "SETTLE_S": str(spec.mem_settle_s),
        "DOCKER_T": str(spec.docker_timeout_s),
    }
    header = "\n".join(f"{k}={shlex.quote(v)}" for k, v in values.items())
    gid = (render_gid_check(hcas=spec.ib_hcas, fabric_ip=spec.fabric_ip, wanted=spec.gid_index)
           if spec.check_rdma else "")
    return "set -u\n" + header + "\n" + gid + _SCRIPT_BODY


def wrap_in_timeout(script: str, timeout_s: int) -> str:
    """The remote command text: the script under `timeout`, since Pulumi's timeouts do not stop it."""
    return f"timeout -k {_KILL_AFTER_S} {int(timeout_s)} sh -c {shlex.quote(script)}"


def render_command(spec: PreflightSpec) -> str:
    """What the remote.Command runs on the node."""
    return wrap_in_timeout(render_script(spec), spec.command_timeout_s)


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

