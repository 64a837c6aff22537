#!/bin/sh
# Fills this worker's local copy of the weights from the head's source (weights.share: copy): runs
# copy_weights.py in a throwaway container of the serving image with the copy root mounted read-write, on
# the host network (it connects from the worker's fabric address). stdin: the copier's config line (its token
# among it: never argv, never a file), then the copier (one line of base64: a zip application of copy_weights.py
# and the files its imports name, local_copy.copier_program_text), decoded here to copy_weights.pyz.
# Header values (local_copy.render_copy_command):
#   NODE          this worker's name, for messages
#   COPY_ROOT     the copy root as configured: absolute, or `~` / `~/...` (expanded here, on the worker)
#   MODEL_DIR, ENGRAM_VLLM_DIR the two directories copied under it (what the ranks mount: model/ and the slim
#                 Engram directory)
#   SOURCE        http://<head fabric ip>:<port> of the head's source
#   SOURCE_IDENT  machine-id:dev:inode of the head's weights root
#   BIND          this worker's fabric address
#   IMAGE         the image whose python3 runs the copier (this worker's serving image)
#   CONTAINER     this stack's copier container name
#   STREAMS       parallel streams
#   TIMEOUT_S     bound on the whole copy, seconds
set -eu
IFS= read -r config || fail "${LINENO:-}" "no copier config on stdin"
case "$COPY_ROOT" in
  "~") root="$HOME" ;;
  \~/*) root="$HOME/${COPY_ROOT#\~/}" ;;
  *) root="$COPY_ROOT" ;;
esac
mkdir -p "$root"
root=$(cd "$root" && pwd -P)
home=$(cd "${HOME:-/nonexistent}" 2>/dev/null && pwd -P) || home="${HOME:-}"
if [ "$root" = / ] || [ "$root" = "$home" ]; then
  fail "${LINENO:-}" "copy root $root on $NODE is / or the home directory of $(id -un) itself; use a directory of its own, e.g. ~/dsv41-exl3 (weights.copyRoot)"
fi
# Bind-mounted with -v, which splits at ':' and ',' (config refuses them; this catches `~` or a symlink).
case "$root" in
  *[:,]*) fail "${LINENO:-}" "copy root $root on $NODE holds ':' or ',', which docker's -v splits at; use a directory without them (weights.copyRoot)" ;;
esac
mkdir -p "$root/$MODEL_DIR" "$root/$ENGRAM_VLLM_DIR"
ident="$(cat /etc/machine-id 2>/dev/null || hostname):$(stat -c '%d:%i' "$root")"
stage=$(mktemp -d)
# shellcheck disable=SC2329 # invoked by the EXIT trap below
on_exit() {
  st=$?
  rm -rf "$stage"
  [ "$st" -eq 0 ] || [ -n "${DSV41_FAILED:-}" ] || echo "$DSV41_SCRIPT: exited $st" >&2
}
trap on_exit EXIT
command -v base64 >/dev/null 2>&1 || fail "${LINENO:-}" "base64 (coreutils) is missing on this node"
base64 -d > "$stage/copy_weights.pyz" || fail "${LINENO:-}" "could not decode the copier read from stdin"
chmod 0755 "$stage"
docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
rc=0
printf '%s\n' "$config" | timeout --kill-after=30 "$TIMEOUT_S" docker run --rm -i --name "$CONTAINER" \
  --network host --user "$(id -u):$(id -g)" -v "$root":/copy -v "$stage":/stage:ro --entrypoint python3 "$IMAGE" \
  /stage/copy_weights.pyz --node "$NODE" --source "$SOURCE" --bind "$BIND" --dest /copy --host-dest "$root" \
  --streams "$STREAMS" --dest-ident "$ident" --source-ident "$SOURCE_IDENT" || rc=$?
config=""
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
  fail "${LINENO:-}" "the weights copy to $NODE timed out after ${TIMEOUT_S}s; run \`pulumi up\` again (it resumes)" "$rc"
fi
# Any other failure is the copier's (or docker's), explained on stderr already: its status, no report.
rm -rf "$stage"
trap - EXIT
exit "$rc"
