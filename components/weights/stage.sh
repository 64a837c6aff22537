#!/bin/sh
# Stages the weights on the head: reads the token line, then the staging program (one line of base64: a zip
# application of components/weights/staging/, manifest.stage_program_text), from stdin and runs it in a
# throwaway container of the serving image. The token stays in an unexported variable of this shell and
# reaches the staging program on its stdin (`docker run -i`, fed by the builtin printf): never argv, never a
# header value, never an environment variable (`-e` would keep it in the container's Config.Env, which
# `docker inspect` shows for as long as the container lives).
# Header values (manifest.render_stage_command):
#   WEIGHTS_ROOT the weights root as configured: absolute, or `~` / `~/...` (the remote user's home, expanded here)
#   MODEL_DIR, ENGRAM_DIR the two directories staged under it (the staging program builds the slim Engram
#                directory beside them, from what it staged)
#   WITH_TOKEN   1: the first stdin line is the token; 0: it is empty (anonymous)
#   HF_ENDPOINT  the Hub endpoint, or empty for the default
#   IMAGE        the image whose python3 runs the staging program
#   CONTAINER    this stack's staging container name
#   PLAN         the staging plan (one line of JSON)
#   TIMEOUT_S    bound on the whole staging run, seconds
set -eu
token=""
IFS= read -r token || true
[ "$WITH_TOKEN" = 1 ] || token=""
case "$WEIGHTS_ROOT" in
  "~") root="$HOME" ;;
  \~/*) root="$HOME/${WEIGHTS_ROOT#\~/}" ;;
  *) root="$WEIGHTS_ROOT" ;;
esac
mkdir -p "$root"
root=$(cd "$root" && pwd -P)
# The root must be a directory of its own: it is exported, and staging removes files it staged there.
# (export.sh refuses the same.)
home=$(cd "${HOME:-/nonexistent}" 2>/dev/null && pwd -P) || home="${HOME:-}"
if [ "$root" = / ] || [ "$root" = "$home" ]; then
  fail "${LINENO:-}" "weights root $root on the head is / or the home directory of $(id -un) itself; use a directory of its own, e.g. ~/dsv41-exl3 (weights.root)"
fi
# It is bind-mounted with -v, whose syntax splits at ':' and ','; config refuses them, this catches `~` or a
# symlink resolving to such a path.
case "$root" in
  *[:,]*) fail "${LINENO:-}" "weights root $root on the head holds ':' or ',', which docker's -v splits at; use a directory without them (weights.root)" ;;
esac
mkdir -p "$root/$MODEL_DIR" "$root/$ENGRAM_DIR"
stage=$(mktemp -d)
# Replaces the header's EXIT trap, so it keeps its report of an unexplained exit.
# shellcheck disable=SC2329 # invoked by the EXIT trap below
on_exit() {
  st=$?
  rm -rf "$stage"
  [ "$st" -eq 0 ] || [ -n "${DSV41_FAILED:-}" ] || echo "$DSV41_SCRIPT: exited $st" >&2
}
trap on_exit EXIT
command -v base64 >/dev/null 2>&1 || fail "${LINENO:-}" "base64 (coreutils) is missing on this node"
base64 -d > "$stage/stage_weights.pyz" || fail "${LINENO:-}" "could not decode the staging program read from stdin"

# docker's -e options: no secret among them. The serving image may bake in HF_HUB_OFFLINE=1 (vLLM runs
# offline) or hf_transfer: staging needs neither. Xet's chunk cache would fill the head's temp dir; HF_HOME
# lives in the throwaway stage dir.
set --
if [ -n "$HF_ENDPOINT" ]; then set -- "$@" -e "HF_ENDPOINT=$HF_ENDPOINT"; fi
set -- "$@" -e HF_HOME=/stage/hf-home -e HF_HUB_OFFLINE=0 -e HF_HUB_ENABLE_HF_TRANSFER=0 \
  -e HF_XET_CHUNK_CACHE_SIZE_BYTES=0 -e HF_HUB_DISABLE_PROGRESS_BARS=1 -e HF_HUB_DISABLE_TELEMETRY=1

docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
rc=0
# The token line (empty: anonymous) is the staging program's whole stdin.
printf '%s\n' "$token" | timeout --kill-after=60 "$TIMEOUT_S" docker run --rm -i --name "$CONTAINER" --network host \
  --user "$(id -u):$(id -g)" "$@" -v "$root":/weights -v "$stage":/stage --entrypoint python3 "$IMAGE" \
  /stage/stage_weights.pyz --plan "$PLAN" --dest-root /weights --host-root "$root" || rc=$?
token=""
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
  fail "${LINENO:-}" "weights staging timed out after ${TIMEOUT_S}s on the head; raise stage_timeout_s and re-run (it resumes)" "$rc"
fi
# Any other failure is the staging program's (or docker's), explained on stderr already: its status, no report.
rm -rf "$stage"
trap - EXIT
exit "$rc"
