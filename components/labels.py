"""Names and labels every layer agrees on: pure logic, no resources.

The rank containers' names and docker labels (the preflight reads them to tell this stack's ranks from
others'; serving sets them), and the per-stack prefix of everything else named on a node.

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

STACK_LABEL = "dsv41-exl3.stack"
# Where the head rank reads the endpoint's API key: a file bind-mounted read-only from the head (serving.py writes
# it over ssh, 0600); the supervisor's leader reads it there too. `docker inspect` shows a container's env and
# mounts, never a file's text.
KEY_FILE = "/run/dsv41-exl3/api-key"


def state_dir(prefix: str) -> str:
    """A stack's state directory on a node, under the SSH user's home."""
    return f".local/state/{prefix}"


GENERATION_LABEL = "dsv41-exl3.generation"
# The config-only part of the generation: known before anything runs, so the preflight can tell
# "this node already serves what the update asks for" from "this node is about to be replaced".
CONFIG_LABEL = "dsv41-exl3.config"
RANK_LABEL = "dsv41-exl3.rank"
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
    return f"{safe[: MAX_PREFIX - 9].rstrip('-._')}-{digest}"


def container_name(stack: str, node_name: str) -> str:
    """A rank's container (named before stack prefixes existed; renaming would replace running ranks)."""
    return f"dsv41-exl3-{stack}-{node_name}"


def stack_of_container(container: str, node_name: str) -> str | None:
    """The stack whose rank on `node_name` is named `container` (container_name's inverse), or None."""
    head, tail = "dsv41-exl3-", f"-{node_name}"
    if not (container.startswith(head) and container.endswith(tail)) or len(container) <= len(head) + len(tail):
        return None
    stack = container[len(head) : -len(tail)]
    return stack if container_name(stack, node_name) == container else None


def container_labels(stack: str, config_generation: str, generation: str, rank: int) -> dict[str, str]:
    return {STACK_LABEL: stack, CONFIG_LABEL: config_generation, GENERATION_LABEL: generation, RANK_LABEL: str(rank)}
