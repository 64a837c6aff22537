#!/bin/sh
# The endpoint's API key on the head: ACTION=write takes it on stdin (never argv) and writes it to
# $HOME/STATE_DIR/KEY_NAME, 0600, replaced whole (a reader never sees half a key); prints the file's absolute path,
# which the head rank bind-mounts read-only (serving.py). ACTION=remove deletes it.
# Header values: ACTION, NODE, STATE_DIR (under $HOME, the stack's state directory), KEY_NAME.
set -eu
umask 077
state="$HOME/$STATE_DIR"
key="$state/$KEY_NAME"
case "$ACTION" in
  write)
    mkdir -p "$state"
    tmp=$(mktemp "$state/.$KEY_NAME.XXXXXX") || fail "${LINENO:-}" "cannot create a file in $state on $NODE"
    if ! cat > "$tmp" || [ ! -s "$tmp" ]; then
      rm -f "$tmp"; fail "${LINENO:-}" "no API key arrived on stdin for $key on $NODE"
    fi
    mv -f "$tmp" "$key" || { rm -f "$tmp"; fail "${LINENO:-}" "cannot move the API key into $key on $NODE"; }
    echo "$key" ;;
  remove) rm -f "$key" ;;
  *) fail "${LINENO:-}" "ACTION=$ACTION: expected write or remove" ;;
esac
