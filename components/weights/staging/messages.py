"""How the staging program speaks: one `stage_weights:` line on stderr per message, and the error it reports.

Part of the staging program (components/weights/staging/main.py), which runs on the head node.
"""

from __future__ import annotations

import sys
import threading

_OUT = threading.Lock()


def say(message: str) -> None:
    """One whole `stage_weights:` line on stderr; the lock keeps lines of concurrent downloads apart."""
    with _OUT:
        sys.stderr.write(f"stage_weights: {message}\n")
        sys.stderr.flush()


class StageError(Exception):
    """A failure the operator can act on; the message names the repo/file and the fix."""
