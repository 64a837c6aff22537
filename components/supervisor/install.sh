# Installs (or removes) the supervisor's files on one node; supervisor.py wires it. The payload arrives on
# stdin, never in argv: a base64 tar.gz of the agent's code, its config and its token (a secret).
#
# Header values (scripts.render):
#   ACTION     install | remove
#   SHARE_DIR  under $HOME: the code, config and token (replaced whole on install)
#   STATE_DIR  under $HOME: the leader's state (pause, restarts, history); kept on install, removed on remove
#   IMAGE      the serving image the supervisor runs in
#   NOTIFY     the first word of supervisor.notifyCommand ("" = none): it must exist in IMAGE now, not at 3 a.m.
# Success (install): one JSON line on stdout: {"dir": ..., "state": ..., "socket": ...}, the host paths the
# supervisor's container mounts.
set -eu
share="$HOME/$SHARE_DIR"
state="$HOME/$STATE_DIR"
if [ "$ACTION" = remove ]; then
  rm -rf "$share" "$share.new"
  rm -rf "$state"
  echo "supervisor files removed from $share and $state"
  exit 0
fi
command -v base64 >/dev/null 2>&1 || fail "${LINENO:-}" "base64 (coreutils) is missing on this node"
command -v tar >/dev/null 2>&1 || fail "${LINENO:-}" "tar is missing on this node"
umask 077
mkdir -p "$state"
rm -rf "$share.new"
mkdir -p "$share.new"
base64 -d | tar -xzf - -C "$share.new" || fail "${LINENO:-}" "could not unpack the supervisor's files into $share.new"
rm -rf "$share"
mv "$share.new" "$share"
# The container reaches the node's docker through the socket its sessions use (DOCKER_HOST), else the default.
socket=${DOCKER_HOST:-unix:///var/run/docker.sock}
case "$socket" in
  unix://*) socket=${socket#unix://} ;;
  *) fail "${LINENO:-}" "DOCKER_HOST=$socket is not a unix socket: the supervisor mounts the node's docker socket" ;;
esac
[ -S "$socket" ] || fail "${LINENO:-}" "no docker socket at $socket on this node"
if [ -n "$NOTIFY" ]; then
  # shellcheck disable=SC2016 # $1 is the inner shell's
  if ! timeout 120 docker run --rm --network none --entrypoint sh "$IMAGE" -c 'command -v "$1"' sh "$NOTIFY" \
      >/dev/null 2>&1; then
    fail "${LINENO:-}" "supervisor.notifyCommand runs '$NOTIFY', which the serving image does not have \
(it runs in the supervisor's container); use a command the image has (sh, python3, curl if installed)"
  fi
fi
printf '{"dir":"%s","state":"%s","socket":"%s"}\n' "$share" "$state" "$socket"
