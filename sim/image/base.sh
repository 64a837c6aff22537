#!/usr/bin/env bash
# Builds the stand-in image's base root filesystem into a tarball: Debian bookworm minbase + python3 + procps,
# plus the pinned huggingface_hub wheels (sim/image/requirements.txt) in python3.11's dist-packages.
# Usage: base.sh OUT.tar   (needs root for debootstrap; PIP must point at a pip of a CPython 3.11)
# Everything that decides the tarball's content is in this file and requirements.txt: build.sh hashes both.
set -euo pipefail

out=${1:?usage: base.sh OUT.tar}
here=$(cd "$(dirname "$0")" && pwd)
suite=bookworm
packages=python3,procps
pip=${PIP:?set PIP to a python3.11 pip, e.g. venv/bin/pip}

# The mirror apt already uses for this suite (SIM_DEBIAN_MIRROR overrides).
mirror=${SIM_DEBIAN_MIRROR:-$(python3 - "$suite" <<'PY'
import glob, sys
suite = sys.argv[1]
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in open(path).read().split("\n\n"):
        fields = dict(line.split(":", 1) for line in stanza.splitlines() if ":" in line and not line.startswith("#"))
        if suite in fields.get("Suites", "").split() and "deb" in fields.get("Types", "").split():
            print(fields["URIs"].split()[0]); sys.exit(0)
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = [w for w in line.split() if not w.startswith("[")]
        if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
            print(words[1]); sys.exit(0)
PY
)}
if [ -z "$mirror" ]; then
  echo "base.sh: no apt source for $suite found in /etc/apt; set SIM_DEBIAN_MIRROR to a Debian mirror URL" >&2
  exit 1
fi
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[ -r "$keyring" ] || { echo "base.sh: $keyring missing; apt-get install debian-archive-keyring" >&2; exit 1; }

work=$(mktemp -d "$(dirname "$out")/base.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
echo "base.sh: debootstrap $suite (minbase + $packages)" >&2
debootstrap --variant=minbase --include="$packages" --keyring="$keyring" "$suite" "$root" "$mirror" \
  > "$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }

arch=$(uname -m)  # wheels for this machine's architecture, which is the image's (debootstrap's default)
site=$root/usr/local/lib/python3.11/dist-packages
[ -x "$root/usr/bin/python3.11" ] || { echo "base.sh: $suite's python3 is not 3.11; update requirements.txt" >&2; exit 1; }
echo "base.sh: pip install --target (huggingface_hub and pinned deps, cp311 wheels)" >&2
"$pip" install --disable-pip-version-check --quiet --no-deps --no-compile --only-binary=:all: \
  --implementation cp --python-version 3.11 \
  --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" --platform "manylinux2014_$arch" \
  --target "$site" -r "$here/requirements.txt"
rm -rf "$site/bin"
# Byte-compile once here so every staging container does not.
chroot "$root" python3 -m compileall -q /usr/local/lib/python3.11/dist-packages >/dev/null
chroot "$root" python3 -c 'import huggingface_hub, http.server, json; print(huggingface_hub.__version__)' >/dev/null

# Only what the image needs at run time.
rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
  "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/var/cache/debconf/*-old
tar --numeric-owner --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -C "$root" -cf "$work/base.tar" .
mv "$work/base.tar" "$out"
