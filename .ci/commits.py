"""Commit subjects since this check exists: `<area>: <what>` under 72 characters (docs/development.md), or git's
own `Merge branch ...`. Run by .ci/run in a fresh clone; a clone without the history says so and passes."""

from __future__ import annotations

import re
import subprocess
import sys

SUBJECT = re.compile(r"^[a-z0-9][a-z0-9 ,/_.-]*: \S")
MERGE = re.compile(r"^Merge (branch|remote-tracking branch) ")
LIMIT = 72


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def problems(subjects: list[str]) -> list[str]:
    found = []
    for subject in subjects:
        if MERGE.match(subject):
            continue
        if len(subject) >= LIMIT:
            found.append(f"{len(subject)} characters (under {LIMIT}): {subject}")
        elif not SUBJECT.match(subject):
            found.append(f"not `<area>: <what>`: {subject}")
    return found


def main() -> int:
    first = git("log", "--diff-filter=A", "--format=%H", "--", ".ci/commits.py").split()
    if not first:
        print("commits: the commit that added this check is not in this clone's history; nothing checked")
        return 0
    subjects = git("log", "--format=%s", f"{first[-1]}^..HEAD").splitlines()
    found = problems(subjects)
    for line in found:
        print(f"commits: {line}", file=sys.stderr)
    print(f"commits: {len(subjects)} subject(s) checked, {len(found)} refused")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
