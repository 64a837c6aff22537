"""RoCE GID index: which entry of an HCA's GID table NCCL must use on one node.

Pure logic: no resources. It renders a POSIX sh fragment that dumps the relevant part
of sysfs and an awk program that decides over that dump.

Where the decision runs: ON THE NODE, inside the preflight command, and nowhere else.
Not in the Pulumi program on the command's stdout, because a remote.Command that exits 0
is recorded with that stdout and is not run again until its triggers change: a refusal
made afterwards in Python would replay the same stale dump on every `up`, even after the
node was fixed. A refusal on the node exits non-zero, records nothing, and the next `up`
checks the node again. The program only reads the index the node reported.

The rule (facts in notes/spark.md): the index is the entry i of
`<sysfs>/class/infiniband/<hca>/ports/1/gids/<i>` holding the IPv4-mapped fabric address
whose `gid_attrs/types/<i>` reads `RoCE v2`. Fail closed on a missing HCA, a port that is
not ACTIVE, an all-zero entry, a RoCE v1-only entry, or an index that moved.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from typing import Literal

GidWanted = int | Literal["auto"]

# Interface names as the kernel prints them; anything else could not be a sysfs entry and
# would need quoting inside the dump loop.
_HCA_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

SYSFS_ROOT_ENV = "DSV41_SYSFS_ROOT"
"""Overrides /sys for the fixture trees in tests; the node uses the real path."""


def ipv4_mapped_gid(fabric_ip: str) -> str:
    """The GID string sysfs shows for an IPv4 address: ::ffff:a.b.c.d, fully expanded."""
    try:
        addr = ipaddress.IPv4Address(fabric_ip)
    except ValueError:
        raise ValueError(
            f"fabric_ip {fabric_ip!r} is not an IPv4 address; RoCE v2 GID resolution needs the node's "
            "IPv4 address on the CX-7 fabric interface (e.g. 192.168.100.1)"
        ) from None
    mapped = ipaddress.IPv6Address(f"::ffff:{addr}").exploded
    return mapped


def check_hca_name(name: str) -> str:
    """Return the name if it can be an infiniband device name, else raise naming it."""
    if not _HCA_NAME.match(name):
        raise ValueError(
            f"ib_hcas entry {name!r} is not an RDMA device name; use names as listed by "
            "`ls /sys/class/infiniband` (e.g. rocep1s0f1)"
        )
    return name


def check_gid_wanted(wanted: object) -> GidWanted:
    """Accept "auto" or a non-negative int (bool excluded), else raise naming the value."""
    if wanted == "auto":
        return "auto"
    if isinstance(wanted, int) and not isinstance(wanted, bool) and 0 <= wanted <= 255:
        return wanted
    raise ValueError(f"gid_index {wanted!r} is invalid; use \"auto\" or an integer 0..255")


# The dump the node produces, one record per line:
#   port <hca> <state text>        for every HCA present (so a refusal can name the ACTIVE ones)
#   missing <hca>                  for a configured HCA that does not exist
#   gid <hca> <index> <gid> [type] for every GID entry of a configured HCA (type empty when unreadable)
_DUMP_SH = r"""
gid_dump() {
  ib="$GID_SYSFS/class/infiniband"
  if [ -d "$ib" ]; then
    for d in "$ib"/*; do
      [ -d "$d" ] || continue
      st=$(cat "$d/ports/1/state" 2>/dev/null) || st="unreadable"
      echo "port ${d##*/} $st"
    done
  fi
  for h in $GID_HCAS; do
    p="$ib/$h/ports/1"
    if [ ! -d "$ib/$h" ]; then echo "missing $h"; continue; fi
    for f in "$p"/gids/*; do
      [ -f "$f" ] || continue
      i=${f##*/}
      g=$(cat "$f" 2>/dev/null) || g="unreadable"
      # sysfs refuses to read the type of an unset entry (EINVAL): an empty type then
      t=$(cat "$p/gid_attrs/types/$i" 2>/dev/null) || t=""
      echo "gid $h $i $g $t"
    done
  done
}
"""

# Decides over the dump. Prints `index <i>` on success, else one `fail <message>` line per
# problem. Inputs come through ENVIRON (not -v, which would interpret backslashes).
_DECIDE_AWK = r"""
function rest(k,    s, j) { s = ""; for (j = k; j <= NF; j++) s = s (j > k ? " " : "") $j; return s }
function shown(t) { return t == "" ? "no type" : t }
function describe(h, i) {
  if (!((h, i) in seen)) return "absent"
  if (gid[h, i] == ZERO) return "all-zero (unset)"
  return gid[h, i] " (" shown(type[h, i]) ")"
}
function fail(msg) { print "fail " msg; bad = 1 }
BEGIN {
  want = ENVIRON["GID_WANTED"]; expected = tolower(ENVIRON["GID_EXPECTED"]); ip = ENVIRON["GID_FABRIC_IP"]
  n = split(ENVIRON["GID_HCAS"], hcas, " ")
  ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"
  MAPPED = "0000:0000:0000:0000:0000:ffff:"
  bad = 0; active = ""
}
$1 == "port" {
  s = rest(3); sub(/^[0-9]+: */, "", s); state[$2] = s
  if (s == "ACTIVE") active = active " " $2
}
$1 == "missing" { missing[$2] = 1 }
$1 == "gid" {
  h = $2; i = $3; g = tolower($4); t = rest(5)
  gid[h, i] = g; type[h, i] = t; seen[h, i] = 1
  if (g == expected) {
    if (t == "RoCE v2") { if (!(h in v2) || i + 0 < v2[h] + 0) v2[h] = i }
    else if (!(h in v1)) v1[h] = i " (" shown(t) ")"
  }
}
END {
  if (active == "") active = " none"
  for (k = 1; k <= n; k++) {
    h = hcas[k]
    if (h in missing) {
      fail("HCA " h " does not exist under " ENVIRON["GID_SYSFS"] "/class/infiniband (ACTIVE HCAs:" active \
           "); fix: set this node's ib_hcas to HCAs listed by `ls /sys/class/infiniband`")
    } else if (!(h in state)) {
      fail("HCA " h " has no readable port 1 state; fix: check the mlx5 RDMA driver on this node (ibv_devinfo)")
    } else if (state[h] != "ACTIVE") {
      fail("HCA " h " port 1 is " state[h] ", not ACTIVE; fix: check the fabric cable and link of " h \
           " (ibdev2netdev, ip link), or set this node's ib_hcas to its ACTIVE HCAs:" active)
    }
  }
  if (bad) exit

  idx = ""; holder = ""
  for (k = 1; k <= n; k++) {
    h = hcas[k]
    if (!(h in v2)) continue
    if (idx == "") { idx = v2[h]; holder = h }
    else if (v2[h] + 0 != idx + 0)
      fail("HCAs " holder " and " h " hold " ip " as RoCE v2 at different GID indexes (" idx " and " v2[h] \
           "), but NCCL_IB_GID_INDEX is one value per node; fix: keep " ip " on one fabric netdev only")
  }
  if (bad) exit
  if (idx == "") {
    detail = ""; v1only = ""
    if (want != "auto") detail = "; index " want " on " hcas[1] " is " describe(hcas[1], want)
    for (k = 1; k <= n; k++) if (hcas[k] in v1) { v1only = v1only " " hcas[k]; detail = detail "; " hcas[k] \
                                                   " holds it only as RoCE v1 at index " v1[hcas[k]] }
    if (v1only != "") fix = "enable RoCE v2 on" v1only " (the HCA's RoCE mode), then re-run"
    else fix = "assign " ip " to the fabric netdev of these HCAs (ip addr), bring the link up, then re-run"
    fail("no RoCE v2 GID entry holds " ip " (" expected ") on " ENVIRON["GID_HCAS"] detail \
         "; NCCL would fail at init (ibv_modify_qp errno 61) or hang; fix: " fix)
    exit
  }
  if (want != "auto" && want + 0 != idx + 0) {
    fail("GID index " want " on " holder " is " describe(holder, want) ", but the RoCE v2 entry for " ip \
         " is at index " idx " on this node (it moved); fix: set gid_index to " idx " or \"auto\"")
    exit
  }
  # The other HCAs in NCCL_IB_HCA (the second half of the port) use the same index.
  for (k = 1; k <= n; k++) {
    h = hcas[k]
    if (h in v2) continue
    if (!((h, idx) in seen) || type[h, idx] != "RoCE v2" || gid[h, idx] == ZERO \
        || substr(gid[h, idx], 1, length(MAPPED)) != MAPPED)
      fail("HCA " h " has no IPv4 RoCE v2 entry at GID index " idx " (the index of " ip " on " holder \
           "), it has " describe(h, idx) "; fix: give " h "'s netdev its fabric IPv4 address, or drop " h \
           " from ib_hcas")
  }
  if (bad) exit
  print "index " idx
}
"""


def render_gid_check(*, hcas: list[str] | tuple[str, ...], fabric_ip: str, wanted: GidWanted) -> str:
    """A sh fragment defining `gid_check`: prints `index <i>` or one `fail <message>` per problem.

    The sysfs root is `$DSV41_SYSFS_ROOT` when set (tests), else /sys.
    """
    if not hcas:
        raise ValueError("GID check needs at least one HCA in ib_hcas (e.g. [\"rocep1s0f1\"])")
    names = " ".join(check_hca_name(h) for h in hcas)
    wanted = check_gid_wanted(wanted)
    env = {
        "GID_HCAS": names,
        "GID_FABRIC_IP": fabric_ip,
        "GID_EXPECTED": ipv4_mapped_gid(fabric_ip),
        "GID_WANTED": str(wanted),
    }
    exports = "\n  ".join(f"{k}={shlex.quote(v)}; export {k}" for k, v in env.items())
    return (
        _DUMP_SH
        + "\ngid_check() {\n"
        + f'  GID_SYSFS="${{{SYSFS_ROOT_ENV}:-/sys}}"; export GID_SYSFS\n'
        + f"  {exports}\n"
        + f"  gid_dump | awk {shlex.quote(_DECIDE_AWK)}\n"
        + "}\n"
    )
