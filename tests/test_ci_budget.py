"""The sim tier's time budget (.ci/budget.py): more than 10% over the recorded baseline fails CI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(
    tmp_path: Path, times: list[float], baseline: float, *flags: str, cold_baseline: float = 1e9
) -> subprocess.CompletedProcess[str]:
    rows = "".join(f'<testcase classname="m" name="t{i}" time="{t}"/>' for i, t in enumerate(times))
    junit = tmp_path / "test-sim.xml"
    junit.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    budget = tmp_path / "sim-budget.json"
    budget.write_text(json.dumps({"baseline_s": baseline, "baseline_cold_s": cold_baseline, "why": "test"}))
    return subprocess.run(
        [sys.executable, str(REPO / ".ci" / "budget.py"), *flags, str(junit), str(budget)],
        capture_output=True,
        text=True,
    )


def test_growth_within_ten_percent_passes_and_beyond_fails_naming_the_figures_and_the_fix(tmp_path: Path) -> None:
    within = run(tmp_path, [600.0, 500.0], 1000.0)
    assert within.returncode == 0 and "took 1100 s; baseline 1000 s, limit 1100 s" in within.stdout, within
    over = run(tmp_path, [600.0, 501.0], 1000.0)
    assert over.returncode == 1, over
    assert "1101 s against baseline_s 1000" in over.stderr and "raise baseline_s" in over.stderr, over.stderr


def test_a_cold_run_is_judged_against_the_cold_baseline_alone(tmp_path: Path) -> None:
    cold = run(tmp_path, [1500.0, 600.0], 1000.0, "--cold", cold_baseline=2000.0)
    assert cold.returncode == 0 and "(cold node images)" in cold.stdout and "baseline 2000 s" in cold.stdout, cold
    over = run(tmp_path, [1600.0, 601.0], 1000.0, "--cold", cold_baseline=2000.0)
    assert over.returncode == 1 and "2201 s against baseline_cold_s 2000" in over.stderr, over


def test_a_tier_that_wrote_no_junit_is_left_to_its_own_stage(tmp_path: Path) -> None:
    (tmp_path / "sim-budget.json").write_text(json.dumps({"baseline_s": 10}))
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / ".ci" / "budget.py"),
            str(tmp_path / "none.xml"),
            str(tmp_path / "sim-budget.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "nothing to compare" in done.stdout, done


def test_the_recorded_baseline_is_a_number_with_its_reason() -> None:
    budget = json.loads((REPO / ".ci" / "sim-budget.json").read_text())
    assert float(budget["baseline_s"]) > 0 and budget["why"], budget
    assert float(budget["baseline_cold_s"]) > float(budget["baseline_s"]), budget
