#!/bin/sh
# dsv41-exl3: run by sshd for a peer's watchdog key (authorized_keys forced command); nothing else.
# Header values: NODE, CONTAINER (this node's serving container, killed: no stop grace), STATE_DIR (under $HOME),
# STOP_TIMEOUT (seconds), SYSLOG_TAG. Its one argument names the peer; it comes from this node's authorized_keys line,
# not from the connecting side, so a key can only ever stop this container and say whose key it was.
set -u
DOCKER="${DSV41_WATCHDOG_DOCKER:-docker}"
STATE="$HOME/$STATE_DIR"
LOG="$STATE/watchdog.log"
from="${1:-unknown}"
mkdir -p "$STATE"
line="$(date -u +%Y-%m-%dT%H:%M:%SZ) node=$NODE container=$CONTAINER STOP requested by the watchdog of $from"
line="$line (its MemAvailable stayed below the floor): the tensor-parallel group cannot go on without that rank; docker kill"
printf '%s\n' "$line" >> "$LOG"
if command -v logger >/dev/null 2>&1; then logger -t "$SYSLOG_TAG" -- "$line" 2>/dev/null || true; fi
# shellcheck disable=SC2086 # DOCKER may be several words (e.g. `sudo docker`)
if timeout "$STOP_TIMEOUT" $DOCKER kill "$CONTAINER" >/dev/null 2>&1; then
  printf '%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ) node=$NODE container=$CONTAINER killed (asked by $from)" >> "$LOG"
  echo "killed $CONTAINER on $NODE"
else
  rc=$?
  printf '%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ) node=$NODE container=$CONTAINER docker kill failed (exit $rc)" \
    >> "$LOG"
  echo "docker kill $CONTAINER failed on $NODE (exit $rc)"
  exit 1
fi
