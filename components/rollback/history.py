"""Which update to go back to, and the config that restores it. Pure: no Pulumi calls.

A stack's history (`pulumi stack history --show-secrets`, through the Automation API) records every update
with the config it ran with. An `update` that succeeded is a verified one: the Verifier is part of every
update's graph and fails it unless real logprobs came back, so an update only succeeds with a verified
endpoint. Rolling back restores that update's config (secrets through the stack's own secrets provider) and
runs `up`; what the images, containers and weights are then follows from the config, as for any `up`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from components.config import NAMESPACE, SECRET_KEYS
from components.config.paths import config_paths, full_key

# What `pulumi stack history` calls a deployment and a successful one.
UPDATE_KIND = "update"
SUCCEEDED = "succeeded"
# How many verified versions a refusal lists (the newest first).
LISTED = 10


class RollbackError(Exception):
    """Nothing was changed; the message says why and what to do."""


def rollback_command(stack: str) -> str:
    """The command that goes back to the last verified deployment of `stack`."""
    return f"dsv41-exl3 rollback --stack {stack}"


@dataclass(frozen=True)
class Value:
    """One config value as history or the stack reports it: its text (JSON for objects) and whether secret."""

    text: str
    secret: bool


@dataclass(frozen=True)
class Update:
    """One history entry."""

    version: int
    kind: str
    result: str
    started: datetime
    message: str
    config: Mapping[str, Value]

    @property
    def verified(self) -> bool:
        return self.kind == UPDATE_KIND and self.result == SUCCEEDED


def verified_updates(history: Iterable[Update]) -> list[Update]:
    """The verified updates, newest first."""
    return sorted((u for u in history if u.verified), key=lambda u: u.version, reverse=True)


def choose(history: Sequence[Update], stack: str, to: int | None) -> Update:
    """The update to restore: `to`, which must be verified, else the newest verified one."""
    verified = verified_updates(history)
    if not verified:
        updates = [u for u in history if u.kind == UPDATE_KIND]
        raise RollbackError(
            f"stack {stack!r} has no verified update in its history ({len(updates)} update(s), none succeeded): "
            "there is no deployment to go back to; nothing was changed"
        )
    if to is None:
        return verified[0]
    for update in verified:
        if update.version == to:
            return update
    names = ", ".join(str(u.version) for u in verified[:LISTED]) + (" ..." if len(verified) > LISTED else "")
    known = next((u for u in history if u.version == to), None)
    what = f"has no version {to}" if known is None else f"version {to} was not verified ({known.kind} {known.result})"
    raise RollbackError(
        f"--to {to}: stack {stack!r} {what}; verified versions (newest first): {names}; nothing was changed"
    )


def _decoded(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def leaves(
    config: Mapping[str, Value], secure: frozenset[str] = frozenset(), plain_now: Mapping[str, str] | None = None
) -> dict[str, Value]:
    """`--path` leaves (`ns:a.b`) of a config map, each with whether it must be stored encrypted.

    A leaf is secret when the program declares it a credential (`SECRET_KEYS`), when `secure` (the leaves
    encrypted in the stack file now) names it, or when its whole value was secret and is not a section of this
    program (another namespace's secret object keeps every leaf encrypted). History marks a section secret as a
    whole when any of its leaves is, without saying which: with `plain_now` (the leaves the stack file holds in plain
    text today), a leaf of such a section goes back in plain text only when the file holds it so, with that value;
    any other (a webhook token in `supervisor.notifyCommand` since removed, say) goes back encrypted.
    """
    out: dict[str, Value] = {}
    for key, value in config.items():
        decoded = _decoded(value.text)
        ours = key.startswith(f"{NAMESPACE}:")
        if not isinstance(decoded, dict | list):
            out[key] = value
            continue
        prefix = key.replace(":", ".", 1) if ours else key
        for path, text in config_paths(prefix, decoded).items():
            name = full_key(NAMESPACE, path) if ours else path
            credential = ours and name.split(":", 1)[1] in SECRET_KEYS
            if not ours:
                from_section = value.secret
            elif plain_now is None:
                from_section = False  # which leaf of our section was secret is unknown: as written
            else:
                from_section = value.secret and plain_now.get(name) != text
            out[name] = Value(text, credential or name in secure or from_section)
    return out


@dataclass(frozen=True)
class Change:
    """One leaf that differs between the current config and the restored one; secrets are never shown."""

    key: str
    before: str | None
    after: str | None
    secret: bool

    def describe(self) -> str:
        if self.secret:
            how = "added" if self.before is None else "removed" if self.after is None else "changed"
            return f"{self.key}: (secret, {how})"
        return f"{self.key}: {self.before if self.before is not None else '(unset)'} -> " + (
            self.after if self.after is not None else "(unset)"
        )


def changes(current: Mapping[str, Value], restored: Mapping[str, Value]) -> list[Change]:
    """Leaf by leaf, what restoring changes (compared as decoded values: `1` and `1.0` are the same)."""
    out = []
    for key in sorted(set(current) | set(restored)):
        before, after = current.get(key), restored.get(key)
        if before is not None and after is not None and _decoded(before.text) == _decoded(after.text):
            continue
        out.append(
            Change(
                key=key,
                before=before.text if before else None,
                after=after.text if after else None,
                secret=bool((before and before.secret) or (after and after.secret)),
            )
        )
    return out
