"""Stack config as `--path` leaves, the way `pulumi config set --path` stores a section.

Pure: no Pulumi calls. A map becomes one key per leaf, so a secret can sit beside plain leaves (`ssh.privateKey`
encrypted, `ssh.user` in plain text); a list of strings one key per item; anything else (the node list, with its
empty lists) one JSON value. The simulated cluster's stacks and `dsv41-exl3 rollback` write config
through this one mapping.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

# A map key `--path` can name after a dot; any other (`a.b`, `x[0]`, spaces) goes in brackets: `["a.b"]`.
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def _child(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if _PLAIN_KEY.match(key) else f"{prefix}[{json.dumps(key)}]"


def config_paths(prefix: str, value: Any) -> dict[str, str]:
    """`{path: text}` for `value` under `prefix`; the text is the value itself for a string, else its JSON."""
    out: dict[str, str] = {}
    if isinstance(value, dict) and value:
        for key, item in value.items():
            out.update(config_paths(_child(prefix, str(key)), item))
        return out
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        for i, item in enumerate(value):
            out[f"{prefix}[{i}]"] = item
        return out
    return {prefix: value if isinstance(value, str) else json.dumps(value)}


def full_key(namespace: str, path: str) -> str:
    """`ns.a.b` (as config_paths builds it) to `ns:a.b` (as the CLI names a path key)."""
    return path.replace(f"{namespace}.", f"{namespace}:", 1) if path.startswith(f"{namespace}.") else path


def secure_leaves(config: Mapping[str, Any]) -> frozenset[str]:
    """The path keys (`ns:a.b`, `ns:list[0]`) whose values are `{secure: ...}` in a stack file's `config:` map."""
    found: set[str] = set()

    def walk(path: str, value: Any) -> None:
        if isinstance(value, dict) and set(value) == {"secure"}:
            found.add(path)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(_child(path, str(key)), item)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(f"{path}[{i}]", item)

    for key, value in config.items():
        walk(str(key), value)
    return frozenset(found)
