"""Reading the stack's config: every problem at once, each naming the key, the bad value and the fix.

Pure logic but `from_stack`, which reads Pulumi's runtime config. Errors never echo a secret, whatever shape it
was stored in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from components.config.declare import declarations
from components.config.models import NAMESPACE, OPEN_ENDPOINT, Settings
from components.config.rules import rules
from components.redaction import redact

# Keys whose values are credentials (declared as SecretStr): they must be stored encrypted (`--secret`).
SECRET_KEYS = {d.key for d in declarations(Settings) if d.secret}


class ConfigError(ValueError):
    """All configuration problems found, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            f"{len(problems)} problem(s) in stack config (namespace `{NAMESPACE}`):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


class Loaded(BaseModel):
    """Settings plus the warnings worth showing (not errors)."""

    settings: Settings
    warnings: list[str]


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _lookup(raw: Mapping[str, Any], loc: tuple[int | str, ...]) -> Any:
    cur: Any = raw
    for part in loc:
        try:
            cur = cur[part]
        except (KeyError, IndexError, TypeError):
            return None
    return cur


def _credential_texts(raw: Mapping[str, Any], secret_tops: frozenset[str]) -> list[str]:
    """Every string stored under a secret key or a key stored encrypted: none may be echoed in an error."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            found.extend(x for x in (value, json.dumps(value)[1:-1]) if len(x) >= 4)
        elif isinstance(value, Mapping):
            for x in value.values():
                walk(x)
        elif isinstance(value, list):
            for x in value:
                walk(x)

    for top in secret_tops:
        walk(raw.get(top))
    for secret in SECRET_KEYS:
        top, leaf = secret.split(".")
        section = raw.get(top)
        walk(section.get(leaf) if isinstance(section, Mapping) else section)
    return found


def _show(value: Any, key: str, hidden: list[str]) -> str:
    # A credential's key, or a section that holds one given whole (`pulumi config set --secret ssh < key`).
    if any(key == k or k.startswith(key + ".") or key.endswith("." + k.split(".")[-1]) for k in SECRET_KEYS):
        return "[secret]"
    if value is None:
        return "(missing)"
    text = json.dumps(value)
    # Masking by containment, not equality: a key nested in a list or JSON-escaped is still the key.
    if any(h in text for h in hidden) or "PRIVATE KEY" in text:
        return "[secret]"
    return text


def _pydantic_problems(err: ValidationError, raw: Mapping[str, Any], hidden: list[str]) -> list[str]:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        # Union errors repeat the location with the member type appended; keep the key path only.
        loc = tuple(p for p in loc if not (isinstance(p, str) and p in {"int", "literal['auto']"}))
        key = _loc(loc)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            msg = "is required"
        elif e["type"] == "extra_forbidden":
            msg = "is not a known key: check the spelling against the README's configuration table"
        elif e["type"] in ("less_than_equal", "greater_than_equal") and "ctx" in e:
            bound = e["ctx"].get("le", e["ctx"].get("ge"))
            msg = f"{msg}: set it to {bound} or {'less' if e['type'] == 'less_than_equal' else 'more'}"
        problems.append(f"`{key}` = {_show(_lookup(raw, loc), key, hidden)}: {msg}")
    # A union reports each member; one line per key is enough.
    return list(dict.fromkeys(problems))


def parse(
    raw: Mapping[str, Any], *, plaintext_keys: frozenset[str] = frozenset(), secret_keys: frozenset[str] = frozenset()
) -> Loaded:
    """Validate raw stack config (the namespace's keys, already JSON-decoded).

    `plaintext_keys` lists top-level keys stored unencrypted; a credential under one is refused.
    `secret_keys` lists top-level keys stored encrypted; no error shows any text under them.
    """
    problems: list[str] = []
    hidden = _credential_texts(raw, secret_keys)
    for secret in sorted(SECRET_KEYS):
        top, leaf = secret.split(".")
        value = raw[top].get(leaf) if isinstance(raw.get(top), Mapping) else None
        # `serve.apiKey: none` is a choice, not a credential: it may stay in plain text.
        if top in plaintext_keys and value and not (secret == "serve.apiKey" and value == OPEN_ENDPOINT):
            problems.append(
                f"`{secret}` is stored in plain text: store it encrypted with "
                f"`pulumi config set --secret --path {secret} ...`"
            )
    ssh = raw.get("ssh")
    if not isinstance(ssh, Mapping) or not (ssh.get("privateKey") or ssh.get("agentSocket")):
        problems.append(
            "`ssh` has neither `privateKey` nor `agentSocket`: set one, e.g. "
            "`pulumi config set --secret --path ssh.privateKey < ~/.ssh/id_ed25519`"
        )
    if "nodes" not in raw or not raw.get("nodes"):
        problems.append(
            "`nodes` = (missing): list every Spark, the head first, each with name, host, user and fabricIp "
            "(see Pulumi.dev.yaml)"
        )
        raw = {**raw, "nodes": []}
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as err:
        problems += _pydantic_problems(err, raw, hidden)
        raise ConfigError([redact(p, hidden, mask="[secret]") for p in problems]) from None
    if not settings.nodes:
        raise ConfigError(problems)
    rule_problems, warnings = rules(settings)
    problems += rule_problems
    if problems:
        raise ConfigError([redact(p, hidden, mask="[secret]") for p in problems])
    return Loaded(settings=settings, warnings=warnings)


def read_raw(config: Mapping[str, Any]) -> dict[str, Any]:
    """The namespace's keys from the full config map (`ns:key` -> raw string), JSON-decoded.

    Every key of the namespace is kept, so a misspelt top-level key reaches validation
    and is reported instead of silently falling back to a default.
    """
    raw: dict[str, Any] = {}
    prefix = f"{NAMESPACE}:"
    for full_key, text in config.items():
        if not full_key.startswith(prefix):
            continue
        key = full_key[len(prefix) :]
        try:
            raw[key] = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError:
            raw[key] = text
    return raw


def from_stack() -> Loaded:
    """Read and validate this stack's config. Raises ConfigError before any resource exists."""
    from pulumi.runtime import config as runtime_config

    raw = read_raw({**(runtime_config.get_config_env() or {}), **runtime_config.CONFIG.get()})
    plaintext = frozenset(k for k in raw if not runtime_config.is_config_secret(f"{NAMESPACE}:{k}"))
    return parse(raw, plaintext_keys=plaintext, secret_keys=frozenset(raw) - plaintext)
