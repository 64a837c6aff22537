#!/usr/bin/env bash
# Builds pulumi-resource-docker: the upstream Terraform docker provider (the one pulumi-docker wraps), bridged by
# our module in toolchain/docker. Run by build.sh; usable alone: build_docker.sh OUT [--tidy].
#
# Go forbids importing the upstream's internal/provider from another module, so the upstream is copied out of the
# module cache into a build folder (never into the tree), our pulumishim package is added to the copy, and our
# module's `replace` points there. Then tfgen writes the schema, which the provider binary embeds.
# --tidy refreshes toolchain/docker/go.mod and go.sum from the build folder (after a version bump).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=toolchain/env.sh
. "$here/env.sh"
out="${1:?usage: build_docker.sh OUT [--tidy]}"
tidy="${2:-}"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod

log() { printf 'toolchain: %s\n' "$*"; }

want="$DOCKER_PROVIDER_VERSION"
# What goes into the binary: our bridge module and the pinned upstream. A stamp beside the binary records it.
source_hash() {
    (cd "$here/docker" && find . -type f ! -name '*_test.go' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
        echo "$DOCKER_UPSTREAM_MODULE@$DOCKER_UPSTREAM_VERSION $want") | sha256sum | cut -c1-16
}
sources="$(source_hash)"
stamp="$out.sources"
if [ -x "$out" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$sources" ] && [ -z "$tidy" ] \
    && [ "$("$out" -version 2>/dev/null | head -n 1)" = "$want" ]; then
    log "pulumi-resource-docker $want (sources $sources) already built: $out"
    exit 0
fi

start=$SECONDS
build="$DSV41_TOOLCHAIN_DIR/build/docker"
rm -rf "$build"
mkdir -p "$build"
cp -R "$here/docker/." "$build/"
rm -rf "$build/_upstream"

# Asked for outside any module: the served path (kreuzwerker) differs from the one its go.mod declares.
upstream_dir="$(cd "$DSV41_TOOLCHAIN_DIR" && go mod download -json "$DOCKER_UPSTREAM_MODULE@$DOCKER_UPSTREAM_VERSION" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[ -d "$upstream_dir" ] || { echo "toolchain: could not download $DOCKER_UPSTREAM_MODULE@$DOCKER_UPSTREAM_VERSION" >&2; exit 1; }
cp -R "$upstream_dir" "$build/upstream"
chmod -R u+w "$build/upstream"  # module cache copies are read-only
cp -R "$here/docker/_upstream/." "$build/upstream/"

cd "$build"
if [ -n "$tidy" ]; then
    go mod tidy
    cp go.mod go.sum "$here/docker/"
    log "refreshed toolchain/docker/go.mod and go.sum"
fi
log "building pulumi-tfgen-docker (cold: about 10 min on 2 cores)"
ldflags="-s -w -X main.version=$want"
go build -ldflags "$ldflags" -o "$build/pulumi-tfgen-docker" ./cmd/pulumi-tfgen-docker
# tfgen looks for the upstream's docs online; offline it warns and goes on.
"$build/pulumi-tfgen-docker" schema --out "$build/cmd/pulumi-resource-docker" >"$build/tfgen.log" 2>&1 \
    || { tail -n 30 "$build/tfgen.log" >&2; exit 1; }
cp "$build/cmd/pulumi-resource-docker/schema.json" "$(dirname "$out")/docker-schema.json"
go build -ldflags "$ldflags" -o "$out.partial" ./cmd/pulumi-resource-docker
mv -f "$out.partial" "$out"
source_hash >"$stamp"  # after a --tidy, of the new go.sum
got="$("$out" -version 2>/dev/null | head -n 1)"
[ "$got" = "$want" ] || { echo "toolchain: built $out reports '$got', expected '$want'" >&2; exit 1; }
rm -rf "$build/upstream"  # the copy is only needed while compiling
log "built pulumi-resource-docker $want in $((SECONDS - start)) s"
