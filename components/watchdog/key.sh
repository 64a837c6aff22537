#!/bin/sh
# This node's watchdog key pair: ACTION=create makes it once (kept on the node; the private key never
# leaves it) and prints the public half after PUBKEY_MARKER; ACTION=remove deletes it and the watchdog's
# known_hosts. Header values: ACTION, STATE_DIR (under $HOME), KEY_NAME, KEY_TAG (the key's comment),
# PUBKEY_MARKER.
set -eu
state="$HOME/$STATE_DIR"
key="$state/$KEY_NAME"
case "$ACTION" in
  create)
    mkdir -p "$state"
    if [ ! -s "$key" ]; then ssh-keygen -q -t ed25519 -N '' -C "$KEY_TAG" -f "$key" </dev/null; fi
    echo "$PUBKEY_MARKER $(cut -d' ' -f1,2 "$key.pub")" ;;
  remove)
    rm -f "$key" "$key.pub" "$state/watchdog-known_hosts" "$state"/watchdog-known_hosts-* ;;
  *) fail "${LINENO:-}" "ACTION=$ACTION: expected create or remove" ;;
esac
