#!/usr/bin/env bash
# Builds the stand-in serving image and pushes it to the sim's registry:
#   1. base root filesystem tarball (base.sh), cached OUTSIDE the work tree, keyed by the hash of its inputs;
#   2. `docker import` of that tarball into the builder daemon (once per key);
#   3. a thin layer on top with sim/standin/ at /opt/standin, `vllm` on PATH and the recipe image's chat
#      template path /opt/dsv41/chat_template.jinja (sim/image/chat_template.jinja; cheap: redone when
#      sim/standin, the template or this file changes), ENTRYPOINT ["vllm"];
#   4. `docker push` to the registry, then untag on the builder so every node gets it by pulling.
# Skips everything when the registry already holds the image built from the same inputs.
#
# Env: SIM_DOCKER_HOST (builder daemon, required), SIM_STATE_DIR (stamp), SIM_REGISTRY (127.0.0.1:5000),
#      SIM_IMAGE (default $SIM_REGISTRY/dsv41-exl3/standin:2.9bpw), SIM_STANDIN_DIR (default sim/standin),
#      DSV41_CACHE (default ~/.cache/dsv41-exl3), PIP (default <repo>/venv/bin/pip).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
: "${SIM_DOCKER_HOST:?set SIM_DOCKER_HOST to the builder daemon, e.g. unix://<state>/node-1/docker.sock}"
state=${SIM_STATE_DIR:-$repo/.state/sim}
registry=${SIM_REGISTRY:-127.0.0.1:5000}
image=${SIM_IMAGE:-$registry/dsv41-exl3/standin:2.9bpw}
standin=${SIM_STANDIN_DIR:-$repo/sim/standin}
cache=${DSV41_CACHE:-$HOME/.cache/dsv41-exl3}/sim
export PIP=${PIP:-$repo/venv/bin/pip}
docker() { command docker --host "$SIM_DOCKER_HOST" "$@"; }
log() { echo "sim-image: $*" >&2; }

for f in vllm vllm_standin.py; do
  [ -f "$standin/$f" ] || { log "$standin/$f missing: the stand-in model server goes there (sim/standin/)"; exit 1; }
done

sha() { sha256sum | cut -c1-16; }
base_key=$( { uname -m; cat "$here/base.sh" "$here/requirements.txt"; } | sha)
# The standin tree by content and mode (no mtimes), so a touch alone does not rebuild.
standin_sum=$(cd "$standin" && find . -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z |
  xargs -0 stat -c '%a %n' | while read -r mode name; do echo "$mode $name $(sha256sum < "$name")"; done | sha)
template=$here/chat_template.jinja
[ -f "$template" ] || { log "$template missing: the program passes --chat-template /opt/dsv41/chat_template.jinja"; exit 1; }
final_key=$( { echo "$base_key $standin_sum"; cat "$here/build.sh" "$template"; } | sha)
stamp=$state/registry/standin.key

registry_has() {  # the tag exists in the registry (manifest HEAD)
  python3 - "$registry" "$image" <<'PY'
import sys, urllib.request
registry, image = sys.argv[1], sys.argv[2]
name, tag = image[len(registry) + 1:].rsplit(":", 1)
req = urllib.request.Request(f"http://{registry}/v2/{name}/manifests/{tag}", method="HEAD",
                             headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
try:
    urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5)
except Exception:
    sys.exit(1)
PY
}

if [ "$(cat "$stamp" 2>/dev/null)" = "$final_key" ] && registry_has; then
  log "$image is up to date in the registry ($final_key)"
  exit 0
fi

mkdir -p "$cache" "$state/registry"
base_tar=$cache/base-$base_key.tar
if [ ! -f "$base_tar" ]; then
  log "building base rootfs (debootstrap; about a minute) -> $base_tar"
  t0=$SECONDS
  bash "$here/base.sh" "$base_tar"
  # Only the current key's tarball is kept.
  find "$cache" -maxdepth 1 -name 'base-*.tar' ! -name "base-$base_key.tar" -delete
  log "base rootfs built in $((SECONDS - t0))s ($(du -h "$base_tar" | cut -f1))"
fi

base_image=dsv41-exl3/standin-base:$base_key
if ! docker image inspect "$base_image" >/dev/null 2>&1; then
  log "docker import $base_image"
  docker import --message "dsv41-exl3 sim base $base_key" "$base_tar" "$base_image" >/dev/null
fi

ctx=$(mktemp -d)
ctr=""
cleanup() { rm -rf "$ctx"; [ -z "$ctr" ] || docker rm -f "$ctr" >/dev/null 2>&1 || true; }
trap cleanup EXIT
mkdir -p "$ctx/opt/standin" "$ctx/opt/dsv41" "$ctx/usr/local/bin"
(cd "$standin" && tar --exclude=__pycache__ --exclude='*.pyc' -cf - .) | tar -C "$ctx/opt/standin" -xf -
chmod 0755 "$ctx/opt/standin/vllm"
install -m 0644 "$template" "$ctx/opt/dsv41/chat_template.jinja"
ln -s /opt/standin/vllm "$ctx/usr/local/bin/vllm"
log "adding sim/standin ($standin_sum) on top of $base_image"
ctr=$(docker create --network none "$base_image" /bin/true)
tar --numeric-owner --owner=0 --group=0 -C "$ctx" -cf - . | docker cp - "$ctr:/"
docker commit \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV PYTHONUNBUFFERED=1' \
  --change "LABEL dsv41.sim.inputs=$final_key" \
  --change 'ENTRYPOINT ["vllm"]' \
  --change 'CMD []' \
  "$ctr" "$image" >/dev/null
docker rm -f "$ctr" >/dev/null
ctr=""
log "docker push $image"
docker push "$image" >/dev/null
docker image rm "$image" >/dev/null  # untag only: the base stays as the next build's cache
echo "$final_key" > "$stamp"
log "pushed $image ($final_key)"
