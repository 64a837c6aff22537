#!/usr/bin/env bash
# Moves stacks kept inside the clone (.state/backend and .state/passphrase, before 0.8) to the state directory
# outside it. Refuses to merge into a backend that already holds stacks: nothing is overwritten or lost.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old="$repo/.state"
new="${DSV41_STATE_HOME:-${XDG_STATE_HOME:-$HOME/.local/state}/dsv41-exl3}"
if [ ! -d "$old/backend/.pulumi" ]; then
    echo "move-state: no stacks under $old/backend; nothing to move (state lives in $new)"
    exit 0
fi
if [ -d "$new/backend/.pulumi" ]; then
    echo "move-state: $new/backend already holds stacks; refusing to merge. Move them by hand" \
        "(pulumi stack export/import) or set DSV41_STATE_HOME to an empty directory." >&2
    exit 1
fi
if [ -s "$new/passphrase" ] && [ -s "$old/passphrase" ] && ! cmp -s "$old/passphrase" "$new/passphrase"; then
    echo "move-state: $new/passphrase exists and differs from $old/passphrase; refusing to replace it." >&2
    exit 1
fi
(umask 077 && mkdir -p "$new")
mv "$old/backend" "$new/backend"
[ ! -s "$old/passphrase" ] || mv "$old/passphrase" "$new/passphrase"
echo "move-state: stacks moved to $new/backend (passphrase: $new/passphrase)"
