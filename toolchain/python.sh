#!/usr/bin/env bash
# Prints the path of a CPython $PYTHON_NEXT interpreter (toolchain/versions.env) for `make test-python`.
# Looks, in order: pythonX.Y on PATH, pyenv's versions ($PYENV_ROOT or ~/.pyenv), this project's cache; else
# builds it into the cache from Debian's source package of CPython (checked against its sha256): ~6 min on 2
# cores, once. Building needs a C compiler and the OpenSSL, zlib and libffi headers (installed with apt as root).
# Progress goes to stderr; stdout is the interpreter's path alone.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=toolchain/versions.env
. "$here/versions.env"
want="$PYTHON_NEXT"
cache="${DSV41_CACHE:-${HOME:?HOME must be set}/.cache/dsv41-exl3}/python"
log() { printf 'python.sh: %s\n' "$*" >&2; }

usable() { # the interpreter runs, is $want, and has what pip and the tests need
    [ -x "$1" ] && "$1" -c "import sys, ssl, zlib, ctypes, sqlite3, venv
sys.exit(0 if '%d.%d' % sys.version_info[:2] == '$want' else 1)" 2>/dev/null
}

candidates=()
found=$(command -v "python$want" 2>/dev/null) && candidates+=("$found")
for d in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want".*; do
    [ -d "$d" ] && candidates+=("$d/bin/python$want")
done
candidates+=("$cache/$want/bin/python$want")
for py in "${candidates[@]}"; do
    if usable "$py"; then
        log "using $py ($("$py" -c 'import platform; print(platform.python_version())'))"
        echo "$py"
        exit 0
    fi
done

log "no usable CPython $want found (PATH, pyenv, $cache): building it from $PYTHON_NEXT_SOURCE_URL"
headers=1
command -v cc >/dev/null || headers=0
for h in openssl/ssl.h zlib.h sqlite3.h; do [ -f "/usr/include/$h" ] || headers=0; done
ls /usr/include/ffi.h /usr/include/*/ffi.h >/dev/null 2>&1 || headers=0
if [ "$headers" = 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        log "needs: sudo apt-get install build-essential libssl-dev zlib1g-dev libffi-dev libsqlite3-dev"
        exit 1
    fi
    apt-get install -y -qq --no-install-recommends build-essential libssl-dev zlib1g-dev libffi-dev \
        libsqlite3-dev libbz2-dev liblzma-dev >/dev/null
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
curl -fsSL --retry 3 -o "$work/src.tar.xz" "$PYTHON_NEXT_SOURCE_URL"
echo "$PYTHON_NEXT_SOURCE_SHA256  $work/src.tar.xz" | sha256sum -c --quiet - >&2
tar -xf "$work/src.tar.xz" -C "$work"
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -n 1)
start=$SECONDS
rm -rf "${cache:?}/$want"  # a build cut short left no usable interpreter there (checked above)
(
    cd "$src"
    ./configure --prefix="$cache/$want" --disable-test-modules >"$work/configure.log" 2>&1 ||
        { tail -n 20 "$work/configure.log" >&2; exit 1; }
    make -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -n 30 "$work/make.log" >&2; exit 1; }
    make altinstall >"$work/install.log" 2>&1 || { tail -n 30 "$work/install.log" >&2; exit 1; }
)
py="$cache/$want/bin/python$want"
usable "$py" || { log "the built $py cannot import ssl, zlib, ctypes, sqlite3 or venv"; exit 1; }
log "built $py in $((SECONDS - start)) s"
echo "$py"
