"""Prints the slowest tests of a CI run from the JUnit files its pytest stages wrote (stdlib only).

Usage: python3 .ci/slowest.py DIR [N]   (N defaults to 25; each DIR/<stage>.xml is one stage)
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def slowest(directory: Path, n: int) -> list[tuple[float, str, str]]:
    rows = []
    for path in sorted(directory.glob("*.xml")):
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError):
            continue  # a stage cut off mid-write: its tests are in its own output
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            rows.append((float(case.get("time") or 0.0), path.stem, name))
    return sorted(rows, reverse=True)[:n]


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    n = int(argv[2]) if len(argv) == 3 else 25
    rows = slowest(Path(argv[1]), n)
    print(f"==> the {len(rows)} slowest tests (JUnit times: setup of shared fixtures counts in the first user)")
    for seconds, stage, name in rows:
        print(f"    {seconds:7.1f} s  {stage:<12} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
