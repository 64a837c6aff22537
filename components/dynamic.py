"""What every dynamic provider of the program shares: plain values from properties, input comparison,
progress logging, and the CRUD of a resource that exists only in the state.

Pulumi pickles a provider by reference (module and class name) and `destroy` and `refresh` unpickle it
without the program: a provider class keeps its module and name, and this base holds no attributes
(sessions, clients) that would be pickled with it.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pulumi
import pulumi.dynamic
from pulumi.runtime import rpc

from components.contract import Contract

C = TypeVar("C", bound=Contract)

_SECRET_SIG_KEY = rpc._special_sig_key  # noqa: SLF001 - the wire marker of a secret value
_SECRET_SIG = rpc._special_secret_sig  # noqa: SLF001

Normalize = Callable[[Any], Any]


def unwrap_secret(value: Any) -> Any:
    """The plain value of a property. Dynamic providers declare acceptSecrets=False, but a wrapped secret
    may still arrive."""
    if isinstance(value, Mapping) and value.get(_SECRET_SIG_KEY) == _SECRET_SIG:
        return value.get("value")
    return value


def plain(keys: Sequence[str], props: Mapping[str, Any]) -> dict[str, Any]:
    """`keys` of `props`, secrets unwrapped (a missing key is None)."""
    return {k: unwrap_secret(props.get(k)) for k in keys}


def secret_or_none(value: pulumi.Input[str] | None) -> pulumi.Output[str] | None:
    """A credential as a secret input; None stays None (not a secret None)."""
    return pulumi.Output.secret(value) if value is not None else None


def props_of(args: Contract) -> dict[str, Any]:
    """A boundary object as a dynamic resource's properties: every field by name (components/contract.py), each
    credential (a field declared `secret()`, at any depth) sent as a secret."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(args):  # type: ignore[arg-type]
        value = getattr(args, f.name)
        if isinstance(value, Contract):
            value = props_of(value)
        elif isinstance(value, list | tuple):
            value = [props_of(v) if isinstance(v, Contract) else v for v in value]
        out[f.name] = secret_or_none(value) if f.metadata.get("secret") else value
    return out


def secret_outputs(args: Contract) -> list[str]:
    """The top-level properties the state must mark secret: credentials, and objects holding one."""
    return [
        f.name
        for f in dataclasses.fields(args)  # type: ignore[arg-type]
        if f.metadata.get("secret")
        or (isinstance(getattr(args, f.name), Contract) and secret_outputs(getattr(args, f.name)))
    ]


def read_props(cls: type[C], props: Mapping[str, Any]) -> C:
    """The provider's side of `props_of`: the object back from the engine's properties, secrets unwrapped."""
    return cls.from_props(props, unwrap=unwrap_secret)


# ---------------------------------------------------------------------------------------------
# Comparing inputs


def as_set(value: Any) -> Any:
    """A list whose order says nothing (which containers, not their order)."""
    if isinstance(value, list | tuple):
        return tuple(sorted(str(v) for v in value))
    return value


def as_rows(value: Any) -> Any:
    """A list of records whose order says nothing, each compared field by field."""
    if isinstance(value, list | tuple):
        rows = [tuple((k, comparable(v)) for k, v in sorted(dict(r).items())) for r in value if isinstance(r, Mapping)]
        return sorted(rows, key=repr)
    return value


def comparable(value: Any, normalize: Normalize | None = None) -> Any:
    """The value as a diff compares it: unwrapped, normalized, numbers as floats (state round-trips
    numbers as floats, so 5 in the program equals 5.0 in the state)."""
    value = unwrap_secret(value)
    if normalize is not None:
        value = normalize(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def changed_inputs(
    keys: Sequence[str],
    olds: Mapping[str, Any],
    news: Mapping[str, Any],
    normalize: Mapping[str, Normalize] | None = None,
) -> list[str]:
    """Input keys whose values differ; `__provider` (the pickled code) is deliberately not one.
    `normalize`: per key, what makes two values the same (see `as_set`, `as_rows`)."""
    how = normalize or {}
    return [k for k in keys if comparable(olds.get(k), how.get(k)) != comparable(news.get(k), how.get(k))]


# ---------------------------------------------------------------------------------------------
# Logging and CRUD


def log_progress(message: str) -> None:
    # No engine connection in the provider process: pulumi.log falls back to stderr, which the CLI shows.
    pulumi.log.info(message)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class StateOnlyProvider(pulumi.dynamic.ResourceProvider):
    """CRUD of a resource with nothing outside the state: create and update compute the outputs, a changed
    input is an in-place update (the id stays stable for dependents, and a failed update keeps the old state,
    so the next `up` sees the same diff), delete has nothing to tear down.

    Subclasses set `input_keys` (what a diff compares), `normalize` (per key, what makes two values the same)
    and `id_prefix`, and compute `outputs`.
    """

    input_keys: tuple[str, ...] = ()
    normalize: Mapping[str, Normalize] = {}
    id_prefix = "resource"

    def outputs(self, props: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        return pulumi.dynamic.CreateResult(id_=new_id(self.id_prefix), outs=self.outputs(props))

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        changed = changed_inputs(self.input_keys, olds, news, self.normalize)
        return pulumi.dynamic.DiffResult(changes=bool(changed), replaces=[], stables=[], delete_before_replace=False)

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.UpdateResult:
        return pulumi.dynamic.UpdateResult(outs=self.outputs(news))

    def delete(self, _id: str, _props: dict[str, Any]) -> None:
        """Nothing exists outside the state."""
