"""Our pulumi-resource-command's schema against what the installed pulumi_command SDK sends and reads.

Every wire name comes from the SDK itself: the `__props__.__dict__[...]` keys of each resource's
`_internal_init` (what it sends, and the outputs it registers), the resource's and its input/output
types' `@pulumi.getter(name=...)` metadata (python -> wire names, and their types), and the
`Missing required property` checks (what the SDK forces a program to give). A hand-typed list would only
test itself.
"""

from __future__ import annotations

import ast
import collections.abc
import enum
import inspect
import json
import subprocess
import textwrap
import typing
from pathlib import Path
from typing import Any

import pulumi
import pulumi._types as ptypes
import pytest
from pulumi_command import local, remote

pytestmark = pytest.mark.engine

# The resources this project uses; the SDK's deprecated remote.CopyFile is not served.
RESOURCES = {
    "command:remote:Command": (remote.Command, remote.CommandArgs),
    "command:local:Command": (local.Command, local.CommandArgs),
    "command:remote:CopyToRemote": (remote.CopyToRemote, remote.CopyToRemoteArgs),
}


@pytest.fixture(scope="module")
def schema(pulumi_root: Path, command_provider: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import os

    home = tmp_path_factory.mktemp("schema-home")
    out = subprocess.run(
        [str(pulumi_root / "bin" / "pulumi"), "package", "get-schema", str(command_provider)],
        env={**os.environ, "PULUMI_HOME": str(home), "PULUMI_SKIP_UPDATE_CHECK": "true",
             "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true"},
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def sdk_props(cls: type) -> tuple[set[str], set[str], set[str]]:
    """(sent inputs, registered outputs, required inputs) as python names, read from _internal_init."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls._internal_init)))
    sent: set[str] = set()
    outputs: set[str] = set()
    required: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute)
                        and target.value.attr == "__dict__" and isinstance(target.slice, ast.Constant)):
                    value = node.value
                    is_none = isinstance(value, ast.Constant) and value.value is None
                    (outputs if is_none else sent).add(target.slice.value)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.startswith("Missing required property '"):
            required.add(node.value.split("'")[1])
    return sent, outputs, required


def _strip_input(py: Any) -> Any:
    """Union[T, Awaitable[T], Output[...]] (pulumi.Input[T]) -> T; other types unchanged."""
    if typing.get_origin(py) is not typing.Union:
        return py
    members = [m for m in typing.get_args(py)
               if typing.get_origin(m) not in (collections.abc.Awaitable, pulumi.Output) and m is not type(None)]
    return members[0] if len(members) == 1 else typing.Union[tuple(members)]  # noqa: UP007 (runtime union)


def _is_asset_like(py: Any) -> bool:
    members = typing.get_args(py) if typing.get_origin(py) is typing.Union else (py,)
    return bool(members) and all(isinstance(m, type) and issubclass(m, (pulumi.Asset, pulumi.Archive))
                                 for m in members)


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
        names, kinds = ((ptypes.input_type_py_to_pulumi_names(py), ptypes.input_type_types(py))
                        if ptypes.is_input_type(py) else (None, ptypes.output_type_types(py)))
        wire = set(names.values()) if names else set(kinds)
        problems = [f"{where}.{n}: not in schema type {ref}" for n in sorted(wire - set(obj["properties"]))]
        for n in sorted(wire & set(obj["properties"])):
            problems += check_type(kinds[n], obj["properties"][n], schema, f"{where}.{n}")
        return problems
    return [f"{where}: no rule for SDK type {py!r} (schema {spec})"]


@pytest.mark.parametrize("token", sorted(RESOURCES))
def test_sdk_resource_token_served(token: str, schema: dict[str, Any]) -> None:
    cls, _ = RESOURCES[token]
    assert cls.pulumi_type == token
    assert token in schema["resources"], f"schema has no resource {token}: {sorted(schema['resources'])}"


def test_schema_version_is_what_the_sdk_requests(schema: dict[str, Any]) -> None:
    plugin = json.loads((Path(remote.__file__).parents[1] / "pulumi-plugin.json").read_text())
    assert schema["name"] == plugin["name"] == "command"
    assert schema["version"] == plugin["version"]


@pytest.mark.parametrize("token", sorted(RESOURCES))
def test_every_input_the_sdk_sends_is_in_the_schema(token: str, schema: dict[str, Any]) -> None:
    cls, args_cls = RESOURCES[token]
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
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("token", sorted(RESOURCES))
def test_every_output_the_sdk_reads_is_in_the_schema(token: str, schema: dict[str, Any]) -> None:
    cls, _ = RESOURCES[token]
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
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("token", sorted(RESOURCES))
def test_schema_requires_nothing_the_sdk_lets_a_program_omit(token: str, schema: dict[str, Any]) -> None:
    cls, args_cls = RESOURCES[token]
    _, _, required = sdk_props(cls)
    py_to_wire = ptypes.input_type_py_to_pulumi_names(args_cls)
    sdk_required = {py_to_wire.get(n, n) for n in required}
    extra = set(schema["resources"][token].get("requiredInputs", [])) - sdk_required
    assert not extra, f"{token}: schema requires {sorted(extra)}, the SDK does not (it requires {sorted(sdk_required)})"


@pytest.mark.parametrize("token", ["command:remote:Command", "command:remote:CopyToRemote"])
def test_connection_is_secret_and_triggers_replace(token: str, schema: dict[str, Any]) -> None:
    props = schema["resources"][token]["inputProperties"]
    assert props["connection"].get("secret") is True
    assert props["triggers"].get("replaceOnChanges") is True


def test_checker_can_fail(schema: dict[str, Any]) -> None:
    """The type rules reject a mismatch (so a passing run means something)."""
    assert check_type(int, {"type": "string"}, schema, "x")
    assert check_type(typing.Sequence[str], {"type": "object", "additionalProperties": {"type": "string"}},
                      schema, "x")
    assert check_type(remote.ConnectionArgs, {"$ref": "#/types/command:remote:ProxyConnection"}, schema, "x")
