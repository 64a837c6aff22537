"""How a setting is declared: its default, bounds and meaning, and what it renders to, in one place.

Every stack key is a pydantic field declared with `setting()`. What would otherwise be kept in step by hand
is read from these declarations: the flags and environment variables the program owns (`flags.py`), the
README's configuration table (`table.py`), the flags and variables the serving spec renders
(`components/serving/spec.py`), and the checks that the stack template and the stand-in agree with them.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, Field, SecretStr
from pydantic.fields import FieldInfo


def setting(
    default: Any = ...,
    meaning: str = "",
    *,
    flag: str | None = None,
    env: str | tuple[str, ...] = (),
    kind: str | None = None,
    shown: str | None = None,
    note: str | None = None,
    **field: Any,
) -> Any:
    """A stack key: `default` (omit for a required key), what it means to the operator, and what it renders to.

    flag: the `vllm serve` flag this key renders to (the program owns it: `serve.extraArgs` may not pass it).
    env: the environment variable(s) it renders to (owned the same way against `serve.extraEnv`).
    kind: the type as the README shows it, where the annotation says less (`path`, `IPv4`, `URL`).
    shown: the default as the README shows it, where it is computed (`maxNumBatchedTokens - 256`).
    note: why the key owns its flag, added to the refusal of a flag or variable set by hand.
    Everything else (`ge`, `le`, `alias`, `default_factory`, ...) goes to pydantic's Field.
    """
    extra: dict[str, Any] = {"flag": flag, "env": [env] if isinstance(env, str) else list(env)}
    extra |= {"kind": kind, "shown": shown, "note": note}
    return Field(default, description=meaning, json_schema_extra={k: v for k, v in extra.items() if v}, **field)


@dataclass(frozen=True)
class Declared:
    """One stack key as declared."""

    key: str  # as the stack file spells it: `serve.maxNumSeqs`, `nodes[].port`
    name: str  # the field's Python name
    info: FieldInfo

    @property
    def extra(self) -> dict[str, Any]:
        extra = self.info.json_schema_extra
        return extra if isinstance(extra, dict) else {}

    @property
    def meaning(self) -> str:
        return self.info.description or ""

    @property
    def flag(self) -> str | None:
        flag = self.extra.get("flag")
        return flag if isinstance(flag, str) else None

    @property
    def env(self) -> tuple[str, ...]:
        env = self.extra.get("env")
        return tuple(str(e) for e in env) if isinstance(env, list) else ()

    @property
    def note(self) -> str | None:
        note = self.extra.get("note")
        return note if isinstance(note, str) else None

    @property
    def secret(self) -> bool:
        return SecretStr in _members(self.info.annotation)

    @property
    def required(self) -> bool:
        return self.info.is_required()

    @property
    def default(self) -> Any:
        return None if self.required else self.info.get_default(call_default_factory=True)

    @property
    def owner(self) -> str:
        """Why a hand-set flag or variable of this key is refused: the key to set instead."""
        how = f"set `{self.key}`" + (" as a secret" if self.secret else "")
        return f"{how} ({self.note})" if self.note else how

    def type_text(self) -> str:
        kind = self.extra.get("kind")
        if isinstance(kind, str):
            return kind
        members = [m for m in _members(self.info.annotation) if m is not type(None)]
        if len(members) == 1 and typing.get_origin(members[0]) is Literal:
            choices = [f"`{c}`" for c in typing.get_args(members[0])]
            return ", ".join(choices[:-1]) + f" or {choices[-1]}"
        names = {bool: "bool", int: "int", float: "float", str: "string", SecretStr: "string"}
        base = members[0]
        text = names.get(base) or {list: "list", dict: "map"}.get(typing.get_origin(base) or base, "object")
        low = next((m.ge for m in self.info.metadata if hasattr(m, "ge")), None)
        high = next((m.le for m in self.info.metadata if hasattr(m, "le")), None)
        return f"int {low}-{high}" if text == "int" and low is not None and high is not None else text

    def default_text(self) -> str:
        shown = self.extra.get("shown")
        if isinstance(shown, str):
            return shown
        if self.required:
            return "(required)"
        value = self.default
        if value is None:
            return ""
        if isinstance(value, bool):
            return f"`{str(value).lower()}`"
        if isinstance(value, float):
            return f"`{value:g}`"
        if isinstance(value, list):
            return "`[" + ", ".join(str(v) for v in value) + "]`"
        if isinstance(value, str | int):
            return f"`{value}`" if value != "" else '`""`'
        return f"`{json.dumps(value)}`"


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _section(annotation: Any) -> tuple[type[BaseModel], bool] | None:
    """The model a field nests (and whether it is a list of them), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], True
    return None


def declarations(model: type[BaseModel], prefix: str = "") -> Iterator[Declared]:
    """Every key of `model`, depth first in declaration order; a list of sections is a key and its items' keys."""
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        nested = _section(info.annotation)
        if nested is None:
            yield Declared(key, name, info)
            continue
        section, is_list = nested
        if is_list:
            yield Declared(key, name, info)
        yield from declarations(section, key + ("[]." if is_list else "."))
