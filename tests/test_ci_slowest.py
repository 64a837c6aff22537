"""The CI run's slowest-tests report (.ci/slowest.py) reads every tier's JUnit file and ranks across them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def junit(cases: dict[str, float]) -> str:
    rows = "".join(f'<testcase classname="m" name="{n}" time="{t}"/>' for n, t in cases.items())
    return f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>'


def test_the_slowest_tests_are_ranked_across_tiers_and_a_cut_off_file_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "test-unit.xml").write_text(junit({"fast": 0.5, "slow_unit": 40.0}))
    (tmp_path / "test-sim.xml").write_text(junit({"slowest": 300.0, "middle": 20.0}))
    (tmp_path / "test-engine.xml").write_text("<testsuites><testsuite")  # a stage killed mid-write
    out = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "slowest.py"), str(tmp_path), "3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert "3 slowest tests" in out[0]
    ranked = [line.split()[-1] for line in out[1:]]
    assert ranked == ["m::slowest", "m::slow_unit", "m::middle"], out
    assert "test-sim" in out[1] and "300.0 s" in out[1], out[1]
