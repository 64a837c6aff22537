#!/bin/sh
# Follows this node's serving containers for the gates (components/gates/rank_watch.py StreamRankSource): one
# ssh session runs this script, which multiplexes the daemon's container events and every rank's log stream
# onto its stdout, one record a line:
#   S <container> <status> <exit code> <started at> <oom killed>   state (`docker inspect`), read once at the
#                                        start, after the event stream is started, and again when a log ends
#   S <container> missing | S <container> error <message>
#   E <json>                             a `docker events` event of these containers (die, oom, stop, start, ...)
#   L <container> <timestamp> <text>     a log line (`docker logs -f --timestamps`), cut at MAX_LINE bytes
#   X <container>                        that container's log stream ended (the container stopped)
#   Z                                    the event stream ended
#   R                                    every stream is started
#   F <reason>                           this node cannot stream (the reader polls instead)
#   N <mem> <nfs> <rx>                   the node's own counters, before each sample's U lines: MemAvailable
#                                        bytes, bytes read from NFS_SERVER's mounts, FABRIC_IF's rx bytes (`-`:
#                                        not readable, no such mount, or a loopback interface)
#   U <json>                             one container's `docker stats --no-stream --format '{{json .}}'` line
#   u <message>                          docker stats failed on this node
# Every record is one write of at most MAX_LINE + 80 bytes (< PIPE_BUF): writers never interleave.
# Header values (scripts.render): WATCH ("<container>=<since> ...": resume each log stream after that docker
# timestamp; an empty since reads from the container's start), MAX_LINE, FABRIC_IF (the node's fabric
# interface; empty: not read), NFS_SERVER (the address the node mounts the weights from; empty: none). The
# kernel's files are read where DSV41_MEMINFO, DSV41_MOUNTSTATS and DSV41_SYSFS_ROOT say when set (fixture
# trees; the simulated cluster's per-node files), else /proc and /sys. The script runs until its stdin
# (the ssh channel) closes, then stops what it started. A line `U` on stdin asks for one sample of the
# containers' memory and block I/O (the ready gate asks while every rank is silent); a sample still running
# when the next is asked for answers both.
set -u

for tool in docker awk mkfifo mktemp; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "F $tool is not installed on $(hostname 2>/dev/null || echo the node)"
    exit 0
  fi
done
dir=$(mktemp -d "${TMPDIR:-/tmp}/dsv41-rank-stream.XXXXXX") || { echo "F cannot make a temporary directory"; exit 0; }
pids=""
upid=""  # the docker stats sample running, if any
# Replaces the header's EXIT trap: stop every stream (docker clients too, which a silent container would
# otherwise keep alive on the node) and remove the fifos.
# shellcheck disable=SC2329 # invoked by the traps below
cleanup() {
  for p in $pids $upid; do kill "$p" 2>/dev/null; done
  # a reader still opening its fifo (its writer gone) is let through, sees the end and exits
  for f in "$dir"/*; do if [ -p "$f" ]; then : <>"$f"; fi; done
  rm -rf "$dir"
}
trap cleanup EXIT
# A signal only marks the stop: exiting at once could leave a docker client started but not yet in $pids.
stop=""
trap 'stop=1' HUP INT TERM PIPE

state() {
  out=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.State.StartedAt}} {{.State.OOMKilled}}' "$1" 2>&1)
  case "$?:$out" in
    0:*) printf 'S %s %s\n' "$1" "$out" ;;
    *[Nn]o\ such*) printf 'S %s missing\n' "$1" ;;
    *) printf 'S %s error %s\n' "$1" "$(printf '%s' "$out" | tr '\n' ' ' | cut -c1-300)" ;;
  esac
}

# mawk (Ubuntu's awk) fills its whole input buffer before it looks at a line, unless -W interactive.
interactive=""
case "$(awk -W version 2>&1 | head -n 1)" in mawk*) interactive="-W interactive" ;; esac
# Tags each line of fifo $2 with prefix $1, one flushed write per line; $3: what to print at its end.
tag() {
  # shellcheck disable=SC2086 # $interactive: empty or two words
  LC_ALL=C awk $interactive -v p="$1" -v max="$MAX_LINE" -v end="$3" \
    '{ print p substr($0, 1, max); fflush() } END { if (end != "") { print end; fflush() } }' <"$2"
}

# The event stream first, so an event after the state read below is never missed.
filters=""
for w in $WATCH; do filters="$filters --filter container=${w%%=*}"; done
mkfifo "$dir/events"
# Every job drops the traps first (it would inherit them): a kill then stops it even while it opens its fifo.
# shellcheck disable=SC2086 # $filters: one word per option, container names have no spaces
(trap - HUP INT TERM PIPE; exec docker events $filters --format '{{json .}}' >"$dir/events" 2>&1) &
pids="$pids $!"
(trap - HUP INT TERM PIPE; tag "E " "$dir/events" "Z") &
pids="$pids $!"

i=0
for w in $WATCH; do
  c=${w%%=*}
  since=${w#*=}
  i=$((i + 1))
  line=$(state "$c")
  printf '%s\n' "$line"
  if [ -z "$since" ]; then
    # from the container's start: a gate re-run over a server that is up sees its whole boot at once. A second
    # earlier: docker stamps a line written at once (a rank refused before vLLM) before its own StartedAt, and
    # `--since` would drop it (a restart's previous run ended at least a backoff earlier).
    since=$(printf '%s\n' "$line" | awk '{ print $5 }')
    if start=$(date -u -d "$since" +%s 2>/dev/null); then since=$((start - 1)); fi
  fi
  case "$line" in S\ *\ missing|S\ *\ error\ *) continue ;; esac
  mkfifo "$dir/log$i"
  (trap - HUP INT TERM PIPE; exec docker logs -f --timestamps --since "$since" "$c" >"$dir/log$i" 2>&1) &
  pids="$pids $!"
  (trap - HUP INT TERM PIPE; tag "L $c " "$dir/log$i" "X $c"; state "$c") &
  pids="$pids $!"
done
echo R

names=""
for w in $WATCH; do names="$names ${w%%=*}"; done
bounded=""
if command -v timeout >/dev/null 2>&1; then bounded="timeout 30"; fi
meminfo="${DSV41_MEMINFO:-/proc/meminfo}"
mountstats="${DSV41_MOUNTSTATS:-/proc/self/mountstats}"
net="${DSV41_SYSFS_ROOT:-/sys}/class/net/$FABRIC_IF"
# The node's counters that move while a GB10 rank loads with its container's counters flat (docs/hardware.md):
# MemAvailable (the CUDA driver's unified memory), NFS bytes read from the weights' server (mountstats'
# `bytes:` line, field 5: serverreadbytes), the fabric's rx bytes (not on loopback: lo carries no other node's
# bytes, and every process of the machine moves it). World-readable files: no root.
node_counters() {
  mem=$(LC_ALL=C awk '$1 == "MemAvailable:" { printf "%.0f", $2 * 1024; found = 1; exit } END { if (!found) print "-" }' "$meminfo" 2>/dev/null) || mem=-
  nfs=-
  if [ -n "$NFS_SERVER" ]; then
    nfs=$(LC_ALL=C awk -v s="$NFS_SERVER:" '
      $1 == "device" { on = (index($2, s) == 1 && $7 == "fstype" && $8 ~ /^nfs/) }
      on && $1 == "bytes:" { sum += $6; found = 1 }
      END { if (found) printf "%.0f", sum; else print "-" }' "$mountstats" 2>/dev/null) || nfs=-
  fi
  rx=-
  if [ -n "$FABRIC_IF" ] && flags=$(cat "$net/flags" 2>/dev/null) && [ $((flags & 8)) -eq 0 ]; then
    rx=$(cat "$net/statistics/rx_bytes" 2>/dev/null) || rx=-
  fi
  printf 'N %s %s %s\n' "${mem:--}" "${nfs:--}" "${rx:--}"
}

# One `docker stats` sample of every container (after the node's counters), in the background so stdin is
# still read.
usage() {
  if [ -n "$upid" ] && kill -0 "$upid" 2>/dev/null; then return 0; fi
  (
    trap - HUP INT TERM PIPE
    node_counters
    # shellcheck disable=SC2086 # $bounded: empty or two words; $names: container names have no spaces
    if out=$($bounded docker stats --no-stream --format '{{json .}}' $names 2>&1); then
      printf '%s\n' "$out" | LC_ALL=C awk -v max="$MAX_LINE" 'NF { print "U " substr($0, 1, max); fflush() }'
    else
      printf 'u %s\n' "$(printf '%s' "$out" | tr '\n' ' ' | cut -c1-300)"
    fi
  ) &
  upid=$!
}

# Until the ssh channel closes (or a signal): the reader went away, so stop.
while [ -z "$stop" ] && read -r ask; do
  if [ "$ask" = U ]; then usage; fi
done
exit 0
