"""Our pulumi-resource-command's schema against what the installed pulumi_command SDK sends and reads.

Every wire name comes from the SDK itself: the `__props__.__dict__[...]` keys of each resource's
`_internal_init` (what it sends, and the outputs it registers), the resource's and its input/output
types' `@pulumi.getter(name=...)` metadata (python -> wire names, and their types), and the
`Missing required property` checks (what the SDK forces a program to give). A hand-typed list would only
test itself.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
from conformance import check_type, input_problems, output_problems, provider_schema, required_problems
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
    return provider_schema(pulumi_root, command_provider, tmp_path_factory.mktemp("schema-home"))


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
    problems = input_problems(token, cls, args_cls, schema)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("token", sorted(RESOURCES))
def test_every_output_the_sdk_reads_is_in_the_schema(token: str, schema: dict[str, Any]) -> None:
    cls, _ = RESOURCES[token]
    problems = output_problems(token, cls, schema)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("token", sorted(RESOURCES))
def test_schema_requires_nothing_the_sdk_lets_a_program_omit(token: str, schema: dict[str, Any]) -> None:
    cls, args_cls = RESOURCES[token]
    problems = required_problems(token, cls, args_cls, schema)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("token", ["command:remote:Command", "command:remote:CopyToRemote"])
def test_connection_is_secret_and_triggers_replace(token: str, schema: dict[str, Any]) -> None:
    props = schema["resources"][token]["inputProperties"]
    assert props["connection"].get("secret") is True
    assert props["triggers"].get("replaceOnChanges") is True


def test_checker_can_fail(schema: dict[str, Any]) -> None:
    """The type rules reject a mismatch (so a passing run means something)."""
    assert check_type(int, {"type": "string"}, schema, "x")
    assert check_type(typing.Sequence[str], {"type": "object", "additionalProperties": {"type": "string"}}, schema, "x")
    assert check_type(remote.ConnectionArgs, {"$ref": "#/types/command:remote:ProxyConnection"}, schema, "x")
