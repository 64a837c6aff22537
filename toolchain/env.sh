# shellcheck shell=bash
# The one environment every pulumi call of this project runs in: sourced by the Makefile's
# recipes and by toolchain/build.sh; `make env` prints it as export lines.
#
# Usage:  . toolchain/env.sh            (exports into the current shell)
#         bash toolchain/env.sh --print (prints `export` lines for eval)
#
# Nothing here downloads or builds; it only computes paths and sets variables.

_dsv41_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DSV41_REPO="$(cd "$_dsv41_here/.." && pwd)"

# shellcheck source=toolchain/versions.env
. "$_dsv41_here/versions.env"

# The toolchain lives outside the work tree, keyed by version, so clones share it and `make clean` keeps it.
DSV41_CACHE="${DSV41_CACHE:-${HOME:?HOME must be set}/.cache/dsv41-exl3}"
DSV41_TOOLCHAIN_DIR="$DSV41_CACHE/toolchain/pulumi-v$PULUMI_VERSION"
DSV41_TOOLCHAIN_BIN="$DSV41_TOOLCHAIN_DIR/bin"
DSV41_STATE="$DSV41_REPO/.state"
# The stacks' state and the passphrase that decrypts their secrets live outside the clone, beside the stacks'
# SSH key directories, so a fresh clone or `git clean -x` loses nothing. A clone that already holds stacks
# under .state/backend (before 0.8) keeps using them until `make move-state` moves them here.
DSV41_STATE_HOME="${DSV41_STATE_HOME:-${XDG_STATE_HOME:-$HOME/.local/state}/dsv41-exl3}"
if [ -d "$DSV41_STATE/backend/.pulumi/stacks" ]; then
    DSV41_STATE_HOME="$DSV41_STATE"
    echo "dsv41-exl3: stacks found under $DSV41_STATE/backend (inside the clone): using them; \`make move-state\` moves them outside it" >&2
fi

PULUMI_HOME="$DSV41_STATE/pulumi-home"
PULUMI_BACKEND_URL="${PULUMI_BACKEND_URL:-file://$DSV41_STATE_HOME/backend}"
# Fail at once instead of trying GitHub/get.pulumi.com, which this machine cannot reach.
PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION=true
PULUMI_SKIP_UPDATE_CHECK=true
# Plugins on PATH would win over the version-pinned plugin cache; bundled plugins next to `pulumi` still load.
PULUMI_IGNORE_AMBIENT_PLUGINS=true
PATH="$DSV41_TOOLCHAIN_BIN:$DSV41_REPO/venv/bin:$PATH"
export DSV41_CACHE DSV41_STATE_HOME DSV41_TOOLCHAIN_DIR DSV41_TOOLCHAIN_BIN PULUMI_HOME PULUMI_BACKEND_URL \
    PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION PULUMI_SKIP_UPDATE_CHECK PULUMI_IGNORE_AMBIENT_PLUGINS PATH

_dsv41_exported="DSV41_CACHE DSV41_STATE_HOME DSV41_TOOLCHAIN_DIR DSV41_TOOLCHAIN_BIN PULUMI_HOME PULUMI_BACKEND_URL
PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION PULUMI_SKIP_UPDATE_CHECK PULUMI_IGNORE_AMBIENT_PLUGINS PATH"

# Non-interactive runs need a secrets passphrase. Respect one the user set; otherwise generate a random one
# into a 0600 file beside the backend. Only the file's path is ever printed.
if [ -z "${PULUMI_CONFIG_PASSPHRASE+x}" ] && [ -z "${PULUMI_CONFIG_PASSPHRASE_FILE:-}" ]; then
    PULUMI_CONFIG_PASSPHRASE_FILE="$DSV41_STATE_HOME/passphrase"
    if [ ! -s "$PULUMI_CONFIG_PASSPHRASE_FILE" ]; then
        (umask 077 && mkdir -p "$DSV41_STATE_HOME" && head -c 32 /dev/urandom | base64 >"$PULUMI_CONFIG_PASSPHRASE_FILE")
    fi
    export PULUMI_CONFIG_PASSPHRASE_FILE
    _dsv41_exported="$_dsv41_exported PULUMI_CONFIG_PASSPHRASE_FILE"
fi
mkdir -p "$PULUMI_HOME"
case "$PULUMI_BACKEND_URL" in file://*) (umask 077 && mkdir -p "${PULUMI_BACKEND_URL#file://}") ;; esac

if [ "${1:-}" = "--print" ]; then
    for _dsv41_var in $_dsv41_exported; do
        printf 'export %s=%q\n' "$_dsv41_var" "${!_dsv41_var}"
    done
fi
unset _dsv41_here _dsv41_exported _dsv41_var
