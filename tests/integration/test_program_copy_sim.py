"""`weights.share: copy` deployed by `pulumi up` of this project onto the simulated cluster (issue 15).

The head stages from the hub stand-in; the worker's copy is filled by the real WorkerCopy provider: the head's
source and the worker's copier run in throwaway containers of the pulled stand-in image on each node's own
dockerd, over ssh, on the nodes' loopback fabric addresses. The sim's nodes share one filesystem, so each
worker's copy root carries `{node}` (as an operator whose workers share a filesystem would set it).
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
from program_support import Deployment, assert_verified, docker_on, new_deployment, remove_deployment

from components.weights import manifest as wm
from components.weights.copy_weights import PARTIAL_SUFFIX, RECORD_FILE, read_record

pytestmark = [pytest.mark.sim, pytest.mark.engine]

COPY_TYPE = "pulumi-python:dynamic/weights:WorkerCopy"


@pytest.fixture(scope="module")
def roots() -> Iterator[tuple[Path, Path]]:
    base = Path(tempfile.mkdtemp(prefix="dsv41-e2e-copy-", dir="/var/tmp"))
    yield base / "head", base / "copies"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def deployed(
    sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path, roots: tuple[Path, Path]
) -> Iterator[Deployment]:
    head_root, copies = roots
    head_root.mkdir(parents=True)
    d = new_deployment(
        sim,
        f"e2e-copy-{uuid.uuid4().hex[:6]}",
        program_env,
        pulumi_root,
        weights_root=head_root,
        port=18988,
        master_port=29721,
        copy_root=f"{copies}/{{node}}",
    )
    try:
        yield d
    finally:
        remove_deployment(d)
        # Destroy keeps every copy, as it keeps the head's weights.
        worker_copy = copies / "node-2"
        assert (worker_copy / RECORD_FILE).exists() and list(worker_copy.rglob("*.safetensors")), (
            "destroy must not delete a worker's copy"
        )


def worker_copy_outputs(d: Deployment) -> dict[str, Any]:
    state = json.loads(d.cli("stack", "export", "--show-secrets").stdout)
    (copy,) = [r for r in state["deployment"]["resources"] if r["type"] == COPY_TYPE]
    outputs: dict[str, Any] = copy["outputs"]
    return outputs


def staged(head_root: Path) -> dict[str, bytes]:
    """What a worker's copy holds: what its rank reads (model/ and the slim Engram directory)."""
    return {
        p.relative_to(head_root).as_posix(): p.read_bytes()
        for p in sorted(head_root.rglob("*"))
        if p.is_file() and p.relative_to(head_root).parts[0] in wm.SERVED_DIRS
    }


def rank_id(d: Deployment, node: dict[str, Any]) -> str:
    return docker_on(node["index"], "inspect", "-f", "{{.Id}}", d.container(node)).stdout.strip()


@pytest.mark.timeout(900)
def test_a_copy_mode_up_verifies_with_the_worker_loading_its_own_copy(
    deployed: Deployment, roots: tuple[Path, Path]
) -> None:
    head_root, copies = roots
    up = deployed.up()
    assert_verified(deployed, up.outputs)
    worker = deployed.sim["nodes"][1]
    mounts = json.loads(
        docker_on(worker["index"], "inspect", "-f", "{{json .Mounts}}", deployed.container(worker)).stdout
    )
    model = next(m for m in mounts if m["Destination"] == "/model")
    assert (model["Type"], model["Source"], model["RW"]) == ("bind", f"{copies}/node-2/model", False), model
    engram = next(m for m in mounts if m["Destination"] == "/engram-src")
    assert (engram["Type"], engram["Source"], engram["RW"]) == ("bind", f"{copies}/node-2/engram-vllm", False), engram
    assert not (copies / "node-2" / wm.ENGRAM_DIR).exists(), "the worker holds the slim Engram directory only"
    files = staged(head_root)
    assert files and {p: (copies / "node-2" / p).read_bytes() for p in files} == files
    outs = worker_copy_outputs(deployed)
    assert outs["copied_files"] == len(files) and outs["copied_bytes"] == sum(len(b) for b in files.values())
    assert not list((copies / "node-2").rglob(f"*{PARTIAL_SUFFIX}"))
    print(
        f"\ncopy e2e: first up copied {outs['copied_files']} files, {outs['copied_bytes']} bytes in "
        f"{outs['copy_seconds']}s (provider {outs['elapsed_s']}s)"
    )


@pytest.mark.timeout(600)
def test_a_second_up_copies_nothing(deployed: Deployment) -> None:
    before = worker_copy_outputs(deployed)
    again = deployed.up()
    changes = again.summary.resource_changes or {}
    assert set(changes) == {"same"}, f"a second up must change nothing: {changes}"
    assert worker_copy_outputs(deployed)["verified_at"] == before["verified_at"], "the copy did not run again"


@pytest.mark.timeout(600)
def test_a_corrupted_file_on_the_worker_is_seen_by_preview_and_copied_again_by_up(
    deployed: Deployment, roots: tuple[Path, Path]
) -> None:
    head_root, copies = roots
    shard = next(p for p in staged(head_root) if p.startswith("model/") and p.endswith(".safetensors"))
    target = copies / "node-2" / shard
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF  # right size, wrong content
    target.write_bytes(bytes(data))
    ranks = {n["index"]: rank_id(deployed, n) for n in deployed.sim["nodes"]}

    preview = deployed.preview()
    assert "update" in deployed.ops.get("weights-copy-node-2", set()), deployed.ops
    # With --diff the CLI writes warnings to stderr.
    assert shard in preview.stderr and "not the verified ones" in preview.stderr, preview.stderr[-2000:]
    assert set(deployed.ops) == {"weights-copy-node-2"}, f"only the copy changes: {deployed.ops}"

    deployed.up()
    outs = worker_copy_outputs(deployed)
    assert outs["copied_files"] == 1 and outs["copied_bytes"] == len(data), outs
    assert target.read_bytes() == (head_root / shard).read_bytes()
    assert {n["index"]: rank_id(deployed, n) for n in deployed.sim["nodes"]} == ranks, (
        "a repaired copy does not restart the running ranks (they loaded their weights at boot)"
    )
    assert set(deployed.up().summary.resource_changes or {}) == {"same"}


@pytest.mark.timeout(600)
def test_an_interrupted_copy_resumes_without_copying_finished_files_again(
    deployed: Deployment, roots: tuple[Path, Path]
) -> None:
    head_root, copies = roots
    worker_root = copies / "node-2"
    files = staged(head_root)
    shards = sorted(p for p in files if p.endswith(".safetensors"))
    partial, missing = shards[0], shards[1:4]
    # What an interrupted copy leaves: finished files in place and recorded, one file half written under its
    # temporary name, the files not started yet absent.
    (worker_root / partial).unlink()
    (worker_root / (partial + PARTIAL_SUFFIX)).write_bytes(files[partial][: len(files[partial]) // 2])
    for p in missing:
        (worker_root / p).unlink()
    finished = {p: (worker_root / p).stat().st_mtime_ns for p in files if p != partial and p not in missing}

    deployed.up()
    outs = worker_copy_outputs(deployed)
    assert outs["copied_files"] == 1 + len(missing), outs
    resumed = len(files[partial]) - len(files[partial]) // 2
    assert outs["copied_bytes"] == resumed + sum(len(files[p]) for p in missing), outs
    assert {p: (worker_root / p).read_bytes() for p in files} == files
    assert {p: (worker_root / p).stat().st_mtime_ns for p in finished} == finished, "finished files untouched"
    assert set(read_record(worker_root)) == set(files)


@pytest.mark.timeout(900)
def test_leaving_copy_mode_replaces_every_rank_and_keeps_the_copy(
    deployed: Deployment, roots: tuple[Path, Path]
) -> None:
    head_root, copies = roots
    worker_root = copies / "node-2"
    kept = {p: (worker_root / p).read_bytes() for p in staged(head_root)}
    ranks = {n["index"]: rank_id(deployed, n) for n in deployed.sim["nodes"]}
    cfg = json.loads(json.dumps(deployed.config))
    cfg["weights"] = {k: v for k, v in cfg["weights"].items() if k != "copyRoot"} | {"share": "bind"}
    deployed.write_config(cfg)
    up = deployed.up()
    assert_verified(deployed, up.outputs)
    after = {n["index"]: rank_id(deployed, n) for n in deployed.sim["nodes"]}
    assert all(after[i] != ranks[i] for i in ranks), "a share-mode change replaces every rank together"
    assert {p: (worker_root / p).read_bytes() for p in kept} == kept, "changing the share mode deletes no copy"
