#!/bin/sh
# Serves this head's staged weights to one worker for the length of one copy (weights.share: copy): runs
# the source program (copy_source.py) in a throwaway container of the serving image, the weights root mounted
# read-only, on the host network (it listens on the head's fabric address). stdin: the source's config line
# (copy_config.SourceConfig, the run's token among it; never argv), then the deployer's heartbeats: EOF, or a
# silence (copy_source.py's lifeline), stops the server, docker removes it, and this shell ends with it.
# Header values (local_copy.render_source_command):
#   WEIGHTS_ROOT  the head's weights root (absolute, as staging reported it)
#   BIND          the head's fabric address
#   IMAGE         the image whose python3 runs the source (the head's serving image)
#   CONTAINER     this stack's and worker's source container name
#   SOURCE_PYZ    the source program, one line of base64: a zip application of copy_source.py and the files its
#                 imports name (local_copy.source_program_text), decoded here to copy_source.pyz
set -eu
IFS= read -r config || fail "${LINENO:-}" "no source config on stdin"
[ -d "$WEIGHTS_ROOT" ] || fail "${LINENO:-}" "weights root $WEIGHTS_ROOT is not on the head: staging did not run?"
root=$(cd "$WEIGHTS_ROOT" && pwd -P)
# Which directory this is, across machines: a worker whose copy root is this very directory (one shared
# filesystem) is refused by the copier instead of copying the files onto themselves.
ident="$(cat /etc/machine-id 2>/dev/null || hostname):$(stat -c '%d:%i' "$root")"
stage=$(mktemp -d)
# shellcheck disable=SC2329 # invoked by the EXIT trap below
on_exit() {
  st=$?
  [ -z "${feeder:-}" ] || kill "$feeder" 2>/dev/null || true
  rm -rf "$stage"
  docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
  [ "$st" -eq 0 ] || [ -n "${DSV41_FAILED:-}" ] || echo "$DSV41_SCRIPT: exited $st" >&2
}
trap on_exit EXIT
command -v base64 >/dev/null 2>&1 || fail "${LINENO:-}" "base64 (coreutils) is missing on this node"
printf '%s' "$SOURCE_PYZ" | base64 -d > "$stage/copy_source.pyz" || fail "${LINENO:-}" "could not decode the source program"
chmod 0755 "$stage"
docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
echo "DSV41_COPY_SOURCE_IDENT $ident"
# The source's stdin: the config line, then this session's stdin (the heartbeats) until the deployer's EOF,
# through a fifo, not a pipe: when the source stops on its own (a silent deployer), the feeder is killed and this
# shell ends, where a pipeline would wait for its `cat` until sshd gave up on the session (hours).
mkfifo "$stage/stdin"
exec 3<&0  # a background job's own stdin is /dev/null
{ trap - EXIT; printf '%s\n' "$config"; exec cat <&3 3<&-; } > "$stage/stdin" &
feeder=$!
exec 3<&-
rc=0
docker run --rm -i --name "$CONTAINER" --network host --user "$(id -u):$(id -g)" \
  -v "$root":/weights:ro -v "$stage":/stage:ro --entrypoint python3 "$IMAGE" \
  /stage/copy_source.pyz --root /weights --bind "$BIND" < "$stage/stdin" || rc=$?
exit "$rc"
