"""Per-stack names on the nodes: pure logic, no resources.

Two stacks deployed to the same head (or the same worker) must not share an export file, a staging or
check container, or the watchdog's files: each would overwrite, stop or delete the other's. Everything a
stack names on a node starts with its prefix, derived from the Pulumi project and stack names (the
wiring passes them in; nothing here asks the engine).
"""

from __future__ import annotations

import hashlib
import re

# Room for the suffixes the layers add (`-stage-weights`, `.exports`) inside docker's and a file name's limits.
MAX_PREFIX = 40
_SAFE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


def stack_prefix(project: str, stack: str) -> str:
    """`<project>-<stack>` when that is already a safe name (`dsv41-exl3-dev`); otherwise a sanitised, shortened
    form plus 8 hex of the original, so two stacks whose names sanitise alike still differ. Stable: a pure
    function of the two names."""
    if not project or not stack:
        raise ValueError(f"project={project!r} and stack={stack!r} must both be non-empty to name things on a node")
    raw = f"{project}-{stack}"
    if _SAFE.match(raw) and len(raw) <= MAX_PREFIX:
        return raw
    safe = re.sub(r"[^a-z0-9_.-]+", "-", raw.lower()).strip("-._") or "stack"
    digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
    return f"{safe[:MAX_PREFIX - 9].rstrip('-._')}-{digest}"
