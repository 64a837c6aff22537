"""Entry point of `python -m components.rollback`; the command lives in components/rollback/rollback.py."""

from __future__ import annotations

import sys

from components.rollback.rollback import main

if __name__ == "__main__":
    sys.exit(main())
