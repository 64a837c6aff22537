"""`dsv41-exl3 doctor` on the simulated cluster, as an owner runs it after `make stack` and before the first
`pulumi preview`: nothing deployed, the real CLI, the nodes' own preflight script, the registry and the hub.

One stack (head node 1, worker node 3: a node this module starts and stops, so its docker can be stopped) in copy
mode, three runs: healthy; then a revoked hub token, the worker's docker stopped and its copy root not creatable,
each named as its check's failure with the fix while every other check is still reported; then the hub gone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from program_support import REPO, Deployment, new_deployment, remove_deployment
from pulumi import automation as auto

from sim import cluster

pytestmark = [pytest.mark.sim, pytest.mark.engine]

WORKER = 3  # outside the default nodes and the reboot test's; the four-node module starts it too, after this one


@pytest.fixture(scope="module")
def stack(sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path) -> Iterator[Deployment]:
    layout = cluster.default_layout()
    states = cluster.status(layout)
    started = not (states.get(f"node-{WORKER}/dockerd") and states.get(f"node-{WORKER}/sshd"))
    if started:
        cluster.up_nodes(layout, [WORKER])
    described = cluster.describe(layout, [1, WORKER])
    scratch = Path(tempfile.mkdtemp(prefix="dsv41-doctor-", dir="/var/tmp"))
    d = new_deployment(
        {**sim, "nodes": described["nodes"]},
        f"doctor-{uuid.uuid4().hex[:6]}",
        program_env,
        pulumi_root,
        weights_root=scratch / "weights",
        copy_root=str(scratch / "copy-{node}"),
    )
    try:
        yield d
    finally:
        remove_deployment(d)
        if started:
            cluster.down(layout, [WORKER])
        shutil.rmtree(scratch, ignore_errors=True)


def doctor(d: Deployment) -> tuple[int, dict[str, Any]]:
    env = {**os.environ, **d.env, "PATH": f"{d.pulumi_root / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, "-m", "components", "doctor", "--stack", d.name, "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return done.returncode, json.loads(done.stdout)


def failed(result: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["where"], c["check"]): c for c in result["checks"] if c["status"] == "fail"}


@pytest.mark.timeout(600)
def test_doctor_passes_a_healthy_cluster_then_names_each_fault_with_its_fix(
    stack: Deployment, sim: dict[str, Any]
) -> None:
    d = stack
    code, healthy = doctor(d)
    assert code == 0 and healthy["ok"], json.dumps(failed(healthy), indent=1)
    checks = {(c["where"], c["check"]) for c in healthy["checks"]}
    head, worker = "node-1", f"node-{WORKER}"
    for expected in [(head, "ssh"), (head, "docker"), (head, "address"), (head, "disk"), (head, "memory"),
                     (head, "login-shell"), (head, "storage-driver"), (head, "gpu"), (head, "image"),
                     (worker, "disk"), (worker, "memfree"), (worker, "image")]:  # fmt: skip
        assert expected in checks, sorted(checks)
    model_repo, engram_repo = [c["check"] for c in healthy["checks"] if c["where"] == "hub"]

    # Three faults at once: a token the hub refuses, the worker's docker stopped, a copy root it cannot create.
    token = f"hf_revoked{uuid.uuid4().hex}"
    faults = Path(sim["hub_faults"])
    before = faults.read_text() if faults.exists() else ""
    blocker = Path(d.config["weights"]["copyRoot"].replace("{node}", worker)).parent / "not-a-dir"
    blocker.write_text("a file where the copy root's parent should be\n")
    original = json.loads(json.dumps(d.config))
    cfg = json.loads(json.dumps(d.config))
    cfg["weights"]["copyRoot"] = str(blocker / "copy-{node}")
    d.write_config(cfg)
    d.stack.set_config("dsv41-exl3:weights.hfToken", auto.ConfigValue(token, secret=True), path=True)
    layout = cluster.default_layout()
    faults.write_text(before + f"revoked:{token}\n")
    cluster.stop_pid(layout.node_dir(WORKER) / "dockerd.pid", "dockerd", 60)
    try:
        code, broken = doctor(d)
    finally:
        faults.write_text(before)
        cluster.up_nodes(layout, [WORKER])
    assert code == 1 and not broken["ok"]
    bad = failed(broken)
    assert set(bad) == {
        (worker, "docker"),
        (worker, "disk"),
        (worker, "image"),
        ("hub", model_repo),
        ("hub", engram_repo),
    }, json.dumps(list(bad))
    assert "docker is not reachable" in bad[(worker, "docker")]["detail"]
    assert "systemctl start docker" in bad[(worker, "docker")]["fix"]
    assert "cannot create" in bad[(worker, "disk")]["detail"] and bad[(worker, "disk")]["fix"]
    assert "refused the token" in bad[("hub", model_repo)]["detail"]
    assert "weights.hfToken" in bad[("hub", model_repo)]["fix"]
    assert token not in json.dumps(broken), "the token itself is never printed"
    head_rows = [c for c in broken["checks"] if c["where"] == head]
    assert head_rows and all(c["status"] != "fail" for c in head_rows), "the head is still reported, none failed"

    # The hub gone: nothing answers on its address (the config otherwise healthy again).
    d.write_config({**original, "weights": {**original["weights"], "hfEndpoint": "http://127.0.0.1:9"}})
    code, no_hub = doctor(d)
    bad = failed(no_hub)
    assert code == 1 and {w for w, _ in bad} == {"hub"}, json.dumps(list(bad))
    assert all("did not answer" in c["detail"] and "hfEndpoint" in c["fix"] for c in bad.values())
