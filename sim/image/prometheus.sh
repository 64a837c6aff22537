#!/usr/bin/env bash
# Builds the simulated cluster's Prometheus image and pushes it to the sim's registry: this machine's Debian
# `prometheus` and `prometheus-node-exporter` binaries (Go, they link libc only) on top of the stand-in image
# (Debian bookworm; its layers are already on every node, so this image costs the nodes two binaries).
# Contents: /usr/bin/prometheus and /usr/bin/prometheus-node-exporter, the latter also as `node_exporter` on
# PATH (the name the program runs: components/observability/spec.py), an empty /prometheus (the data volume's
# mount point), ENTRYPOINT ["prometheus"]. The program passes every flag itself.
# Skips everything when the registry already holds the image built from the same inputs: the stand-in image's
# digest, the two binaries and this file.
#
# Env: SIM_DOCKER_HOST (builder daemon, required), SIM_BASE_IMAGE (the stand-in image in the registry,
#      required: it is pushed first), SIM_IMAGE (this image's ref, required), SIM_STAMP_DIR (where the pushed key
#      is recorded), SIM_REGISTRY (127.0.0.1:5000).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
: "${SIM_DOCKER_HOST:?set SIM_DOCKER_HOST to the builder daemon, e.g. unix://<state>/node-1/docker.sock}"
: "${SIM_BASE_IMAGE:?set SIM_BASE_IMAGE to the stand-in image in the sim registry}"
: "${SIM_IMAGE:?set SIM_IMAGE to this image ref, e.g. 127.0.0.1:5000/dsv41-exl3/prometheus:2.42.0}"
registry=${SIM_REGISTRY:-127.0.0.1:5000}
stamps=${SIM_STAMP_DIR:?set SIM_STAMP_DIR}
image=$SIM_IMAGE
docker() { command docker --host "$SIM_DOCKER_HOST" "$@"; }
log() { echo "sim-image: $*" >&2; }

prometheus=/usr/bin/prometheus
node_exporter=/usr/bin/prometheus-node-exporter
for bin in "$prometheus" "$node_exporter"; do
  [ -x "$bin" ] || { log "$bin missing: apt-get install prometheus prometheus-node-exporter (make sim-up does)"; exit 1; }
done

digest() {  # the registry's digest for an image ref, empty when it has none
  python3 - "$registry" "$1" <<'PY'
import sys, urllib.request
registry, image = sys.argv[1], sys.argv[2]
name, tag = image[len(registry) + 1:].rsplit(":", 1)
req = urllib.request.Request(f"http://{registry}/v2/{name}/manifests/{tag}", method="HEAD",
                             headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
try:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5) as r:
        print(r.headers.get("Docker-Content-Digest") or "")
except Exception:
    print("")
PY
}

base_digest=$(digest "$SIM_BASE_IMAGE")
[ -n "$base_digest" ] || { log "$SIM_BASE_IMAGE is not in the registry: build the stand-in image first"; exit 1; }
key=$( { echo "$base_digest"; sha256sum < "$prometheus"; sha256sum < "$node_exporter"; cat "$here/prometheus.sh"; } |
  sha256sum | cut -c1-16)
stamp=$stamps/prometheus.key
if [ "$(cat "$stamp" 2>/dev/null)" = "$key" ] && [ -n "$(digest "$image")" ]; then
  log "$image is up to date in the registry ($key)"
  exit 0
fi

version=$("$prometheus" --version 2>&1 | sed -n '1s/^prometheus, version \([^ ]*\).*/\1/p')
ctx=$(mktemp -d)
ctr=""
cleanup() { rm -rf "$ctx"; [ -z "$ctr" ] || docker rm -f "$ctr" >/dev/null 2>&1 || true; }
trap cleanup EXIT
mkdir -p "$ctx/usr/bin" "$ctx/usr/local/bin" "$ctx/prometheus"
install -m 0755 "$prometheus" "$ctx/usr/bin/prometheus"
install -m 0755 "$node_exporter" "$ctx/usr/bin/prometheus-node-exporter"
ln -s /usr/bin/prometheus-node-exporter "$ctx/usr/local/bin/node_exporter"
log "adding prometheus $version and node_exporter on top of $SIM_BASE_IMAGE"
docker pull -q "$SIM_BASE_IMAGE" >/dev/null
ctr=$(docker create --network none "$SIM_BASE_IMAGE" /bin/true)
tar --numeric-owner --owner=0 --group=0 -C "$ctx" -cf - . | docker cp - "$ctr:/"
docker commit \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change "LABEL dsv41.sim.inputs=$key dsv41.sim.prometheus=$version" \
  --change 'ENTRYPOINT ["prometheus"]' \
  --change 'CMD []' \
  --change 'WORKDIR /prometheus' \
  "$ctr" "$image" >/dev/null
docker rm -f "$ctr" >/dev/null
ctr=""
log "docker push $image"
docker push "$image" >/dev/null
docker image rm "$image" >/dev/null  # untag only: every node gets it by pulling
mkdir -p "$stamps"
echo "$key" > "$stamp"
log "pushed $image ($key)"
