#!/bin/sh
# Installs (ACTION=install) or removes (ACTION=remove) this stack's memory watchdog on one node; idempotent.
# Header values: ACTION, NODE, CONTAINER, STATE_DIR and SHARE_DIR (this stack's directories under $HOME),
# SCRIPT_NAME, PID_NAME, PEER_STOP_NAME, LOG_PATH (as the operator reads it), KEY_TAG (marks this
# container's authorized_keys lines), MANAGE_PEERS (non-empty: write / remove the peer-stop script and this
# container's authorized_keys lines), AUTHORIZED_KEYS (text: the lines to authorize), WATCHDOG and
# PEER_STOP (text: the rendered watchdog.sh and peer_stop.sh), LEGACY_STATE_DIR and LEGACY_SHARE_DIR (where
# versions before per-stack names kept every stack's files). install writes the scripts, stops a running
# copy, starts it again and confirms it is alive; remove stops it and removes its script (the log stays:
# it may explain a past stop).
set -eu
state="$HOME/$STATE_DIR"
share="$HOME/$SHARE_DIR"
script="$share/$SCRIPT_NAME"

# "ours": alive and still a watchdog script (not a recycled pid; a zombie's cmdline is empty)
ours() { kill -0 "$1" 2>/dev/null && grep -q memory-watchdog "/proc/$1/cmdline" 2>/dev/null; }
stop_pidfile() {
  if [ -s "$1" ]; then
    old=$(cat "$1")
    if ours "$old"; then
      kill "$old"
      i=0; while ours "$old" && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
    fi
    rm -f "$1"
  fi
}
# Replaces this container's lines in ~/.ssh/authorized_keys with AUTHORIZED_KEYS (empty: removes them).
# Every other line is the operator's way in: the file is replaced only by a copy proved complete (grep's
# status, the line count) and synced, and edits hold a lock beside it (two stacks, or nodes sharing one
# home, rewrite the same file at once: unlocked, one rewrite drops the other's lines). No flock: refuse,
# since an unlocked edit can lose lines.
authorize_peers() {
  mkdir -p "$HOME/.ssh" && chmod 700 "$HOME/.ssh"
  ak="$HOME/.ssh/authorized_keys"
  command -v flock >/dev/null 2>&1 ||
    fail "${LINENO:-}" "flock (util-linux) not found on $NODE: it serializes edits of $ak; install util-linux"
  touch "$ak"
  exec 9>>"$ak.lock"
  flock -w 30 9 || fail "${LINENO:-}" "$ak.lock on $NODE is held for over 30 s; $ak left unchanged"
  edit_authorized_keys "$1"
  exec 9>&-
}
# Under the lock. Any doubt about the copy (a read or write error, a short count, a failed sync or rename)
# leaves $ak as it was and fails naming it.
edit_authorized_keys() {
  tmp=$(mktemp "$ak.XXXXXX") || fail "${LINENO:-}" "cannot create a temp file beside $ak; $ak left unchanged"
  total=$(grep -c '' "$ak") || [ "$?" -eq 1 ] || refuse_copy "cannot read it"
  mine=$(grep -c -F "$KEY_TAG:" "$ak") || [ "$?" -eq 1 ] || refuse_copy "cannot read it"
  # grep exits 1 when it kept no line (only ours were there): fine; above 1 (e.g. a write error) never is
  rc=0; grep -v -F "$KEY_TAG:" "$ak" > "$tmp" || rc=$?
  [ "$rc" -le 1 ] || refuse_copy "grep exited $rc copying it"
  kept=$(grep -c '' "$tmp") || [ "$?" -eq 1 ] || refuse_copy "cannot read the copy back"
  [ "$kept" -eq $((total - mine)) ] || refuse_copy "the copy holds $kept of its $((total - mine)) other lines"
  added=0
  if [ -n "$1" ]; then
    printf '%b' "$1" >> "$tmp" || refuse_copy "cannot append the peer lines"
    added=$(printf '%b' "$1" | grep -c '')
  fi
  now=$(grep -c '' "$tmp") || [ "$?" -eq 1 ] || refuse_copy "cannot read the copy back"
  [ "$now" -eq $((kept + added)) ] || refuse_copy "the copy holds $now lines, expected $((kept + added))"
  chmod 600 "$tmp" || refuse_copy "cannot chmod the copy"
  # coreutils' sync FILE fsyncs the file (an old sync ignores the operand and syncs everything)
  sync "$tmp" || refuse_copy "cannot sync the copy"
  mv -f "$tmp" "$ak" || refuse_copy "cannot rename the copy over it"
  sync "$HOME/.ssh" 2>/dev/null || :  # the rename itself; best effort (the file is complete either way)
}
refuse_copy() {
  rm -f "$tmp"
  fail "" "$ak on $NODE: $1; $ak left unchanged (a full disk?)"
}
# Writes text $2 to file $1 through a temp file, executable.
install_text() {
  printf '%b' "$2" > "$1.tmp"
  chmod 755 "$1.tmp"
  mv -f "$1.tmp" "$1"
}

pidfile="$state/$PID_NAME"
case "$ACTION" in
  remove)
    stop_pidfile "$pidfile"
    rm -f "$script"
    if [ -n "$MANAGE_PEERS" ]; then
      rm -f "$share/$PEER_STOP_NAME"
      authorize_peers ""
    fi
    echo "memory watchdog removed from $NODE; log kept at $LOG_PATH"
    exit 0 ;;
  install) ;;
  *) fail "${LINENO:-}" "ACTION=$ACTION: expected install or remove" ;;
esac

mkdir -p "$share" "$state"
# An earlier version's copy at the shared fixed paths is retired only when it guards THIS stack's
# container (its script names it); another stack's copy is left alone.
legacy="$HOME/$LEGACY_SHARE_DIR/$SCRIPT_NAME"
if grep -qxF "CONTAINER='$CONTAINER'" "$legacy" 2>/dev/null; then
  stop_pidfile "$HOME/$LEGACY_STATE_DIR/$PID_NAME"
  rm -f "$legacy" "$HOME/$LEGACY_SHARE_DIR/$PEER_STOP_NAME"
fi
stop_pidfile "$pidfile"
if [ -n "$MANAGE_PEERS" ]; then
  install_text "$share/$PEER_STOP_NAME" "$PEER_STOP"
  authorize_peers "$AUTHORIZED_KEYS"
fi
install_text "$script" "$WATCHDOG"
if command -v setsid >/dev/null 2>&1; then
  setsid nohup sh "$script" >/dev/null 2>&1 </dev/null &
else
  nohup sh "$script" >/dev/null 2>&1 </dev/null &
fi
i=0; while [ ! -s "$pidfile" ] && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
pid=$(cat "$pidfile" 2>/dev/null || true)
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
  echo "memory watchdog for $CONTAINER running on $NODE: pid $pid, log $LOG_PATH"
else
  fail "${LINENO:-}" "memory watchdog on $NODE did not start; see $LOG_PATH"
fi
