"""A stack's life through the real program on the simulated cluster: refusals before anything starts, the
first verified up, destroy keeping what is expensive to get again, secrets kept out of every place an operator
or another user of the machine can read. (Four nodes, tensor parallel 4: test_watchdog_sim's four-node stack.)

Tests run in file order on one stack that starts undeployed; each leaves it as the next expects.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from program_support import REPO, Deployment, assert_verified, docker_on, new_deployment, remove_deployment

pytestmark = [pytest.mark.sim, pytest.mark.engine]

MISSING_SHARD = "Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw/model-00007-of-00039.safetensors"


@pytest.fixture(scope="module")
def weights_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-life-weights-", dir="/var/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def fresh(
    sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path, weights_root: Path
) -> Iterator[Deployment]:
    d = new_deployment(
        sim,
        f"life-{uuid.uuid4().hex[:6]}",
        program_env,
        pulumi_root,
        weights_root=weights_root,
        port=18889,
        master_port=29622,
    )
    try:
        yield d
    finally:
        remove_deployment(d)


def stack_containers(d: Deployment) -> dict[int, list[str]]:
    """Per node index, the names of every container carrying this stack's label (running or not)."""
    return {
        n["index"]: docker_on(
            n["index"], "ps", "-a", "--format", "{{.Names}}", "--filter", f"label=dsv41-exl3.stack={d.name}"
        ).stdout.split()
        for n in d.sim["nodes"]
    }


def stack_volumes(d: Deployment) -> dict[int, list[str]]:
    return {
        n["index"]: [v for v in docker_on(n["index"], "volume", "ls", "-q").stdout.split() if d.name in v]
        for n in d.sim["nodes"]
    }


def log_count(path: Path, pattern: str) -> int:
    return len(re.findall(pattern, path.read_text())) if path.exists() else 0


def test_preflight_refusal_starts_and_stages_nothing(fresh: Deployment, weights_root: Path) -> None:
    cfg = json.loads(json.dumps(fresh.config))
    cfg["preflight"]["minMemAvailableGiB"] = 4096
    fresh.write_config(cfg)
    message, _ = fresh.up_fails()
    assert "MemAvailable" in message and "4096" in message, message
    assert "preflight" in message, message
    assert all(not names for names in stack_containers(fresh).values()), "no container may be created"
    assert not list(weights_root.rglob("*.safetensors")), "nothing may be staged after a preflight refusal"


def test_shard_missing_from_the_hub_fails_in_the_weights_layer_with_no_container(fresh: Deployment) -> None:
    cfg = json.loads(json.dumps(fresh.config))
    cfg["preflight"]["minMemAvailableGiB"] = 1
    fresh.write_config(cfg)
    faults = Path(fresh.sim["hub_faults"])
    faults.write_text(MISSING_SHARD + "\n")
    try:
        message, _ = fresh.up_fails()
    finally:
        faults.write_text("")
    assert "weights-stage" in message, f"the failure must be the weights layer's:\n{message}"
    assert "model-00007" in message or "39" in message, message
    assert all(not names for names in stack_containers(fresh).values()), "no container may be created"


def test_up_verifies_then_destroy_keeps_weights_and_images_and_the_next_up_reuses_them(
    fresh: Deployment, weights_root: Path
) -> None:
    assert_verified(fresh, fresh.up().outputs)
    state = Path(fresh.sim["state"])
    staged = {p: p.stat().st_mtime_ns for p in weights_root.rglob("*") if p.is_file()}
    # 39 EXL3 shards, Engram 47/48, and the slim Engram directory's hardlinks of those two
    assert len([p for p in staged if p.suffix == ".safetensors"]) == 39 + 2 + 2

    fresh.stack.destroy(on_output=lambda _l: None, color="never")
    assert all(not names for names in stack_containers(fresh).values()), "destroy removes every rank's container"
    assert all(not vols for vols in stack_volumes(fresh).values()), "and every volume of the stack"
    for n in fresh.sim["nodes"]:
        assert docker_on(n["index"], "image", "inspect", fresh.config["image"]).returncode == 0, (
            f"destroy must keep the image on node {n['index']}"
        )
    assert {p: p.stat().st_mtime_ns for p in staged if p.exists()} == staged, "destroy must keep the weights"

    downloads = log_count(state / "hub" / "hub.log", r"GET /[^ ]+/resolve/")
    pulls = log_count(state / "registry" / "registry.log", r"GET /v2/[^ ]+/blobs/")
    assert_verified(fresh, fresh.up().outputs)
    assert log_count(state / "hub" / "hub.log", r"GET /[^ ]+/resolve/") == downloads, "no weight re-downloaded"
    assert log_count(state / "registry" / "registry.log", r"GET /v2/[^ ]+/blobs/") == pulls, "no layer re-pulled"
    assert {p: p.stat().st_mtime_ns for p in staged} == staged


def test_moving_the_weights_restages_and_never_deletes_the_staged_copy(fresh: Deployment, weights_root: Path) -> None:
    before = sorted(p.relative_to(weights_root) for p in weights_root.rglob("*") if p.is_file())
    moved = Path(tempfile.mkdtemp(prefix="dsv41-life-moved-", dir="/var/tmp"))
    try:
        cfg = json.loads(json.dumps(fresh.config))
        cfg["weights"]["root"] = str(moved)
        fresh.write_config(cfg)
        assert_verified(fresh, fresh.up().outputs)
        assert len(list(moved.rglob("*.safetensors"))) == 39 + 2 + 2, "the new root is staged (engram-vllm/ too)"
        after = sorted(p.relative_to(weights_root) for p in weights_root.rglob("*") if p.is_file())
        assert after == before, "the old staged copy is kept"
    finally:
        cfg["weights"]["root"] = str(weights_root)
        fresh.write_config(cfg)
        assert_verified(fresh, fresh.up().outputs)
        shutil.rmtree(moved, ignore_errors=True)


def sample_argv(stop: threading.Event, seen: list[str]) -> None:
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                with contextlib.suppress(OSError):  # the process ended meanwhile
                    seen.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        stop.wait(0.2)


def test_secrets_appear_nowhere_in_plain_text(fresh: Deployment) -> None:
    hf_token = f"hf_{uuid.uuid4().hex}"
    api_key = f"sk-{uuid.uuid4().hex}"
    key_body = fresh.private_key.strip().splitlines()[1]  # a line of the key's base64 body
    secrets = {"hf token": hf_token, "api key": api_key, "ssh key": key_body}
    fresh.stack.set_config("dsv41-exl3:weights.hfToken", _secret(hf_token), path=True)
    fresh.stack.set_config("dsv41-exl3:serve.apiKey", _secret(api_key), path=True)

    argv: list[str] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_argv, args=(stop, argv), daemon=True)
    sampler.start()
    try:
        preview = fresh.cli("preview", "--diff")
        up = fresh.stack.up(on_output=fresh.lines.append, color="never", log_verbosity=5, log_to_std_err=True)
    finally:
        stop.set()
        sampler.join()
    assert_verified(fresh, up.outputs)
    exported = fresh.cli("stack", "export").stdout
    head, worker = fresh.sim["nodes"][0], fresh.sim["nodes"][1]
    inspect = docker_on(worker["index"], "inspect", fresh.container(worker)).stdout
    # The head reads its key from a file: its inspect (env, args, mounts) must not show it (issue 35).
    head_inspect = docker_on(head["index"], "inspect", fresh.container(head)).stdout
    bundle = report_bundle(fresh)
    assert {"config.json", "versions.json", "history.json", "records.json", "memory.json"} <= set(bundle), sorted(
        bundle
    )
    for role in ("head", "worker"):
        assert {f"boot/{role}.argv.json", f"boot/{role}.log.jsonl"} <= set(bundle), sorted(bundle)
        first = json.loads(bundle[f"boot/{role}.log.jsonl"].splitlines()[0])
        assert set(first) == {"t", "text"}, first  # sim/record.py's format: the conformance suite reads it
    assert json.loads(bundle["config.json"])["config"]["dsv41-exl3:serve"]["apiKey"] == "[secret]"
    assert any(r["name"] == "verify" for r in json.loads(bundle["records.json"])), bundle["records.json"]
    places = {
        "report bundle (dsv41-exl3 report)": "\n".join(bundle.values()),
        "stack export": exported,
        "preview --diff": preview.stdout + preview.stderr,
        "up output and verbose log": "\n".join(fresh.lines) + up.stderr,
        "argv of this machine's processes": "\n".join(argv),
        "worker container inspect": inspect,
        "head container inspect": head_inspect,
        "Pulumi.<stack>.yaml": (REPO / f"Pulumi.{fresh.name}.yaml").read_text(),
    }
    for where, text in places.items():
        for what, value in secrets.items():
            assert value not in text, f"the {what} appears in plain text in {where}"
    assert len(argv) > 100, "the argv sampler must have seen the up's processes"


def report_bundle(d: Deployment) -> dict[str, str]:
    """`dsv41-exl3 report` of the stack, unpacked: member path (under the bundle's top directory) -> text."""
    out = Path(tempfile.mkdtemp(prefix="dsv41-report-")) / "report.tar.gz"
    env = {**os.environ, **d.env, "PATH": f"{d.pulumi_root / 'bin'}:{os.environ['PATH']}"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "components", "report", "--stack", d.name, "--out", str(out)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        with tarfile.open(out) as tar:
            return {
                m.name.split("/", 1)[1]: tar.extractfile(m).read().decode()  # type: ignore[union-attr]
                for m in tar.getmembers()
                if m.isfile()
            }
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def _secret(value: str) -> Any:
    from pulumi import automation as auto

    return auto.ConfigValue(value, secret=True)
