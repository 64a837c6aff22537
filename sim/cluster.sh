#!/bin/sh
# Thin wrapper: sim/cluster.sh up|image|down|status|env|clean, reboot node-N, up/down --node N
# (see sim/cluster.py and sim/README.md).
# Uses the project's venv python when it exists (the image build needs its pip), else python3.
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
py=python3
[ -x "$repo/venv/bin/python" ] && py=$repo/venv/bin/python
cd "$repo"
exec "$py" -m sim.cluster "$@"
