#!/bin/sh
# Runs the size check (size_check.sh, rendered) on one node, bounded by a timeout: from the node's own
# filesystem (MODE=bind: `sh -s`), or inside a throwaway container that mounts the node's two weight volumes
# read-only, exactly as the serving container will (MODE=volume).
# Header values (manifest.render_bind_check / render_volume_check):
#   NODE        the node's name, for messages
#   MODE        bind or volume
#   TIMEOUT_S   bound on the check, seconds
#   SIZE_CHECK  (text) the rendered size_check.sh, fed to `sh -s` on stdin
#   CONTAINER, IMAGE, MODEL_VOLUME, ENGRAM_VOLUME, MOUNT, MODEL_DIR, ENGRAM_VLLM_DIR  (volume only; empty for bind)
#               the check container's name and image, the volumes, and where they mount (MOUNT/MODEL_DIR ...):
#               the engram volume is the slim Engram directory, so it mounts where the listing names it
set -eu
case "$MODE" in
  bind) set -- sh -s ;;
  volume)
    set -- docker run --rm -i --name "$CONTAINER" --network none --entrypoint sh \
      -v "$MODEL_VOLUME:$MOUNT/$MODEL_DIR:ro" -v "$ENGRAM_VOLUME:$MOUNT/$ENGRAM_VLLM_DIR:ro" "$IMAGE" -s
    docker rm -f "$CONTAINER" >/dev/null 2>&1 || true ;;
  *) fail "${LINENO:-}" "MODE=$MODE: expected bind or volume" ;;
esac
rc=0
printf '%b' "$SIZE_CHECK" | timeout --kill-after=30 "$TIMEOUT_S" "$@" || rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  if [ "$MODE" = volume ]; then docker rm -f "$CONTAINER" >/dev/null 2>&1 || true; fi
  fail "${LINENO:-}" "weights check on node $NODE timed out after ${TIMEOUT_S}s: a hung share (NFS mount)?" "$rc"
fi
# The size check explained any failure itself (its last stderr line says which files): its status, no report.
trap - EXIT
exit "$rc"
