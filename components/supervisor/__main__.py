"""`python -m components.supervisor`: kept for one release: says so, runs `dsv41-exl3 supervisor`."""

from __future__ import annotations

import sys

from components.operator.cli import moved

if __name__ == "__main__":
    sys.exit(moved("components.supervisor", "supervisor"))
