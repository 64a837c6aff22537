#!/usr/bin/env bash
# Builds our own command provider (toolchain/command, on pulumi-go-provider) as pulumi-resource-command,
# stamped with $COMMAND_PROVIDER_VERSION (toolchain/versions.env: the version the pinned pulumi_command SDK's
# pulumi-plugin.json requests) and with a hash of its Go sources.
#
#   . toolchain/build_command.sh; build_command_provider "$BIN/pulumi-resource-command"   (from build.sh)
#   bash toolchain/build_command.sh "$BIN/pulumi-resource-command"                        (standalone)
#
# A binary that already reports that version and that source hash is kept: the warm check runs the
# binary twice (--version, --source-hash) and hashes ~10 small files, well under a second.
# Cold (empty module cache): `go build` downloads ~125 module paths; 2 cores, caches warm: about 1 min.

_command_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
COMMAND_PROVIDER_SRC="$_command_here/command"

# Hash of everything that goes into the binary (go.mod, go.sum, non-test .go files), 16 hex digits.
command_provider_source_hash() {
    (cd "$COMMAND_PROVIDER_SRC" &&
        find . -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) ! -name '*_test.go' -print0 |
        LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-16
}

build_command_provider() { # $1 = output path of the binary
    local out="${1:?usage: build_command_provider <output path of pulumi-resource-command>}"
    local version="${COMMAND_PROVIDER_VERSION:-}"
    if [ -z "$version" ]; then
        version="$(sed -n 's/^COMMAND_PROVIDER_VERSION=//p' "$_command_here/versions.env")"
    fi
    [ -n "$version" ] || { echo "build_command: COMMAND_PROVIDER_VERSION not set" >&2; return 1; }
    local hash
    hash="$(command_provider_source_hash)"
    if [ -x "$out" ] && [ "$("$out" --version 2>/dev/null)" = "$version" ] &&
        [ "$("$out" --source-hash 2>/dev/null)" = "$hash" ]; then
        printf 'toolchain: pulumi-resource-command %s (sources %s) already built: %s\n' "$version" "$hash" "$out"
        return 0
    fi
    command -v go >/dev/null || { echo "build_command: 'go' not found on PATH" >&2; return 1; }
    printf 'toolchain: building pulumi-resource-command %s from %s\n' "$version" "$COMMAND_PROVIDER_SRC"
    mkdir -p "$(dirname "$out")"
    local start=$SECONDS
    (cd "$COMMAND_PROVIDER_SRC" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly nice -n 10 \
        go build -trimpath -ldflags "-s -w -X main.Version=$version -X main.SourceHash=$hash" \
        -o "$out.partial" .) || return 1
    mv -f "$out.partial" "$out"
    local got
    got="$("$out" --version 2>/dev/null || true)"
    if [ "$got" != "$version" ]; then
        echo "build_command: $out reports version '$got', expected '$version'" >&2
        return 1
    fi
    printf 'toolchain: built pulumi-resource-command %s in %d s\n' "$version" "$((SECONDS - start))"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    build_command_provider "$@"
fi
