#!/bin/sh
# The per-node preflight; spec.py says what it checks, in order, and why every decision is made here.
# Success: one JSON line on stdout (spec.parse_output reads it). Refusal: one line per problem on
# stderr, each "preflight refused on node <NODE>: <why>; fix: ...", all of them, then exit 1.
#
# Header values (scripts.render):
#   NODE              the node's name in the cluster config
#   STACK_LABEL       this stack's value of the label LABEL_KEY on its containers
#   LABEL_KEY         the stack label's key
#   CONFIG_LABEL_KEY  the key of the label holding a container's config generation
#   GENERATION        the generation this update asks for ("" = none known: stop every own container)
#   REPORT            1: `dsv41-exl3 doctor` (with STOP=0): every check's result in the JSON line, refusals
#                     included, and exit 0; 0: the program's preflight (a refusal exits 1)
#   STOP              1: the stop phase (stop this stack's other-generation containers, then check memory);
#                     0: the check phase (every check, those containers left serving, memory checked only if none)
#   SHAPE             the container shape this update asks for, as SHAPE_FORMAT prints it
#   SHAPE_FORMAT      docker inspect template: IPC mode and memlock hard limit
#   INSPECT_FORMAT    docker inspect template: name|gpu capabilities|device paths|stack label
#   MIN_MEM           minimum MemAvailable, GiB
#   WEIGHTS_ROOT      the head: where the weights are staged; a worker with `share: copy`: its copy root (may start
#                     with ~/); "" on other workers
#   MIN_DISK          minimum free + already staged (or copied) GiB at WEIGHTS_ROOT; "" when WEIGHTS_ROOT is
#   CHECK_RDMA        1: check /dev/infiniband and the RoCE GID index; 0: skip
#   FABRIC_IF         the fabric interface, whose statistics the stall rule reads (empty: not checked)
#   CHECK_EXPORT      1: every directory on the path to WEIGHTS_ROOT must be o+x (NFS share); 0: skip
#   ADDRESS           the head: the IP address its listeners bind (ADDRESS_HOST resolved on the operator's
#                     machine), which must be one of this node's own; "" on the workers: not checked
#   ADDRESS_KEY       the config key ADDRESS comes from (nodes[0].host), named by a refusal
#   ADDRESS_HOST      that key's value: a name, or ADDRESS itself
#   HCAS              the configured HCAs, space-separated (only named in the findings)
#   STOP_TIMEOUT_S    docker stop -t seconds
#   MEM_SETTLE_S      seconds to wait after a stop for MemAvailable to come back
#   DOCKER_TIMEOUT_S  bound in seconds on each docker / systemctl / du call
# Argument $1 (when CHECK_RDMA=1): the rendered gid_check.sh (gid.render_gid_check), run with sh -c.
# Environment overrides for fixture trees (tests): DSV41_MEMINFO, DSV41_DEV_ROOT, and DSV41_SYSFS_ROOT
# (read by gid_check.sh).
set -u
GID_CHECK_SH=${1:-}
if [ "$CHECK_RDMA" = 1 ] && [ -z "$GID_CHECK_SH" ]; then
  fail "${LINENO:-}" "CHECK_RDMA is 1 but no GID check script was passed as \$1 (see spec.render_command)"
fi
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
LEFT_SERVING=''
GID_INDEX=''
CHECK=''
RESULTS=''   # "check|ok|text" / "check|fail|text": what `dsv41-exl3 doctor` shows per check (REPORT=1)
refuse() { FAILURES="$FAILURES$1$NL"; RESULTS="$RESULTS$CHECK|fail|$1$NL"; }  # all reported, then one exit
note() { FINDINGS="$FINDINGS$1$NL"; RESULTS="$RESULTS$CHECK|ok|$1$NL"; }
# step ID TEXT: the check that follows (its refusals and notes carry ID). Progress on stderr: when the outer
# timeout kills the script, the last line says where it was.
step() { CHECK=$1; RESULTS="$RESULTS$1|ok|$NL"; echo "preflight $NODE: $2"; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 >= b + 0) }'; }
last_line() { printf '%s\n' "$1" | awk 'NF { l = $0 } END { print l }'; }

step docker "docker"
if out=$(timeout "$DOCKER_TIMEOUT_S" docker version --format '{{.Server.Version}}' 2>&1); then
  DOCKER_OK=1
  note "docker server $(last_line "$out")"
else
  DOCKER_OK=0
  refuse "docker is not reachable ($(last_line "$out")); fix: start the daemon (sudo systemctl start docker)\
 and let user $(id -un) use it (docker group), then re-run"
fi

if [ -n "$ADDRESS" ]; then
  step address "$ADDRESS_KEY: $ADDRESS is an address of this node"
  # `local` when the kernel delivers to this node itself (127.0.0.3 too: all of 127.0.0.0/8 is lo's, which is how
  # the simulated cluster's nodes share one machine).
  given="$ADDRESS_HOST"
  [ "$ADDRESS_HOST" = "$ADDRESS" ] || given="$ADDRESS_HOST (resolved on the operator's machine to $ADDRESS)"
  if ! command -v ip >/dev/null 2>&1; then
    note "$ADDRESS_KEY: not checked as an address of $NODE (no ip command)"
  elif route=$(ip route get "$ADDRESS" 2>&1); then
    case "$route" in
      "local "*) note "$ADDRESS_KEY: $ADDRESS is an address of $NODE" ;;
      *) refuse "$ADDRESS_KEY = $given is not an address of $NODE (ip route get: $(printf '%s\n' "$route" | awk 'NR == 1')):\
 Prometheus, the supervisor's API and the endpoint listen on it, and a listener cannot bind another machine's\
 address; fix: set $ADDRESS_KEY to $NODE's own LAN or Tailscale address (hostname -I on $NODE lists them), or to a\
 name that resolves to one of them on the operator's machine" ;;
    esac
  else
    refuse "$ADDRESS_KEY = $given: ip route get $ADDRESS failed on $NODE ($(last_line "$route")); fix: set\
 $ADDRESS_KEY to $NODE's own LAN or Tailscale address (hostname -I on $NODE lists them)"
  fi
fi

if command -v systemctl >/dev/null 2>&1; then
  step units "user systemd units"
  if [ -z "${XDG_RUNTIME_DIR:-}" ] && [ -d "/run/user/$(id -u)" ]; then
    XDG_RUNTIME_DIR="/run/user/$(id -u)"; export XDG_RUNTIME_DIR
  fi
  if units=$(timeout "$DOCKER_TIMEOUT_S" systemctl --user list-unit-files --state=enabled --no-legend --no-pager 2>&1); then
    bad=$(printf '%s\n' "$units" | awk 'tolower($1) ~ /vllm|sglang|ray/ { printf "%s%s", (n++ ? " " : ""), $1 }')
    if [ -n "$bad" ]; then
      refuse "enabled user systemd units would start a competing server: $bad; fix: systemctl --user disable --now $bad"
    fi
  else
    note "user systemd units not checked (systemctl --user: $(last_line "$units"))"
  fi
else
  note "user systemd units not checked (no systemctl)"
fi

if [ "$DOCKER_OK" = 1 ]; then
  step holders "other containers holding the GPU or RDMA devices"
  if running=$(timeout "$DOCKER_TIMEOUT_S" docker ps -q 2>&1); then
    if [ -n "$running" ]; then
      # shellcheck disable=SC2086 # ids are hex words
      if info=$(timeout "$DOCKER_TIMEOUT_S" docker inspect --format "$INSPECT_FORMAT" $running 2>&1); then
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
          refuse "container $name (not of this stack) holds $what; fix: stop it (docker stop $name)\
 or destroy the stack that owns it, then re-run"
        done <<EOF
$holders
EOF
      else
        refuse "docker inspect failed ($(last_line "$info")); fix: check the docker daemon on $NODE, then re-run"
      fi
    fi
  else
    refuse "docker ps failed ($(last_line "$running")); fix: check the docker daemon on $NODE, then re-run"
  fi
fi

# shellcheck disable=SC2088 # the patterns match a literal ~ from the config; it is expanded here
case "$WEIGHTS_ROOT" in  # ~ means the SSH user's home on the node, as in the config
  "~") WEIGHTS_ROOT="$HOME" ;;
  "~/"*) WEIGHTS_ROOT="$HOME/${WEIGHTS_ROOT#"~/"}" ;;
esac
if [ -n "$WEIGHTS_ROOT" ]; then
  step disk "disk at $WEIGHTS_ROOT"
  d="$WEIGHTS_ROOT"
  while [ ! -e "$d" ]; do d=$(dirname "$d"); done
  free_k=$(df -Pk "$d" | awk 'NR == 2 { print $4 }')
  staged_k=0
  if [ -d "$WEIGHTS_ROOT" ]; then
    staged_k=$(timeout "$DOCKER_TIMEOUT_S" du -sk "$WEIGHTS_ROOT" 2>/dev/null | awk '{ print $1 }')
  fi
  if [ -z "$free_k" ] || [ -z "$staged_k" ]; then
    refuse "cannot measure disk at $d (df/du failed); fix: check that $d is readable on $NODE"
  else
    read -r free_g staged_g total_g short_g <<EOF
$(awk -v f="$free_k" -v s="$staged_k" -v m="$MIN_DISK" \
  'BEGIN { printf "%.1f %.1f %.1f %.1f", f / 1048576, s / 1048576, (f + s) / 1048576, m - (f + s) / 1048576 }')
EOF
    if ge "$total_g" "$MIN_DISK"; then
      note "disk: $free_g GiB free at $d + $staged_g GiB staged in $WEIGHTS_ROOT"
    else
      refuse "disk at $d has $free_g GiB free + $staged_g GiB already staged in $WEIGHTS_ROOT = $total_g GiB,\
 below the\
 required $MIN_DISK GiB (short by $short_g GiB); fix: free space on that filesystem, or point weights.root (the\
 head) or weights.copyRoot (a worker, share: copy) at a larger disk"
    fi
  fi
  # Staging (the head) and the copy (a worker) create the root as the SSH user: create it here, so a root the
  # user may not create (/srv on a stock node) is refused now, with the one line that fixes it.
  me=$(id -un)
  if ! mkdir -p "$WEIGHTS_ROOT" 2>/dev/null; then
    refuse "cannot create $WEIGHTS_ROOT as $me on $NODE; fix: on $NODE run\
 sudo install -d -o $me -g $(id -gn) -m 0755 $WEIGHTS_ROOT"
  elif ! (: >"$WEIGHTS_ROOT/.dsv41-write-check") 2>/dev/null; then
    refuse "$WEIGHTS_ROOT is not writable by $me on $NODE; fix: on $NODE run sudo chown $me:$(id -gn) $WEIGHTS_ROOT"
  else
    rm -f "$WEIGHTS_ROOT/.dsv41-write-check"
  fi
fi

if [ -n "$WEIGHTS_ROOT" ] && [ "$CHECK_EXPORT" = 1 ]; then
  step export-path "NFS export path under $WEIGHTS_ROOT traversable by others"
  # The workers' root is squashed to nobody on the export: it needs o+x on every directory of the
  # path. Checked from the leaves up; directories the staging has not created yet are skipped.
  paths=''
  # engram-vllm/: the slim Engram directory staging builds, which the workers mount at /engram-src.
  for d in "$WEIGHTS_ROOT/model" "$WEIGHTS_ROOT/engram-src" "$WEIGHTS_ROOT/engram-vllm" "$WEIGHTS_ROOT"; do
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
    # shellcheck disable=SC2012 # only the mode column is read; stat and find are not among the node tools
    perm=$(ls -ld "$d" 2>/dev/null | awk '{ print $1; exit }')
    case "$perm" in
      ?????????[xt]*) ;;
      '') refuse "cannot read the mode of $d on the NFS export path; fix: check that $d exists and is readable" ;;
      *) refuse "directory $d on the NFS export path of weights.root ($WEIGHTS_ROOT) is not traversable by\
 others (mode $perm): the workers' root-squashed NFS mount cannot reach the export; fix: chmod o+x $d\
 (or set weights.root outside a 0750 home directory)" ;;
    esac
  done <<EOF
$paths
EOF
fi

if [ -n "$FABRIC_IF" ]; then
  step fabric "fabric interface statistics"
  # the stall rule reads them while a rank loads in silence (components/gates/rank_stream.sh)
  rx="${DSV41_SYSFS_ROOT:-/sys}/class/net/$FABRIC_IF/statistics/rx_bytes"
  [ -r "$rx" ] || refuse "nodes[].fabricInterface $FABRIC_IF of $NODE has no statistics ($rx is not readable);\
 fix: set it to the interface that holds the node's fabricIp (ip -br addr on $NODE)"
fi

if [ "$CHECK_RDMA" = 1 ]; then
  step rdma "RDMA: HCA ports and RoCE v2 GID index"
  [ -e "$DEVROOT/infiniband" ] || refuse "$DEVROOT/infiniband does not exist; fix: load the RDMA driver\
 (sudo modprobe mlx5_ib), or set check_rdma false for a node without RDMA"
  decision=$(sh -c "$GID_CHECK_SH" components/preflight/gid_check.sh)
  while IFS= read -r line; do
    case "$line" in
      "index "*) GID_INDEX=${line#index } ;;
      "fail "*) refuse "${line#fail }" ;;
    esac
  done <<EOF
$decision
EOF
  if [ -z "$GID_INDEX" ] && [ -z "$FAILURES" ]; then
    refuse "the GID check printed no decision; fix: run the preflight script by hand on $NODE and read its stderr"
  fi
  [ -n "$GID_INDEX" ] && note "RoCE v2 GID index $GID_INDEX on $HCAS"
fi

# Last: every other check has passed (or refused) by now. This stack's containers of another generation are
# stopped only in the stop phase (STOP=1, which runs once every node holds the new image and passed its check
# phase) and only when nothing above refused: until then the old ranks keep serving.
if [ "$DOCKER_OK" = 1 ]; then
  step own-containers "this stack's running containers (label $LABEL_KEY=$STACK_LABEL)"
  # plain `docker ps` lists running, restarting and paused containers: all of them hold memory
  if listed=$(timeout "$DOCKER_TIMEOUT_S" docker ps --filter "label=$LABEL_KEY=$STACK_LABEL" \
           --format "{{.ID}} {{.Names}} {{.Label \"$CONFIG_LABEL_KEY\"}}" 2>&1); then
    # A container already on the generation and the container shape this update asks for is not being
    # replaced: leave it serving, and skip the memory check (a running deployment legitimately leaves ~5 GiB).
    # Another shape (container.ipcMode, memlockBytes) replaces every rank under the same generation, and a new
    # worker must not meet the old head still listening on the master port: those are stopped too.
    own=''
    while read -r id name gen; do
      [ -n "$id" ] || continue
      if [ -n "$GENERATION" ] && [ "$gen" = "$GENERATION" ]; then
        # a container gone between `ps` and `inspect` needs no stop
        have=$(timeout "$DOCKER_TIMEOUT_S" docker inspect --format "$SHAPE_FORMAT" "$id" 2>/dev/null) || continue
        if [ "$have" = "$SHAPE" ]; then
          CURRENT="$CURRENT$name$NL"
          continue
        fi
      fi
      own="$own$id $name$NL"
    done <<EOF
$listed
EOF
    if [ -n "$CURRENT" ]; then
      note "$(printf '%s' "$CURRENT" | tr '\n' ' ')already serves generation $GENERATION:\
 left running, memory check skipped"
    fi
    if [ -n "$own" ]; then
      ids=$(printf '%s\n' "$own" | awk 'NF { print $1 }')
      names=$(printf '%s\n' "$own" | awk 'NF { printf "%s%s", (n++ ? " " : ""), $2 }')
      # shellcheck disable=SC2086 # ids are hex words
      if [ "$STOP" != 1 ]; then
        LEFT_SERVING=1
        note "this stack's container(s) $names left serving: they stop once every node holds the image and\
 passed this check; memory is checked then"
      elif [ -n "$FAILURES" ]; then
        LEFT_SERVING=1
        note "this stack's container(s) $names left serving: the checks above refused"
      elif timeout $((STOP_TIMEOUT_S + DOCKER_TIMEOUT_S)) docker stop -t "$STOP_TIMEOUT_S" $ids >/dev/null; then
        STOPPED=$(printf '%s\n' "$own" | awk 'NF { print $2 }')
        note "stopped this stack's container(s): $names"
      else
        refuse "could not stop this stack's container(s) $names; fix: run docker rm -f $names on $NODE, then re-run"
      fi
    fi
  else
    refuse "docker ps failed ($(last_line "$listed")); fix: check the docker daemon on $NODE, then re-run"
  fi
fi

step memory "MemAvailable"
mem_gib() {  # kB in /proc/meminfo are KiB
  awk '$1 == "MemAvailable:" { printf "%.2f", $2 / 1048576; found = 1 } END { exit !found }' "$MEMINFO" 2>/dev/null
}
if MEM=$(mem_gib); then
  if [ -n "$STOPPED" ] && ! ge "$MEM" "$MIN_MEM"; then
    # the stopped containers' unified memory comes back over a few seconds
    deadline=$(( $(date +%s) + MEM_SETTLE_S ))
    while ! ge "$MEM" "$MIN_MEM" && [ "$(date +%s)" -lt "$deadline" ]; do
      sleep 1
      MEM=$(mem_gib) || break
    done
  fi
  if [ -n "$CURRENT" ] || [ -n "$LEFT_SERVING" ]; then
    note "MemAvailable $MEM GiB, not judged: this stack's ranks hold their memory (the stop phase checks it)"
  elif ! ge "$MEM" "$MIN_MEM"; then
    refuse "MemAvailable is $MEM GiB, below the required $MIN_MEM GiB; fix: stop what holds memory on $NODE\
 (ps aux --sort=-rss | head; docker ps), or if it is page cache:\
 sync; echo 3 | sudo tee /proc/sys/vm/drop_caches"
  else
    note "MemAvailable $MEM GiB (needs $MIN_MEM)"
  fi
else
  MEM=''
  refuse "cannot read MemAvailable from $MEMINFO; fix: this preflight needs a Linux /proc/meminfo"
fi

if [ -n "$FAILURES" ] && [ "$REPORT" != 1 ]; then
  printf '%s' "$FAILURES" | awk -v node="$NODE" 'NF { print "preflight refused on node " node ": " $0 }'
  fail "${LINENO:-}" "refused: the problems are listed above; nothing is recorded, the next update checks again"
fi

json_list() {  # newline-separated values -> JSON array of strings
  printf '%s\n' "$1" | tr '\t\r' '  ' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' |
    awk 'NF { printf "%s\"%s\"", (n++ ? "," : ""), $0 } END { printf "" }'
}
node_json=$(json_list "$NODE")
printf '{"node":%s,"mem_available_gib":%s,"gid_index":%s,"stopped":[%s],"findings":[%s],"results":[%s]}\n' \
  "$node_json" "${MEM:-null}" "${GID_INDEX:-null}" "$(json_list "$STOPPED")" "$(json_list "$FINDINGS")" \
  "$(json_list "$RESULTS")" >&3
