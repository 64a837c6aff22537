"""SDK-vs-schema conformance for the providers we build: every wire name the pinned Python SDK sends or reads,
taken from the SDK itself (its `__props__.__dict__[...]` keys, its `@pulumi.getter(name=...)` metadata and its
`Missing required property` checks), must be in the provider's schema with a compatible type. Shared by the
docker and command conformance tests."""

from __future__ import annotations

import collections.abc
import enum
import inspect
import json
import os
import re
import subprocess
import typing
from pathlib import Path
from typing import Any

import pulumi
import pulumi._types as ptypes


def provider_schema(pulumi_root: Path, provider: Path, home: Path) -> dict[str, Any]:
    """The schema a provider binary serves, as `pulumi package get-schema` reads it."""
    out = subprocess.run(
        [str(pulumi_root / "bin" / "pulumi"), "package", "get-schema", str(provider)],
        env={
            **os.environ,
            "PULUMI_HOME": str(home),
            "PULUMI_SKIP_UPDATE_CHECK": "true",
            "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    schema: dict[str, Any] = json.loads(out.stdout)
    return schema


# The generated `_internal_init` assigns each property as `__props__.__dict__["name"] = value`. Read by pattern,
# not with `ast`: CPython 3.11.7's parser raises "AST constructor recursion depth mismatch" on the largest of
# these functions (Container's) once the interpreter has run a while.
_PROP_ASSIGN = re.compile(r'__props__\.__dict__\["(\w+)"\]\s*=\s*(None\s*$)?', re.MULTILINE)
_REQUIRED = re.compile(r"Missing required property '(\w+)'")


def sdk_props(cls: type) -> tuple[set[str], set[str], set[str]]:
    """(sent inputs, registered outputs, required inputs) as python names, read from _internal_init."""
    source = inspect.getsource(cls._internal_init)  # type: ignore[attr-defined]
    sent: set[str] = set()
    outputs: set[str] = set()
    for match in _PROP_ASSIGN.finditer(source):
        (outputs if match.group(2) is not None else sent).add(match.group(1))
    return sent, outputs, set(_REQUIRED.findall(source))


def _strip_input(py: Any) -> Any:
    """Union[T, Awaitable[T], Output[...]] (pulumi.Input[T]) -> T; other types unchanged."""
    if typing.get_origin(py) is not typing.Union:
        return py
    members = [
        m
        for m in typing.get_args(py)
        if typing.get_origin(m) not in (collections.abc.Awaitable, pulumi.Output) and m is not type(None)
    ]
    return members[0] if len(members) == 1 else typing.Union[tuple(members)]  # noqa: UP007 (runtime union)


def _is_asset_like(py: Any) -> bool:
    members = typing.get_args(py) if typing.get_origin(py) is typing.Union else (py,)
    return bool(members) and all(isinstance(m, type) and issubclass(m, (pulumi.Asset, pulumi.Archive)) for m in members)


def check_type(py: Any, spec: dict[str, Any], schema: dict[str, Any], where: str) -> list[str]:
    """Problems (empty when compatible) of the schema spec for values of python type py."""
    py = _strip_input(ptypes.unwrap_type(py))
    ref = spec.get("$ref", "")
    if py is Any:
        return [] if ref == "pulumi.json#/Any" else [f"{where}: SDK sends any value, schema says {spec}"]
    if _is_asset_like(py):
        allowed = {"pulumi.json#/Asset", "pulumi.json#/Archive"}
        if isinstance(py, type) and issubclass(py, pulumi.Archive):
            allowed = {"pulumi.json#/Archive"}
        return [] if ref in allowed else [f"{where}: SDK uses {py}, schema says {spec}"]
    if isinstance(py, type) and issubclass(py, enum.Enum):
        token = getattr(py, "pulumi_type", None)
        if ref != f"#/types/{token}":
            return [f"{where}: SDK enum {token}, schema says {spec}"]
        values = {e["value"] for e in schema["types"][token].get("enum", [])}
        missing = {m.value for m in py} - values
        return [f"{where}: enum {token} lacks {sorted(missing)}"] if missing else []
    scalars = {str: "string", bool: "boolean", int: "integer", float: "number"}
    if py in scalars:
        return [] if spec.get("type") == scalars[py] else [f"{where}: SDK {py.__name__}, schema says {spec}"]
    origin = typing.get_origin(py)
    if origin in (collections.abc.Mapping, dict, typing.Mapping):
        if spec.get("type") != "object" or "additionalProperties" not in spec:
            return [f"{where}: SDK sends a map, schema says {spec}"]
        return check_type(typing.get_args(py)[1], spec["additionalProperties"], schema, f"{where}[*]")
    if origin in (collections.abc.Sequence, list, typing.Sequence):
        if spec.get("type") != "array":
            return [f"{where}: SDK sends a list, schema says {spec}"]
        return check_type(typing.get_args(py)[0], spec["items"], schema, f"{where}[]")
    if isinstance(py, type) and (ptypes.is_input_type(py) or ptypes.is_output_type(py)):
        if not ref.startswith("#/types/"):
            return [f"{where}: SDK sends an object {py.__name__}, schema says {spec}"]
        obj = schema["types"][ref.removeprefix("#/types/")]
        names, kinds = (
            (ptypes.input_type_py_to_pulumi_names(py), ptypes.input_type_types(py))
            if ptypes.is_input_type(py)
            else (None, ptypes.output_type_types(py))
        )
        wire = set(names.values()) if names else set(kinds)
        problems = [f"{where}.{n}: not in schema type {ref}" for n in sorted(wire - set(obj["properties"]))]
        for n in sorted(wire & set(obj["properties"])):
            problems += check_type(kinds[n], obj["properties"][n], schema, f"{where}.{n}")
        return problems
    return [f"{where}: no rule for SDK type {py!r} (schema {spec})"]


def input_problems(token: str, cls: type, args_cls: type, schema: dict[str, Any]) -> list[str]:
    """Every input the SDK sends for `token`, missing from the schema or of an incompatible type."""
    res = schema["resources"][token]
    py_to_wire = {**ptypes.input_type_py_to_pulumi_names(args_cls), **ptypes.resource_py_to_pulumi_names(cls)}
    sent, _, _ = sdk_props(cls)
    assert sent, f"found no __props__ keys in {cls.__name__}._internal_init: the SDK layout changed"
    arg_types = ptypes.input_type_types(args_cls)
    problems: list[str] = []
    for py_name in sorted(sent):
        wire = py_to_wire.get(py_name, py_name)
        spec = res.get("inputProperties", {}).get(wire)
        if spec is None:
            problems.append(f"{token}: input {wire!r} (python {py_name}) is not in the schema's inputProperties")
            continue
        problems += check_type(arg_types[wire], spec, schema, f"{token}.{wire}")
    return problems


def output_problems(token: str, cls: type, schema: dict[str, Any]) -> list[str]:
    """Every output the SDK reads for `token`, missing from the schema or of an incompatible type."""
    res = schema["resources"][token]
    _, registered, _ = sdk_props(cls)
    py_to_wire = ptypes.resource_py_to_pulumi_names(cls)
    read = set(ptypes.resource_types(cls)) | {py_to_wire.get(n, n) for n in registered}
    problems: list[str] = []
    for wire in sorted(read):
        spec = res["properties"].get(wire)
        if spec is None:
            problems.append(f"{token}: output {wire!r} is not in the schema's properties")
            continue
        problems += check_type(ptypes.resource_types(cls)[wire], spec, schema, f"{token} output {wire}")
    return problems


def required_problems(token: str, cls: type, args_cls: type, schema: dict[str, Any]) -> list[str]:
    """Inputs the schema requires that the SDK lets a program omit."""
    _, _, required = sdk_props(cls)
    py_to_wire = ptypes.input_type_py_to_pulumi_names(args_cls)
    sdk_required = {py_to_wire.get(n, n) for n in required}
    extra = set(schema["resources"][token].get("requiredInputs", [])) - sdk_required
    return (
        [f"{token}: schema requires {sorted(extra)}, the SDK does not (it requires {sorted(sdk_required)})"]
        if extra
        else []
    )
