"""The bridged docker provider through the real engine, over ssh:// to a simulated node's own dockerd.

What the program relies on: a RemoteImage pulled on the node, a Container from it with the program's kind
of inputs (host network, ulimits, capabilities, mounts, labels, envs), a replacement shown as such in
`preview --diff` and done delete-before-create (fixed names), destroy removing the container while
`retainOnDelete` keeps the image.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pulumi
import pulumi_docker as docker
import pytest
from pulumi import automation as auto

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))
from engine_support import read_versions, toolchain_dir  # noqa: E402
from sim_support import sim_ready_or_skip  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.sim]


@pytest.fixture(scope="module")
def sim() -> dict[str, Any]:
    return sim_ready_or_skip()


@pytest.fixture(scope="module")
def pulumi_root() -> Path:
    root = toolchain_dir()
    binary = root / "bin" / "pulumi-resource-docker"
    if not binary.exists():
        pytest.fail(f"{binary} not built; run `make toolchain`")
    return root


@pytest.fixture
def provider_env(pulumi_root: Path, tmp_path: Path) -> dict[str, str]:
    """A fresh backend and PULUMI_HOME holding only our docker provider, at the SDK's version."""
    env = {
        "PULUMI_BACKEND_URL": f"file://{tmp_path / 'backend'}",
        "PULUMI_HOME": str(tmp_path / "home"),
        "PULUMI_CONFIG_PASSPHRASE": "docker-provider-test",
        "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",
        "PULUMI_SKIP_UPDATE_CHECK": "true",
        "PULUMI_IGNORE_AMBIENT_PLUGINS": "true",
        "PATH": f"{pulumi_root / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin",
    }
    (tmp_path / "backend").mkdir()
    version = read_versions()["DOCKER_PROVIDER_VERSION"]
    proc = subprocess.run(
        [
            str(pulumi_root / "bin" / "pulumi"),
            "plugin",
            "install",
            "resource",
            "docker",
            version,
            "--file",
            str(pulumi_root / "bin" / "pulumi-resource-docker"),
            "--exact",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return env


def docker_cli(sim: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", "-H", sim["nodes"][1]["docker_host"], *args], capture_output=True, text=True, timeout=120
    )


def program(sim: dict[str, Any], name: str, env_value: str) -> Callable[[], None]:
    node = sim["nodes"][1]
    ssh_opts = [
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={sim['ssh']['known_hosts']}",
        "-o",
        "IdentitiesOnly=yes",
        "-i",
        sim["ssh"]["key"],
        "-p",
        str(sim["ssh"]["port"]),
    ]

    def run() -> None:
        provider = docker.Provider("node", host=f"ssh://root@{node['ip']}:{sim['ssh']['port']}", ssh_opts=ssh_opts)
        image = docker.RemoteImage(
            "image",
            name=sim["image"],
            keep_locally=True,
            opts=pulumi.ResourceOptions(provider=provider, retain_on_delete=True),
        )
        volume = docker.Volume("cache", name=f"{name}-cache", opts=pulumi.ResourceOptions(provider=provider))
        container = docker.Container(
            "probe",
            name=name,
            image=image.image_id,
            entrypoints=["sleep"],
            command=["600"],
            envs=[f"PROBE={env_value}"],
            network_mode="host",
            ipc_mode="host",
            restart="no",
            must_run=True,
            ulimits=[docker.ContainerUlimitArgs(name="stack", soft=67108864, hard=67108864)],
            capabilities=docker.ContainerCapabilitiesArgs(adds=["SYS_PTRACE"]),
            mounts=[docker.ContainerMountArgs(target="/cache", source=volume.name, type="volume")],
            labels=[docker.ContainerLabelArgs(label="dsv41.probe", value=name)],
            log_opts={"max-size": "10m"},
            # No delete_before_replace here: the bridge itself must delete a fixed-name container first.
            opts=pulumi.ResourceOptions(provider=provider),
        )
        pulumi.export("containerId", container.id)
        pulumi.export("imageId", image.image_id)
        pulumi.export("repoDigest", image.repo_digest)

    return run


def test_container_from_remote_image_replace_and_destroy(
    sim: dict[str, Any], provider_env: dict[str, str], pulumi_root: Path, tmp_path: Path
) -> None:
    name = f"probe-{uuid.uuid4().hex[:8]}"

    def stack_for(env_value: str) -> auto.Stack:
        return auto.create_or_select_stack(
            "docker-probe",
            project_name="docker-probe",
            program=program(sim, name, env_value),
            opts=auto.LocalWorkspaceOptions(
                work_dir=str(tmp_path), env_vars=provider_env, pulumi_command=auto.PulumiCommand(root=str(pulumi_root))
            ),
        )

    stack = stack_for("one")
    try:
        up = stack.up(on_output=lambda _l: None)
        first_id = up.outputs["containerId"].value
        inspect = json.loads(docker_cli(sim, "inspect", name).stdout)[0]
        assert inspect["Id"] == first_id and inspect["State"]["Running"]
        assert "PROBE=one" in inspect["Config"]["Env"]
        assert inspect["HostConfig"]["NetworkMode"] == "host"
        assert inspect["Config"]["Labels"]["dsv41.probe"] == name
        assert up.outputs["imageId"].value.startswith("sha256:")

        # An env change replaces the container; preview says so before anything happens.
        stack = stack_for("two")
        lines: list[str] = []
        preview = stack.preview(diff=True, on_output=lines.append)
        assert preview.change_summary.get("replace") == 1, (preview.change_summary, "\n".join(lines))
        assert any("PROBE=two" in line for line in lines), "\n".join(lines)
        second = stack.up(on_output=lambda _l: None)
        assert second.outputs["containerId"].value != first_id
        assert "PROBE=two" in json.loads(docker_cli(sim, "inspect", name).stdout)[0]["Config"]["Env"]

        stack.destroy(on_output=lambda _l: None)
        assert docker_cli(sim, "inspect", name).returncode != 0, "destroy must remove the container"
        assert docker_cli(sim, "volume", "inspect", f"{name}-cache").returncode != 0, "and the volume"
        assert docker_cli(sim, "image", "inspect", sim["image"]).returncode == 0, "retainOnDelete keeps the image"
    finally:
        stack.workspace.remove_stack("docker-probe", force=True)
        docker_cli(sim, "rm", "-f", name)
        docker_cli(sim, "volume", "rm", "-f", f"{name}-cache")
