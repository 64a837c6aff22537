"""`python -m components VERB ...`: the operator's command, the same as the `dsv41-exl3` script (operator/cli.py)."""

from __future__ import annotations

import sys

from components.operator.cli import main

if __name__ == "__main__":
    sys.exit(main())
