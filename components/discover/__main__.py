"""Entry point of `python -m components.discover`; the command lives in components/discover/discover.py."""

from __future__ import annotations

import sys

from components.discover.discover import main

if __name__ == "__main__":
    sys.exit(main())
