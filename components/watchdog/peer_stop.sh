#!/bin/sh
# dsv41-exl3: run by sshd for a peer's watchdog key (authorized_keys forced command); nothing else.
# Header values: NODE (whose authorized_keys line this is), CONTAINER (that node's serving container),
# STACK (the stack's label value on its rank containers, "" when the container's name does not tell it),
# STACK_LABEL_KEY, RANK_LABEL_KEY, STATE_DIR (under $HOME), STOP_TIMEOUT (seconds), SYSLOG_TAG.
# Its one argument names the peer; it comes from this node's authorized_keys line, not from the connecting side,
# so a key can only ever stop this stack's rank and say whose key it was.
#
# It kills the rank of this stack that runs on THIS host's docker, found by its labels, not the container the
# line names: on a home shared by three or more nodes (NFS homes, the simulated cluster) one authorized_keys
# holds a peer's key once per node it may stop, all with the same from=, and sshd runs the first matching line
# whichever node it runs on. Whatever line matched, the stop lands on the node that was asked.
set -u
DOCKER="${DSV41_WATCHDOG_DOCKER:-docker}"
STATE="$HOME/$STATE_DIR"
LOG="$STATE/watchdog.log"
from="${1:-unknown}"
mkdir -p "$STATE"
say() {
  line="$(date -u +%Y-%m-%dT%H:%M:%SZ) $*"
  printf '%s\n' "$line" >> "$LOG"
  if command -v logger >/dev/null 2>&1; then logger -t "$SYSLOG_TAG" -- "$line" 2>/dev/null || true; fi
}
if [ -n "$STACK" ]; then
  # shellcheck disable=SC2086 # DOCKER may be several words (e.g. `sudo docker`)
  if ! names=$(timeout "$STOP_TIMEOUT" $DOCKER ps --filter "label=$STACK_LABEL_KEY=$STACK" \
      --filter "label=$RANK_LABEL_KEY" --format '{{.Names}}' 2>&1); then
    say "stack=$STACK STOP requested by the watchdog of $from, but docker ps failed: $names"
    echo "docker ps failed on this node: $names"
    exit 1
  fi
  if [ -z "$names" ]; then
    say "stack=$STACK STOP requested by the watchdog of $from: no rank of the stack runs on this node's docker"
    echo "no running rank of stack $STACK here: nothing to stop"
    exit 0
  fi
else
  names=$CONTAINER  # a name that does not tell the stack: the line's own container (a home of its own)
fi
rc=0
for name in $names; do
  say "container=$name STOP requested by the watchdog of $from (its MemAvailable stayed below the floor): \
the tensor-parallel group cannot go on without that rank; docker kill"
  # shellcheck disable=SC2086 # DOCKER may be several words
  if timeout "$STOP_TIMEOUT" $DOCKER kill "$name" >/dev/null 2>&1; then
    say "container=$name killed (asked by $from)"
    if [ -n "$STACK" ]; then echo "killed $name"; else echo "killed $name on $NODE"; fi
  else
    rc=$?
    say "container=$name docker kill failed (exit $rc)"
    echo "docker kill $name failed (exit $rc)"
  fi
done
[ "$rc" -eq 0 ] || exit 1
