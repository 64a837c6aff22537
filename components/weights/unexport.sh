#!/bin/sh
# Withdraws this stack's export entries and removes its exports file (the weights stay on the head).
# Header values (manifest.render_unexport_command):
#   EXPORTS_FILE  this stack's file in /etc/exports.d
#   EXPORT_ENTRY  the prefix of its comment lines that name each entry (`<prefix><client> <path>`)
#   FALLBACK      (text) `<client> <path>` lines to withdraw when the file is gone (what the last create exported)
set -eu
PATH="$PATH:/usr/sbin:/sbin"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
if [ -f "$EXPORTS_FILE" ]; then
  entries=$(sed -n "s/^$EXPORT_ENTRY//p" "$EXPORTS_FILE")
else
  entries=$(printf '%b' "$FALLBACK")
fi
if command -v exportfs >/dev/null 2>&1; then
  printf '%s\n' "$entries" | while IFS=' ' read -r client path; do
    [ -n "$client" ] || continue
    $SUDO exportfs -u "$client:$path" || true
  done
fi
$SUDO rm -f "$EXPORTS_FILE"
