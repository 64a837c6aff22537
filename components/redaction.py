"""Keeping secrets out of what the program shows: config errors, gate failures, verifier diagnoses.

Flat and dependency-free, so the config parser and every provider can use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"

# vLLM logs its non-default args at startup, api_key included; tracebacks can echo env.
_KEY_SHAPES = (
    re.compile(r"""((?:api[_-]?key|token|password|secret)['"]?\s*[:=]\s*['"]?)[^'",\s}]+""", re.IGNORECASE),
    re.compile(r"(Bearer\s+)\S+"),
    re.compile(r"()\bhf_[A-Za-z0-9]{16,}"),
)


def redact(text: str, secrets: Iterable[str | None] = (), *, mask: str = MASK, key_shapes: bool = False) -> str:
    """`text` with every known secret value replaced by `mask`; with `key_shapes`, also anything shaped like
    a key or token (for foreign text such as log lines, where the values are not all known).

    Longest secret first: a secret that contains another is never left half shown.
    """
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, mask)
    if key_shapes:
        for shape in _KEY_SHAPES:
            text = shape.sub(lambda m: m.group(1) + mask, text)
    return text
