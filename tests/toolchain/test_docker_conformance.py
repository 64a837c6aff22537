"""Our bridged pulumi-resource-docker's schema against what the installed pulumi_docker SDK sends and reads.

Every resource and data source of the SDK that the upstream Terraform provider has is checked, not only the
ones the program uses; the SDK's native buildx `Image` has no upstream resource and is left out.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pulumi
import pulumi_docker as docker
import pytest
from conformance import input_problems, output_problems, provider_schema, required_problems

pytestmark = pytest.mark.engine

# Every CustomResource class the SDK exports, by its token (read from the SDK, not typed here).
SDK_RESOURCES = {
    cls.pulumi_type: (cls, getattr(docker, f"{cls.__name__}Args"))
    for _, cls in inspect.getmembers(docker, inspect.isclass)
    if issubclass(cls, pulumi.CustomResource)
    and not issubclass(cls, pulumi.ProviderResource)
    and hasattr(cls, "pulumi_type")
    and hasattr(docker, f"{cls.__name__}Args")
}
NATIVE_ONLY = {"docker:index/image:Image"}  # pulumi-docker's own buildx resource, not the upstream's
RESOURCES = {t: v for t, v in SDK_RESOURCES.items() if t not in NATIVE_ONLY}
USED_BY_THE_PROGRAM = {
    "docker:index/container:Container",
    "docker:index/remoteImage:RemoteImage",
    "docker:index/volume:Volume",
    "docker:index/network:Network",
}


@pytest.fixture(scope="module")
def docker_provider(pulumi_root: Path) -> Path:
    binary = pulumi_root / "bin" / "pulumi-resource-docker"
    if not binary.exists():
        pytest.fail(f"{binary} not built; run `make toolchain`")
    return binary


@pytest.fixture(scope="module")
def schema(pulumi_root: Path, docker_provider: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return provider_schema(pulumi_root, docker_provider, tmp_path_factory.mktemp("schema-home"))


def test_the_sdk_resources_were_found() -> None:
    assert set(RESOURCES) >= USED_BY_THE_PROGRAM, sorted(RESOURCES)
    assert len(RESOURCES) >= 10, sorted(RESOURCES)


@pytest.mark.parametrize("token", sorted(RESOURCES))
def test_sdk_resource_token_served(token: str, schema: dict[str, Any]) -> None:
    assert token in schema["resources"], f"schema has no resource {token}: {sorted(schema['resources'])}"


def test_schema_is_the_docker_package_at_the_sdks_version(docker_provider: Path) -> None:
    import subprocess

    plugin = json.loads((Path(docker.__file__).parent / "pulumi-plugin.json").read_text())
    assert plugin["name"] == "docker"
    version = subprocess.run([str(docker_provider), "-version"], capture_output=True, text=True, timeout=30)
    assert version.stdout.strip() == plugin["version"]


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


def test_every_sdk_function_is_served(schema: dict[str, Any]) -> None:
    tokens = set()
    for name in dir(docker):
        fn = getattr(docker, name)
        if name.startswith("get_") and callable(fn) and not name.endswith("_output"):
            src = inspect.getsource(fn)
            tokens |= {t for t in (part.split("'")[0] for part in src.split("invoke('")[1:])}
    assert tokens, "found no invoke tokens in the SDK's get_* functions"
    missing = tokens - set(schema.get("functions", {}))
    assert not missing, f"functions the SDK invokes but the provider does not serve: {sorted(missing)}"


def test_every_provider_setting_the_sdk_sends_is_in_the_schema(schema: dict[str, Any]) -> None:
    token = "pulumi:providers:docker"
    as_resource = {**schema, "resources": {token: schema["provider"]}}
    problems = input_problems(token, docker.Provider, docker.ProviderArgs, as_resource)
    assert not problems, "\n".join(problems)
    assert {"host", "sshOpts"} <= set(schema["provider"]["inputProperties"])
