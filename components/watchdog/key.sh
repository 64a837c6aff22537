#!/bin/sh
# This node's watchdog key pair: ACTION=create makes it once (kept on the node; the private key never
# leaves it) and prints the public half after PUBKEY_MARKER; ACTION=remove deletes it and this node's
# watchdog known_hosts. Header values: ACTION, NODE, STATE_DIR (under $HOME), KEY_NAME (names the stack and
# the node: nodes sharing one home, NFS homes or the simulated cluster, must not share a key), LEGACY_KEY_NAME
# (the one name every node used before), KEY_TAG (the key's comment), PUBKEY_MARKER.
set -eu
state="$HOME/$STATE_DIR"
key="$state/$KEY_NAME"
case "$ACTION" in
  create)
    mkdir -p "$state"
    if [ ! -s "$key" ]; then
      # Made under a temp name, then linked into place: never a prompt (ssh-keygen asks before it overwrites),
      # never a half-written key, and ln never replaces: of two runs at once the first key stays.
      tmp=$(mktemp -d "$state/.$KEY_NAME.XXXXXX")
      if ! ssh-keygen -q -t ed25519 -N '' -C "$KEY_TAG" -f "$tmp/key" </dev/null; then
        rm -rf "$tmp"; fail "${LINENO:-}" "ssh-keygen failed making $key on $NODE"
      fi
      ln "$tmp/key" "$key" 2>/dev/null || [ -s "$key" ] ||
        { rm -rf "$tmp"; fail "${LINENO:-}" "cannot link the new key to $key on $NODE"; }
      rm -rf "$tmp"
    fi
    # The public half of the private key in place (not a .pub that another run may have left)
    pub=$(ssh-keygen -y -f "$key" </dev/null) || fail "${LINENO:-}" "$key on $NODE is not a readable private key"
    printf '%s\n' "$pub" > "$key.pub.$$" && mv -f "$key.pub.$$" "$key.pub"
    echo "$PUBKEY_MARKER $(printf '%s\n' "$pub" | cut -d' ' -f1,2)" ;;
  remove)
    # Only this node's files: on a shared home the other nodes' keys and known_hosts are theirs.
    rm -f "$key" "$key.pub" "$state/$LEGACY_KEY_NAME" "$state/$LEGACY_KEY_NAME.pub" "$state/watchdog-known_hosts" \
      "$state/watchdog-known_hosts-$NODE" ;;
  *) fail "${LINENO:-}" "ACTION=$ACTION: expected create or remove" ;;
esac
