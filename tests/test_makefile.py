"""The Makefile's entry points as an operator meets them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_bare_make_lists_the_targets_and_runs_nothing() -> None:
    done = subprocess.run(["make", "--no-print-directory"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    targets = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert {"help", "toolchain", "test", "demo", "sim-up"} <= targets, done.stdout
    assert "pytest" not in done.stdout and "go build" not in done.stdout, "the help only: no test suite, no build"
