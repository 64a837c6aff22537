#!/bin/sh
# The RoCE GID decision for one node (see gid.py for why it runs on the node and for the rule).
# Prints `index <i>` on success, else one `fail <message>` line per problem; exits 0 either way
# (the preflight turns the `fail` lines into refusals, all reported together).
#
# Header values (scripts.render):
#   GID_HCAS       the configured HCAs, space-separated (names checked by gid.check_hca_name)
#   GID_FABRIC_IP  the node's IPv4 address on the fabric, as configured
#   GID_EXPECTED   that address as sysfs shows a GID (::ffff:a.b.c.d, fully expanded)
#   GID_WANTED     "auto" or the configured index
# The sysfs root is $DSV41_SYSFS_ROOT when set (tests), else /sys.
set -u
GID_SYSFS="${DSV41_SYSFS_ROOT:-/sys}"
# awk reads its inputs through ENVIRON (not -v, which would interpret backslashes)
export GID_SYSFS GID_HCAS GID_FABRIC_IP GID_EXPECTED GID_WANTED

# The dump, one record per line:
#   port <hca> <state text>        for every HCA present (so a refusal can name the ACTIVE ones)
#   missing <hca>                  for a configured HCA that does not exist
#   gid <hca> <index> <gid> [type] for every GID entry of a configured HCA (type empty when unreadable)
gid_dump() {
  ib="$GID_SYSFS/class/infiniband"
  if [ -d "$ib" ]; then
    for d in "$ib"/*; do
      [ -d "$d" ] || continue
      st=$(cat "$d/ports/1/state" 2>/dev/null) || st="unreadable"
      echo "port ${d##*/} $st"
    done
  fi
  # shellcheck disable=SC2086 # GID_HCAS is a space-separated list of device names (no glob characters)
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

# Decides over the dump: `index <i>`, or one `fail <message>` line per problem.
GID_DECIDE_AWK=$(cat <<'AWK'
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
AWK
)

gid_dump | awk "$GID_DECIDE_AWK"
