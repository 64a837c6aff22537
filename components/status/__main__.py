"""Entry point of `python -m components.status`; the command lives in components/operator/status.py."""

from __future__ import annotations

import sys

from components.operator.status import main

if __name__ == "__main__":
    sys.exit(main())
