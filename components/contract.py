"""Typed objects that cross a process boundary, declared once: a frozen dataclass whose serialisation is derived
from its fields, used on both sides.

The boundaries: a dynamic provider's properties (the program writes them, the provider process reads them back
from the engine), the supervisor agent's config file (written by the program, read in a container) and the first
stdin line of the worker copy's two programs (components/weights/copy_config.py). Adding a
setting is one field in its declaration and one line where the program maps config onto it; nothing builds or
reads these by string keys.

Standard library only: this module is shipped into containers with the programs that import it.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import json
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Self, TypeVar

T = TypeVar("T", bound="Contract")


class ContractError(ValueError):
    """A payload does not match its declaration: names the object, the field and what was found."""


def secret(**kwargs: Any) -> Any:
    """A field holding a credential: the program sends it as a secret and marks it secret in the state."""
    return dataclasses.field(metadata={"secret": True}, **kwargs)


def _plain(value: Any) -> Any:
    if isinstance(value, Contract):
        return value.to_props()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _optional(hint: Any) -> tuple[bool, Any]:
    """(whether None is allowed, the hint without None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)):
            return True, args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007
    return False, hint


def _hints(cls: type) -> dict[str, Any]:
    return _hints_of(cls)


@functools.cache
def _hints_of(cls: type) -> dict[str, Any]:
    """Each field's type, evaluated in its class's module. Unlike `typing.get_type_hints`, a type that cannot be
    evaluated fully (pulumi.Input's forward reference to Output) reads as Any: its value is taken as it is."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        module = vars(sys.modules[klass.__module__]) if klass.__module__ in sys.modules else {}
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            try:
                found[name] = eval(annotation, dict(module)) if isinstance(annotation, str) else annotation  # noqa: S307
            except Exception:  # noqa: BLE001 - any failure means: take the value as it is
                found[name] = Any
    return found


def _read(hint: Any, value: Any, where: str, unwrap: Callable[[Any], Any]) -> Any:
    value = unwrap(value)
    nullable, hint = _optional(hint)
    if value is None:
        if nullable:
            return None
        raise ContractError(f"{where} is missing: the sender sends every field")
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, Contract):
        if not isinstance(value, Mapping):
            raise ContractError(f"{where} must be an object, got {type(value).__name__}")
        return hint.from_props(value, unwrap=unwrap, where=where)
    if origin in (tuple, list, collections.abc.Sequence):
        if not isinstance(value, list | tuple):
            raise ContractError(f"{where} must be a list, got {type(value).__name__}")
        (item, *_) = typing.get_args(hint) or (Any,)
        items = [_read(item, v, f"{where}[{i}]", unwrap) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)  # the state keeps every number as a float; 5 and 5.0 are one value
    if hint is int and isinstance(value, int | float) and not isinstance(value, bool) and value == int(value):
        return int(value)
    if hint in (str, bool, int, float) and not isinstance(value, hint):
        raise ContractError(f"{where} must be {hint.__name__}, got {value!r}")
    return value


class Contract:
    """Base of the boundary objects: subclasses are `@dataclass(frozen=True, kw_only=True)`."""

    def to_props(self) -> dict[str, Any]:
        """Every field by its name; nested contracts as objects, sequences as lists. Values the program has not
        resolved yet (a pulumi Output) are left as they are: the engine resolves them into the properties."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_props(
        cls, data: Mapping[str, Any], *, unwrap: Callable[[Any], Any] = lambda v: v, where: str = ""
    ) -> Self:
        """The object from `to_props`'s shape; `unwrap` takes a value out of its transport (a secret's wrapper)."""
        hints = _hints(cls)
        name = where or cls.__name__
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            present = f.name in data and unwrap(data[f.name]) is not None
            if not present and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING):
                continue
            values[f.name] = _read(hints[f.name], data.get(f.name), f"{name}.{f.name}", unwrap)
        try:
            return cls(**values)
        except (TypeError, ValueError) as error:
            raise ContractError(f"{name}: {error}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_props(), indent=1, sort_keys=True)

    def to_line(self) -> str:
        """`to_json` on one line: the first line of a program's stdin (`from_json` reads either)."""
        return json.dumps(self.to_props(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Self:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise ContractError(f"{cls.__name__} is not JSON: {error}") from None
        if not isinstance(data, Mapping):
            raise ContractError(f"{cls.__name__} must be an object, got {type(data).__name__}")
        return cls.from_props(data)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def secret_fields(cls) -> list[str]:
        """The fields declared with `secret()`: what the state marks secret."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("secret")]  # type: ignore[arg-type]
