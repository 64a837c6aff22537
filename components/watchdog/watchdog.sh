#!/bin/sh
# dsv41-exl3 memory watchdog for one node (rendered by the Pulumi program; edits are overwritten).
# Header values: NODE, CONTAINER (the serving container it kills), FLOOR_KIB, SAMPLES (consecutive low
# samples before a kill), STOP_TIMEOUT (seconds, bounds each docker and ssh call), SAMPLE_INTERVAL_S, MEMINFO_PATH, STATE_DIR (under $HOME),
# KEY_NAME, PID_NAME, SYSLOG_TAG, TOP_HOLDERS, PEERS (text: one `node user host port` line per other rank),
# KNOWN_HOSTS (text: the peers' pinned host keys, known_hosts lines).
# Kills CONTAINER (docker kill: no stop grace, the host may wedge within seconds) when MemAvailable stays
# below FLOOR_KIB for SAMPLES consecutive samples. MemAvailable,
# never "used": on GB10 the weights are not charged to any RSS and a large resident footprint is normal.
# Env overrides (configuration, e.g. for a node without /proc or a docker behind sudo):
# DSV41_WATCHDOG_MEMINFO, DSV41_WATCHDOG_DOCKER, DSV41_WATCHDOG_SSH, DSV41_WATCHDOG_INTERVAL_S.
set -u
INTERVAL="${DSV41_WATCHDOG_INTERVAL_S:-$SAMPLE_INTERVAL_S}"
MEMINFO="${DSV41_WATCHDOG_MEMINFO:-$MEMINFO_PATH}"
DOCKER="${DSV41_WATCHDOG_DOCKER:-docker}"
SSH="${DSV41_WATCHDOG_SSH:-ssh}"
STATE="$HOME/$STATE_DIR"
KEY="$STATE/$KEY_NAME"
LOG="$STATE/watchdog.log"
PIDFILE="$STATE/$PID_NAME"

mkdir -p "$STATE"
say() {
  line="$(date -u +%Y-%m-%dT%H:%M:%SZ) node=$NODE container=$CONTAINER $*"
  printf '%s\n' "$line" >> "$LOG"
  if command -v logger >/dev/null 2>&1; then logger -t "$SYSLOG_TAG" -- "$line" 2>/dev/null || true; fi
}
# DOCKER and SSH are command words (e.g. `sudo docker`): split on purpose.
stop_container() {
  # shellcheck disable=SC2086 # DOCKER may be several words
  if command -v timeout >/dev/null 2>&1; then timeout "$STOP_TIMEOUT" $DOCKER kill "$CONTAINER"
  else $DOCKER kill "$CONTAINER"; fi
}
# Who held the memory at the moment of the trip: MemAvailable and the top of the process list by RSS
# (the weights are in no RSS, so this names what else grew: often an unrelated host process).
memory_holders() {
  mem=$(awk '$1 == "MemAvailable:" || $1 == "MemTotal:" || $1 == "Cached:" { printf "%s %s kB; ", $1, $2 }' \
    "$MEMINFO" 2>/dev/null)
  say "memory at stop: $mem"
  procs=$(ps -eo pid,rss,comm --sort=-rss 2>/dev/null | head -n "$((TOP_HOLDERS + 1))")
  if [ -z "$procs" ]; then
    procs=$(for f in /proc/[0-9]*/status; do
      awk '$1 == "Name:" { n = $2 } $1 == "Pid:" { p = $2 } $1 == "VmRSS:" { r = $2 }
           END { if (r) print p, r, n }' "$f" 2>/dev/null
    done | sort -k2 -n -r | head -n "$TOP_HOLDERS")
  fi
  printf '%s\n' "$procs" | while IFS= read -r line; do
    [ -n "$line" ] && say "holder (pid rss_kib command): $line"
  done
}
# Another rank's node: its forced-command key stops its serving container (nothing else is allowed).
stop_peer() {
  if [ ! -s "$KEY" ]; then say "cannot stop rank on $1: no watchdog key at $KEY"; return 0; fi
  # shellcheck disable=SC2086 # SSH may be several words
  if out=$(timeout "$STOP_TIMEOUT" $SSH -i "$KEY" -p "$4" -o BatchMode=yes -o IdentitiesOnly=yes \
      -o StrictHostKeyChecking=yes -o UserKnownHostsFile="$KNOWN_HOSTS_FILE" \
      -o ConnectTimeout=10 "$2@$3" "stop-from $NODE" 2>&1); then
    say "peer $1 ($2@$3:$4): $(printf '%s' "$out" | tr '\n' ' ')"
  else
    say "peer $1 ($2@$3:$4): stop FAILED (exit $?): $(printf '%s' "$out" | tr '\n' ' '); stop it by hand"
  fi
}
# One bounded ssh per peer; the peer's forced command does the stop.
stop_peers() {
  while IFS=' ' read -r peer user host port; do
    [ -n "$peer" ] || continue
    stop_peer "$peer" "$user" "$host" "$port" </dev/null
  done <<DSV41_PEERS
$(printf '%b' "$PEERS")
DSV41_PEERS
}

# The peers' host keys as the operator pinned them; rewritten on every start so a re-pinned key follows.
# Per node: nodes sharing one home (NFS homes, the simulated cluster) must not overwrite each other's.
KNOWN_HOSTS_FILE="$STATE/watchdog-known_hosts-$NODE"
printf '%b' "$KNOWN_HOSTS" > "$KNOWN_HOSTS_FILE"
echo $$ > "$PIDFILE"
trap 'say "watchdog stopping (signal)"; rm -f "$PIDFILE"; exit 0' TERM INT HUP
say "watchdog started pid=$$ floor_kib=$FLOOR_KIB samples=$SAMPLES interval_s=$INTERVAL meminfo=$MEMINFO"
low=0
recent=""
unreadable=0
while :; do
  avail=$(awk '$1 == "MemAvailable:" { print $2; exit }' "$MEMINFO" 2>/dev/null)
  case "$avail" in
    ''|*[!0-9]*)
      # never act on a reading we do not have; say so once
      if [ "$unreadable" = 0 ]; then say "cannot read MemAvailable from $MEMINFO; not guarding"; fi
      unreadable=1; low=0; recent="" ;;
    *)
      unreadable=0
      if [ "$avail" -lt "$FLOOR_KIB" ]; then
        low=$((low + 1)); recent="$recent $avail"
        if [ "$low" -ge "$SAMPLES" ]; then
          say "STOP: MemAvailable below $FLOOR_KIB KiB in $low consecutive samples (KiB:$recent); docker kill"
          memory_holders
          if stop_container >/dev/null 2>&1; then say "killed $CONTAINER"
          else say "docker kill $CONTAINER failed (exit $?)"; fi
          # the rest of the tensor-parallel group: one rank gone leaves the others hanging forever
          stop_peers
          low=0; recent=""
        fi
      else
        low=0; recent=""
      fi ;;
  esac
  # background + wait: a TERM is handled at once instead of after the sleep
  sleep "$INTERVAL" &
  wait $!
done
