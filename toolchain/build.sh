#!/usr/bin/env bash
# Builds the project's Pulumi toolchain from Go modules (no release downloads) into a cache outside the
# work tree, keyed by version (see toolchain/env.sh for the path): the CLI, the docker provider bridged from
# the upstream Terraform provider (build_docker.sh), our command provider (build_command.sh), and the SDK's
# scripts beside them. A piece whose stamped binary is already there is skipped: a second run takes seconds.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=toolchain/env.sh
. "$here/env.sh"

export CGO_ENABLED=0
# Never let `go` fetch another Go toolchain: the go.mod's version must be met by the installed one.
export GOTOOLCHAIN=local

BIN="$DSV41_TOOLCHAIN_BIN"
SDK_DIR=""  # set by need_sdk_module
mkdir -p "$BIN"

log() { printf 'toolchain: %s\n' "$*"; }

stamped_version() { # prints the version a built binary reports, or nothing
    [ -x "$1" ] && "$1" version 2>/dev/null | head -n 1 || true
}

build_pulumi_cli() {
    local want="v$PULUMI_VERSION"
    if [ "$(stamped_version "$BIN/pulumi")" = "$want" ]; then
        log "pulumi $want already built: $BIN/pulumi"
        return
    fi
    log "building pulumi $want from $PULUMI_CLI_PACKAGE (cold: about 5 min on 2 cores, 1.4 GB of modules, 1.7 GB of build cache)"
    local start=$SECONDS
    (cd "$here/engine" && go build -tags osusergo,grpcnotrace \
        -ldflags "-s -w -X $PULUMI_VERSION_SYMBOL=$want" -o "$BIN/pulumi.partial" "$PULUMI_CLI_PACKAGE")
    mv -f "$BIN/pulumi.partial" "$BIN/pulumi"
    local got
    got="$(stamped_version "$BIN/pulumi")"
    if [ "$got" != "$want" ]; then
        echo "toolchain: built $BIN/pulumi reports version '$got', expected '$want'; check -ldflags -X $PULUMI_VERSION_SYMBOL" >&2
        exit 1
    fi
    log "built pulumi $want in $((SECONDS - start)) s"
}

need_sdk_module() {
    SDK_DIR="$(cd "$here/engine" && go list -m -f '{{.Dir}}' "$PULUMI_SDK_MODULE")"
    if [ -z "$SDK_DIR" ] || [ ! -d "$SDK_DIR/python" ]; then
        (cd "$here/engine" && go mod download "$PULUMI_SDK_MODULE")
        SDK_DIR="$(cd "$here/engine" && go list -m -f '{{.Dir}}' "$PULUMI_SDK_MODULE")"
    fi
}

# Copies a file from the sdk/v3 module zip (read-only in GOMODCACHE) next to `pulumi`, executable.
install_from_sdk() { # $1 = path inside the module, $2 = name in bin
    need_sdk_module
    if ! cmp -s "$SDK_DIR/$1" "$BIN/$2"; then
        install -m 755 "$SDK_DIR/$1" "$BIN/$2"
        log "installed $2 from $PULUMI_SDK_MODULE@v$PULUMI_VERSION/$1"
    fi
}

# The dynamic-provider shim (`python -m pulumi.dynamic`), found next to `pulumi` as a bundled plugin.
install_dynamic_provider_shim() {
    install_from_sdk python/dist/pulumi-resource-pulumi-python pulumi-resource-pulumi-python
}

# The executor the Go language host runs for each program. Our stand-in host runs it the same way.
install_language_exec() {
    install_from_sdk python/cmd/pulumi-language-python-exec pulumi-language-python-exec
}

# The Go host is refused by the proxy (docs/development.md, "The stand-in Python language host"): ours stands in for it.
install_language_host() {
    if ! cmp -s "$here/langhost/pulumi_language_python.py" "$BIN/pulumi-language-python"; then
        install -m 755 "$here/langhost/pulumi_language_python.py" "$BIN/pulumi-language-python"
        log "installed the stand-in Python language host (toolchain/langhost) as $BIN/pulumi-language-python"
    fi
}

main() {
    command -v go >/dev/null || { echo "toolchain: 'go' not found on PATH; install Go >= 1.26.6 (/usr/local/go/bin)" >&2; exit 1; }
    mkdir -p "$DSV41_TOOLCHAIN_DIR"
    # Two clones building into the same cache at once would race on the same files.
    exec 9>"$DSV41_TOOLCHAIN_DIR/.lock"
    flock 9
    build_pulumi_cli
    install_dynamic_provider_shim
    install_language_exec
    install_language_host
    bash "$here/build_command.sh" "$BIN/pulumi-resource-command"
    bash "$here/build_docker.sh" "$BIN/pulumi-resource-docker"
    log "toolchain ready in $BIN"
}

main "$@"
