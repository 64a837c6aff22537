"""Entry point of `python -m components.logs`; the command lives in components/operator/logs.py."""

from __future__ import annotations

import sys

from components.operator.logs import main

if __name__ == "__main__":
    sys.exit(main())
