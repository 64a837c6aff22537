#!/bin/sh
# Installs this stack's exports file on the head and exports exactly its entries; idempotent. Needs root or
# passwordless sudo. Other exports on the host are never re-synced (exportfs -o / -u per entry, never -ra).
# Header values (manifest.render_export_command):
#   HEAD_NAME     the head's name, for messages
#   WEIGHTS_ROOT  the weights root on the head, absolute and resolved (as staging reported it)
#   CLIENTS       the workers' fabric IPs, space-separated
#   OPTIONS       the export options (ro,...)
#   EXPORTS_DIR   the exports directory (/etc/exports.d)
#   EXPORTS_FILE  this stack's file in it
#   EXPORTS       (text) that file's content: one EXPORT_ENTRY comment line per client, then the export line
#   EXPORT_ENTRY  the prefix of those comment lines ("# export: "), followed by `<client> <path>`
#   LEGACY_FILE   the one fixed-name file every stack shared in earlier versions
#   LEGACY        (text) what that file held for exactly this export
set -eu
PATH="$PATH:/usr/sbin:/sbin"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
if ! command -v exportfs >/dev/null 2>&1; then
  fail "${LINENO:-}" "exportfs not found on head $HEAD_NAME: install nfs-kernel-server, or use share=bind"
fi
if command -v systemctl >/dev/null 2>&1 && ! systemctl is-active --quiet nfs-server; then
  fail "${LINENO:-}" "nfs-server is not running on head $HEAD_NAME: run 'sudo systemctl enable --now nfs-server'"
fi
root="$WEIGHTS_ROOT"
resolved=$(cd "$root" && pwd -P)
[ "$resolved" = "$root" ] || fail "${LINENO:-}" "weights root $root on head $HEAD_NAME resolves to $resolved; re-run staging"
# The root must be a directory of its own: it is exported, and staging removes files it staged there.
# (stage.sh refuses the same.)
home=$(cd "${HOME:-/nonexistent}" 2>/dev/null && pwd -P) || home="${HOME:-}"
if [ "$root" = / ] || [ "$root" = "$home" ]; then
  fail "${LINENO:-}" "weights root $root on head $HEAD_NAME is / or the home directory of $(id -un) itself; use a directory of its own, e.g. ~/dsv41-exl3 (weights.root)"
fi
tmp=$(mktemp)
# Replaces the header's EXIT trap, so it keeps its report of an unexplained exit.
on_exit() {
  st=$?
  rm -f "$tmp" "$tmp.legacy"
  [ "$st" -eq 0 ] || [ -n "${DSV41_FAILED:-}" ] || echo "$DSV41_SCRIPT: exited $st" >&2
}
trap on_exit EXIT
printf '%b' "$EXPORTS" > "$tmp"
# What this stack exported before and exports no more (a worker left, the root moved): withdraw just that.
if [ -f "$EXPORTS_FILE" ]; then
  sed -n "s/^$EXPORT_ENTRY//p" "$EXPORTS_FILE" | while IFS=' ' read -r client path; do
    if ! grep -qxF "$EXPORT_ENTRY$client $path" "$tmp"; then $SUDO exportfs -u "$client:$path" || true; fi
  done
fi
$SUDO mkdir -p "$EXPORTS_DIR"
$SUDO install -m 0644 "$tmp" "$EXPORTS_FILE"
for ip in $CLIENTS; do
  $SUDO exportfs -o "$OPTIONS" "$ip:$root"
done
# Earlier versions wrote one fixed-name file for every stack: drop it only when it holds exactly this export.
printf '%b' "$LEGACY" > "$tmp.legacy"
if [ "$LEGACY_FILE" != "$EXPORTS_FILE" ] && [ -f "$LEGACY_FILE" ] && cmp -s "$tmp.legacy" "$LEGACY_FILE"; then
  $SUDO rm -f "$LEGACY_FILE"
fi
