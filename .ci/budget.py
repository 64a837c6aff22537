"""Fails CI when the sim tier's tests take more than 10% over the baseline recorded beside this script (stdlib).

Usage: python3 .ci/budget.py [--cold|--warm] JUNIT_XML BUDGET_JSON

The measure is the sum of the tier's JUnit test times (fixtures included, the sim's own start-up not). Growth is
a decision: a change that makes the tier slower raises `baseline_s` in BUDGET_JSON in the same commit, and says
why in its `why`; the check then holds against the new figure. `--cold`: a machine whose sim nodes had no images
cached (.ci/run decides), where every node pulls every image inside the tests: judged against `baseline_cold_s`.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ALLOWED_GROWTH = 0.10


def tier_seconds(junit: Path) -> float | None:
    """The sum of the file's test times; None when the tier wrote no readable file (its own stage says why)."""
    try:
        root = ET.parse(junit).getroot()
    except (ET.ParseError, OSError):
        return None
    return sum(float(case.get("time") or 0.0) for case in root.iter("testcase"))


def main(argv: list[str]) -> int:
    cold = "--cold" in argv[1:]
    args = [a for a in argv[1:] if a not in ("--cold", "--warm")]
    if len(args) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    junit, budget_file = Path(args[0]), Path(args[1])
    budget = json.loads(budget_file.read_text())
    key = "baseline_cold_s" if cold else "baseline_s"
    baseline = float(budget[key])
    limit = baseline * (1 + ALLOWED_GROWTH)
    total = tier_seconds(junit)
    if total is None:
        print(f"==> sim budget: no readable {junit}: the tier did not finish, nothing to compare")
        return 0
    print(
        f"==> sim budget ({'cold' if cold else 'warm'} node images): the tier's tests took {total:.0f} s; "
        f"baseline {baseline:.0f} s, limit {limit:.0f} s"
    )
    if total > limit:
        print(
            f"the sim tier grew {100 * (total / baseline - 1):.0f}% over its baseline ({total:.0f} s against "
            f"{key} {baseline:.0f} in {budget_file}; at most {100 * ALLOWED_GROWTH:.0f}% more is drift). "
            f"Fix: make the new tests share the deployments (docs/development.md), or raise {key} in "
            f"{budget_file} in the same commit and say why in its `why`.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
