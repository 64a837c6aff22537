"""The real program, deployed by `pulumi up` of this project directory onto the simulated cluster.

Everything is the program's own: the docker provider (bridged from the upstream Terraform provider) pulls the
image and runs each rank's container over ssh://, the command provider runs the preflight and the staging over
SSH, the gates and the verifier read the ranks. One stack is deployed for the module and changed test by test,
as an operator would: every test leaves it healthy and verified for the next.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from program_support import Deployment, docker_on, new_deployment, remove_deployment

pytestmark = [pytest.mark.sim, pytest.mark.engine]


@pytest.fixture(scope="module")
def weights_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-e2e-weights-", dir="/var/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def deployed(sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path,
             weights_root: Path) -> Iterator[Deployment]:
    d = new_deployment(sim, f"e2e-{uuid.uuid4().hex[:6]}", program_env, pulumi_root, weights_root=weights_root,
                       port=18888, master_port=29621)
    try:
        yield d
    finally:
        remove_deployment(d)


def assert_verified(d: Deployment, outputs: dict[str, Any]) -> None:
    verification = outputs["verification"].value
    assert "Paris" in verification["answer"], verification
    assert verification["logprobs"] and all(-9999.0 < x <= 0 for x in verification["logprobs"]), verification
    head = d.sim["nodes"][0]["ip"]
    assert outputs["endpoint"].value == f"http://{head}:{d.config['serve']['port']}/v1"


@pytest.mark.timeout(900)
def test_healthy_up_verifies_and_a_second_up_changes_nothing(deployed: Deployment) -> None:
    up = deployed.up()
    assert_verified(deployed, up.outputs)
    for node in deployed.sim["nodes"]:
        state = docker_on(node["index"], "inspect", "-f", "{{.State.Status}}", deployed.container(node))
        assert state.stdout.strip() == "running", (node, state.stdout, state.stderr)

    again = deployed.up()
    changes = again.summary.resource_changes or {}
    assert set(changes) == {"same"}, f"a second up with nothing changed must change nothing: {changes}"
    assert json.dumps(again.outputs["verification"].value) == json.dumps(up.outputs["verification"].value), (
        "no gate or verifier re-ran")
