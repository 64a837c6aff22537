"""Fails CI when the sim tier's tests take more than 10% over the baseline recorded beside this script (stdlib).

Usage: python3 .ci/budget.py JUNIT_XML BUDGET_JSON

The measure is the sum of the tier's JUnit test times (fixtures included, the sim's own start-up not). Growth is
a decision: a change that makes the tier slower raises `baseline_s` in BUDGET_JSON in the same commit, and says
why in its `why`; the check then holds against the new figure.
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
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    junit, budget_file = Path(argv[1]), Path(argv[2])
    budget = json.loads(budget_file.read_text())
    baseline = float(budget["baseline_s"])
    limit = baseline * (1 + ALLOWED_GROWTH)
    total = tier_seconds(junit)
    if total is None:
        print(f"==> sim budget: no readable {junit}: the tier did not finish, nothing to compare")
        return 0
    print(f"==> sim budget: the tier's tests took {total:.0f} s; baseline {baseline:.0f} s, limit {limit:.0f} s")
    if total > limit:
        print(
            f"the sim tier grew {100 * (total / baseline - 1):.0f}% over its baseline ({total:.0f} s against "
            f"baseline_s {baseline:.0f} in {budget_file}; at most {100 * ALLOWED_GROWTH:.0f}% more is drift). "
            f"Fix: make the new tests share the deployments (docs/development.md), or raise baseline_s in "
            f"{budget_file} in the same commit and say why in its `why`.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
