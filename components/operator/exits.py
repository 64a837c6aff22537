"""The operator command's exit codes, the same for every verb: declared here, printed by `--help`, listed in the
README from `MEANING`."""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    INTERRUPTED = 130


MEANING = {
    Exit.OK: "done: verified, every rank serving, rolled back, decided, the supervisor answered",
    Exit.FAILED: "what was checked is not right: not verified, a rank or metrics down, the supervisor or a node "
    "silent, the rollback's up failed, discover undecided",
    Exit.USAGE: "refused before anything changed: a bad flag, value or stack, an unreadable stack, no confirmation",
    Exit.INTERRUPTED: "interrupted (Ctrl-C)",
}


def table() -> str:
    """The codes as `--help` prints them, one per line."""
    return "exit codes:\n" + "\n".join(f"  {code.value:<3} {MEANING[code]}" for code in Exit)
