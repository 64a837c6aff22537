"""Fixtures for engine tests: the project's own Pulumi toolchain, a file:// backend per test, no downloads."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_support import toolchain_dir
from program_support import Deployment, assert_verified, docker_on, new_deployment, remove_deployment
from sim_support import remove_labelled, sim_ready_or_skip, stage_on_head

from components import labels
from sim import cluster, deploy

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def pulumi_root() -> Path:
    """Directory whose bin/ holds the project's pulumi; skips (or fails under `make test`) when not built."""
    root = toolchain_dir()
    if not os.access(root / "bin" / "pulumi", os.X_OK):
        reason = f"Pulumi toolchain not built at {root}/bin/pulumi; run `make toolchain`"
        if os.environ.get("DSV41_REQUIRE_TOOLCHAIN") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return root


@pytest.fixture
def engine_env(pulumi_root: Path, tmp_path: Path) -> dict[str, str]:
    """Environment for every pulumi call of a test: its own backend and PULUMI_HOME, never a download."""
    backend = tmp_path / "backend"
    home = tmp_path / "pulumi-home"
    backend.mkdir()
    home.mkdir()
    python_bin = str(Path(sys.executable).parent)
    return {
        "PULUMI_BACKEND_URL": f"file://{backend}",
        "PULUMI_HOME": str(home),
        "PULUMI_CONFIG_PASSPHRASE": "engine-test-only",
        "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",
        "PULUMI_SKIP_UPDATE_CHECK": "true",
        "PULUMI_IGNORE_AMBIENT_PLUGINS": "true",
        # The dynamic-provider shim and the language host run this Python, which has the SDK.
        "PULUMI_PYTHON_CMD": sys.executable,
        "PATH": os.pathsep.join([str(pulumi_root / "bin"), python_bin, os.environ.get("PATH", "")]),
        # The dynamic provider process imports the resource's provider class from here.
        "PYTHONPATH": os.pathsep.join(p for p in [str(HERE), os.environ.get("PYTHONPATH", "")] if p),
    }


@pytest.fixture(scope="session")
def standin_language_host(pulumi_root: Path) -> Path:
    """The stand-in pulumi-language-python that build.sh installs next to pulumi."""
    host = pulumi_root / "bin" / "pulumi-language-python"
    if not os.access(host, os.X_OK):
        reason = f"no pulumi-language-python at {host}; run `make toolchain`"
        if os.environ.get("DSV41_REQUIRE_TOOLCHAIN") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return host


@pytest.fixture(scope="session")
def sim() -> dict[str, Any]:
    """The sim's description (sim.json); the sim stays up after the session."""
    return sim_ready_or_skip()


@pytest.fixture(scope="session")
def test_label() -> Iterator[str]:
    """Every container a test starts carries this label; the session removes them on every node."""
    label = f"dsv41.sim.test={uuid.uuid4().hex[:12]}"
    yield label
    if os.environ.get("DSV41_REQUIRE_SIM") == "1":
        remove_labelled(label)


@pytest.fixture(scope="module")
def weights(sim: dict[str, Any]) -> Iterator[Path]:
    """The checkpoint staged on the head by the program's staging command (bind share: every node sees it)."""
    root = Path(tempfile.mkdtemp(prefix="dsv41-sim-weights-"))
    proc = stage_on_head(sim, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def label(sim: dict[str, Any]) -> Iterator[str]:
    """A label for the containers one test starts; they are removed on every node afterwards."""
    value = f"dsv41.sim.case={uuid.uuid4().hex[:12]}"
    yield value
    remove_labelled(value)


@pytest.fixture(scope="session")
def program_env(pulumi_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for the real program's stacks: one backend and PULUMI_HOME (with both providers) per session."""
    return deploy.program_env(pulumi_root, tmp_path_factory.mktemp("program"), "program-test-only")


# The supervised stack's notifications: the agent appends each event to this file in its state mount.
SUPERVISED_NOTIFY_LOG = "/var/lib/dsv41-supervisor/notify.log"


def supervised_config(config: dict[str, Any]) -> None:
    # A probe every 5 s and a quick restart: each heal is short. Two restarts an hour: the budget tests spend it.
    config["supervisor"].update(
        {
            "probeSeconds": 5,
            "maxRestarts": 2,
            "windowHours": 1,
            "backoffSeconds": 1,
            "memWaitSeconds": 30,
            "notifyCommand": f"cat >> {SUPERVISED_NOTIFY_LOG}; echo >> {SUPERVISED_NOTIFY_LOG}",
        }
    )
    # Nodes given by host name, as owners give theirs (`spark-1`): on its own node each name resolves to
    # 127.0.1.1, as Ubuntu's /etc/hosts has it, and on this machine to the node's address (sim/cluster.py).
    for node in config["nodes"]:
        node["host"] = cluster.Layout.node_name(int(node["name"].removeprefix("node-")))


@pytest.fixture(scope="session")
def supervised(sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path) -> Iterator[Deployment]:
    """One verified stand-in stack with the supervisor and the observability layer, shared by the two modules
    that read them (test_supervisor_metrics_sim, then test_supervisor_sim: adjacent by name, so the stack runs
    beside no other module's). Each test leaves it verified, or says why not; the last destroys it."""
    root = Path(tempfile.mkdtemp(prefix="dsv41-supervised-weights-", dir="/var/tmp"))
    d = new_deployment(
        sim,
        f"sup-{uuid.uuid4().hex[:6]}",
        program_env,
        pulumi_root,
        weights_root=root,
        port=18895,
        master_port=29627,
        supervisor=True,
        observability=True,
        configure=supervised_config,
    )
    try:
        assert_verified(d, d.up().outputs)
        yield d
    finally:
        try:
            remove_deployment(d)
        finally:
            volume = f"{labels.stack_prefix('dsv41-exl3', d.name)}-prometheus-data"
            docker_on(sim["nodes"][0]["index"], "volume", "rm", "-f", volume)
            shutil.rmtree(root, ignore_errors=True)
