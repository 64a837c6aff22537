"""The real program, deployed by `pulumi up` of this project directory onto the simulated cluster.

Everything is the program's own: the docker provider (bridged from the upstream Terraform provider) pulls the
image and runs each rank's container over ssh://, the command provider runs the preflight and the staging over
SSH, the gates and the verifier read the ranks. One stack is deployed for the module and changed test by test,
as an operator would. A test that needs it verified starts with an up; the fault tests leave it after their
failed up, so a run of them costs one recovery (`verified`), not one each.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
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

from sim import cluster
from sim.deploy import build_image_variant

pytestmark = [pytest.mark.sim, pytest.mark.engine]


@pytest.fixture(scope="module")
def weights_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-e2e-weights-", dir="/var/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def deployed(
    sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path, weights_root: Path
) -> Iterator[Deployment]:
    d = new_deployment(
        sim,
        f"e2e-{uuid.uuid4().hex[:6]}",
        program_env,
        pulumi_root,
        weights_root=weights_root,
        port=18888,
        master_port=29621,
    )
    try:
        yield d
    finally:
        remove_deployment(d)


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
        "no gate or verifier re-ran"
    )


def step_diff(output: str, name: str) -> str:
    """The first diff the engine printed for resource `name`: from its URN line to the next resource's."""
    lines = output.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.strip().startswith("[urn=") and line.rstrip().endswith(f"::{name}]")
    )
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("[urn=")), len(lines))
    return "\n".join(lines[start:end])


def preview_of(d: Deployment, config: dict[str, Any]) -> Any:
    """Preview `config` against the deployed stack, then put the deployed config back."""
    deployed_config = d.config
    d.write_config(config)
    try:
        return d.preview()
    finally:
        d.write_config(deployed_config)


@pytest.mark.timeout(600)
def test_preview_of_a_serve_change_replaces_every_rank_and_reruns_the_gates_only(deployed: Deployment) -> None:
    cfg = json.loads(json.dumps(deployed.config))
    cfg["serve"]["maxNumSeqs"] = 1
    preview = preview_of(deployed, cfg)
    out = "\n".join(deployed.lines)
    containers = [f"serving-node-{n['index']}" for n in deployed.sim["nodes"]]
    ops = deployed.ops
    for c in containers:
        assert "replace" in ops.get(c, set()), f"{c} must be replaced by a serve change:\n{out}"
    for gate in ("rendezvous", "ready", "verify"):
        assert ops.get(gate) == {"update"}, f"the {gate} gate must re-run:\n{out}"
    allowed = set(containers) | {"rendezvous", "ready", "verify"}
    # The preflights re-run (their triggers carry the generation); so does each watchdog (new container id).
    allowed |= {f"preflight-node-{n['index']}-check" for n in deployed.sim["nodes"]}
    allowed |= {f"precheck-node-{n['index']}-check" for n in deployed.sim["nodes"]}
    allowed |= {f"watchdog-node-{n['index']}-install" for n in deployed.sim["nodes"]}
    assert set(ops) <= allowed, f"nothing else may change: {[(n, ops[n]) for n in set(ops) - allowed]}\n{out}"
    assert '"2" => "1"' in out, "the diff shows the changed flag value (--max-num-seqs 2 -> 1)"
    assert preview.change_summary.get("replace", 0) >= len(containers)


@pytest.mark.timeout(600)
def test_preview_of_a_watchdog_change_replaces_no_container(deployed: Deployment) -> None:
    cfg = json.loads(json.dumps(deployed.config))
    cfg["watchdog"]["memAvailableFloorGiB"] = 0.75
    preview_of(deployed, cfg)
    ops = deployed.ops
    assert not [n for n in ops if n.startswith("serving-")], ops
    assert any(n.startswith("watchdog-") for n in ops), f"the watchdogs must change: {ops}"


@pytest.mark.timeout(600)
def test_preview_of_an_image_change_replaces_every_rank(deployed: Deployment) -> None:
    cfg = json.loads(json.dumps(deployed.config))
    cfg["image"] = deployed.sim["image"].replace(":2.9bpw", ":2.9bpw-next")
    preview_of(deployed, cfg)
    ops = deployed.ops
    for n in deployed.sim["nodes"]:
        assert "replace" in ops.get(f"serving-node-{n['index']}", set()), ops


def container_ids(d: Deployment) -> dict[int, str]:
    return {
        n["index"]: docker_on(n["index"], "inspect", "-f", "{{.Id}} {{.State.Status}}", d.container(n)).stdout
        for n in d.sim["nodes"]
    }


@pytest.mark.timeout(600)
def test_a_preflight_change_rechecks_the_head_and_leaves_the_running_ranks_alone(deployed: Deployment) -> None:
    before = container_ids(deployed)
    assert all(v.strip().endswith("running") for v in before.values()), before
    healthy = deployed.config
    cfg = json.loads(json.dumps(healthy))
    cfg["preflight"]["minFreeDiskGiB"] = 2
    deployed.write_config(cfg)
    try:
        deployed.preview()
        head = deployed.sim["nodes"][0]["index"]
        # The disk minimum is the head's: both of its checks (the precheck before the pulls, the check before
        # the stop) re-run in place, and nothing else changes.
        head_checks = {f"precheck-node-{head}-check", f"preflight-node-{head}-check"}
        assert set(deployed.ops) == head_checks, deployed.ops
        assert all(deployed.ops[name] == {"update"} for name in head_checks), deployed.ops
        up = deployed.up()
        changes = up.summary.resource_changes or {}
        assert changes.get("update") == 2 and set(changes) == {"same", "update"}, changes
        assert container_ids(deployed) == before, "ranks already on the requested generation must not be touched"
    finally:
        deployed.write_config(healthy)
        deployed.up()


def verified(d: Deployment) -> Any:
    """An up of the deployed config that must verify: a test that needs a healthy stack starts with it. After the
    failed ups of the fault tests, it is the one up that brings the stack back (what each fault's test claims:
    nothing a failed up leaves behind keeps the next up from verifying)."""
    outputs = d.up().outputs
    assert_verified(d, outputs)
    return outputs


def fails(d: Deployment, fault_env: dict[str, str], **gates: int) -> tuple[str, float]:
    """An up with `fault_env` (and `gates` settings) added that must fail: its output and wall time. The healthy
    config is written back, not deployed: the next fault's up replaces every rank anyway, and the next test that
    needs a verified stack starts with `verified` (one recovery for a run of faults, not one per fault)."""
    healthy = d.config
    faulty = d.with_env(**fault_env)
    faulty["gates"].update(gates)
    d.write_config(faulty)
    try:
        return d.up_fails()
    finally:
        d.write_config(healthy)


def assert_both_ranks_tails(message: str, d: Deployment) -> None:
    for rank, n in enumerate(d.sim["nodes"]):
        assert f"--- rank {rank} (node node-{n['index']}" in message, f"rank {rank}'s last lines missing:\n{message}"


@pytest.mark.timeout(900)
def test_a_rank_stopped_after_a_verified_up_is_seen_and_the_next_up_restores_every_rank(deployed: Deployment) -> None:
    ensure_verified(deployed)
    worker = deployed.sim["nodes"][1]
    before = {
        n["index"]: docker_on(n["index"], "inspect", "-f", "{{.Id}}", deployed.container(n)).stdout.strip()
        for n in deployed.sim["nodes"]
    }
    assert docker_on(worker["index"], "stop", "-t", "5", deployed.container(worker)).returncode == 0
    # A refresh reads the stopped rank back as it is; the next preview and up still see and heal it (issue 41).
    assert deployed.refresh().summary.result == "succeeded", "\n".join(deployed.lines[-30:])

    preview = deployed.preview()
    for n in deployed.sim["nodes"]:
        assert "replace" in deployed.ops.get(f"serving-node-{n['index']}", set()), (
            f"the preview must show every rank replaced after one stopped: {deployed.ops}"
        )
    # With --diff the CLI writes warnings to stderr.
    assert f"node-{worker['index']} is exited" in preview.stderr, (
        f"the preview names the stopped rank:\n{preview.stderr}"
    )
    assert "verify" in deployed.ops, deployed.ops

    assert_verified(deployed, deployed.up().outputs)
    for n in deployed.sim["nodes"]:
        state = docker_on(n["index"], "inspect", "-f", "{{.Id}} {{.State.Status}}", deployed.container(n)).stdout
        new_id, status = state.split()
        assert status == "running" and new_id != before[n["index"]], (n, state)
    again = deployed.up()
    assert set(again.summary.resource_changes or {}) == {"same"}, "once restored, an up is a no-op again"

    # A rank removed by hand: the refresh drops it from the state, the next up creates it again (every rank new).
    removed = rank_ids(deployed)
    assert docker_on(worker["index"], "rm", "-f", deployed.container(worker)).returncode == 0
    assert deployed.refresh().summary.result == "succeeded", "\n".join(deployed.lines[-30:])
    assert_verified(deployed, deployed.up().outputs)
    recreated = rank_ids(deployed)
    assert all(recreated[i] and recreated[i] != removed[i] for i in removed), (removed, recreated)


def rank_ids(d: Deployment) -> dict[int, str]:
    return {
        n["index"]: docker_on(n["index"], "inspect", "-f", "{{.Id}}", d.container(n)).stdout.strip()
        for n in d.sim["nodes"]
    }


# What LiveRanks' probe says about each runtime fault of the stand-in (sim/standin, SIM_FAULT_FILE).
DRIFT_SEEN = {"nan-logits": "the model produced NaN", "hang": "a rank is dead or hung"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", sorted(DRIFT_SEEN))
def test_an_endpoint_that_stops_answering_with_real_logprobs_is_seen_and_the_next_up_restores_it(
    deployed: Deployment, fault: str
) -> None:
    ensure_verified(deployed)
    before = rank_ids(deployed)
    head = deployed.sim["nodes"][0]
    # Every container keeps running; only the head's answers break (the stand-in re-reads this file every step).
    switch = docker_on(head["index"], "exec", deployed.container(head), "sh", "-c", f"echo {fault} > /tmp/sim-fault")
    assert switch.returncode == 0, switch.stderr

    started = time.monotonic()
    preview = deployed.preview()
    detected_s = time.monotonic() - started
    out = "\n".join(deployed.lines) + preview.stderr  # with --diff the CLI writes warnings to stderr
    for n in deployed.sim["nodes"]:
        assert "replace" in deployed.ops.get(f"serving-node-{n['index']}", set()), (
            f"the preview must show every rank replaced when the endpoint {fault}s: {deployed.ops}\n{out}"
        )
    assert "verify" in deployed.ops, deployed.ops
    assert DRIFT_SEEN[fault] in out, f"the preview must say what the probe saw:\n{out}"
    print(f"\n[drift {fault}] preview that saw it: {detected_s:.1f} s")

    if fault == "nan-logits":
        refresh_reports(deployed, DRIFT_SEEN[fault])

    started = time.monotonic()
    assert_verified(deployed, deployed.up().outputs)
    print(f"[drift {fault}] up back to a verified endpoint: {time.monotonic() - started:.1f} s")
    after = rank_ids(deployed)
    assert all(after[i] != before[i] for i in before), f"every rank must be new: {before} -> {after}"
    # That the next up is a no-op again once restored: test_a_rank_stopped_after_a_verified_up_... shows it.


def refresh_reports(deployed: Deployment, seen: str) -> None:
    """`pulumi refresh` reports what the preview's probe saw (LiveRanks alone: the other resources' reads are not
    under test here). Once, for the NaN: the read is the preview's, and a hang's costs a probe timeout more."""
    live = next(
        r["urn"] for r in deployed.stack.export_stack().deployment["resources"] if r["urn"].endswith("::live-ranks")
    )
    deployed.stack.refresh(target=[live], on_output=lambda _line: None, color="never")
    state = next(r for r in deployed.stack.export_stack().deployment["resources"] if r["urn"] == live)
    assert seen in (state["outputs"].get("endpoint_observed") or ""), state["outputs"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.timeout(300)
def test_the_official_openai_client_gets_a_tool_call_from_the_deployed_endpoint(deployed: Deployment) -> None:
    import openai

    outputs = ensure_verified(deployed)
    # The sim's stack sets no `serve.apiKey`: the endpoint requires the program's generated key.
    anonymous = openai.OpenAI(base_url=outputs["endpoint"].value, api_key="not-the-key", timeout=60, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    key = outputs["apiKey"].value
    client = openai.OpenAI(base_url=outputs["endpoint"].value, api_key=key, timeout=60, max_retries=0)
    reply = client.chat.completions.create(
        model=outputs["model"].value,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        max_tokens=64,
    )  # type: ignore[list-item]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def operator_command(d: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` as an operator runs it beside the stack: the stack's backend and passphrase."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env={**os.environ, **d.env},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.timeout(600)
def test_status_and_logs_read_the_deployed_stack_and_show_no_secret(deployed: Deployment) -> None:
    outputs = ensure_verified(deployed)
    key = outputs["apiKey"].value
    status = operator_command(deployed, "components", "status", "--stack", deployed.name, "--json", "--interval", "1")
    assert status.returncode == 0, status.stdout + status.stderr
    report = json.loads(status.stdout)
    assert report["healthy"] is True
    assert [n["name"] for n in report["nodes"]] == [n["name"] for n in deployed.config["nodes"]]
    assert all(n["running"] and n["memAvailableGiB"] > 0 for n in report["nodes"]), report["nodes"]
    assert report["metrics"]["error"] is None and report["metrics"]["requestsRunning"] == 0, report["metrics"]
    assert report["verification"]["logprobs"], report["verification"]
    human = operator_command(deployed, "components", "status", "--stack", deployed.name, "--interval", "1")
    assert human.returncode == 0, human.stdout + human.stderr
    for out in (status, human):
        assert key not in out.stdout + out.stderr
        assert deployed.private_key.strip().splitlines()[1] not in out.stdout + out.stderr

    logs = operator_command(deployed, "components", "logs", "--stack", deployed.name, "worker", "--tail", "200")
    assert logs.returncode == 0, logs.stderr
    # The worker's own log, through the node's ssh: its container's lines, with docker's timestamps.
    assert re.search(r"^\d{4}-\d\d-\d\dT\S+ ", logs.stdout, re.M), logs.stdout[-2000:]
    unknown = operator_command(deployed, "components", "logs", "--stack", deployed.name, "no-such-node")
    assert unknown.returncode == 2 and "no-such-node" in unknown.stderr, unknown.stderr


def config_values(d: Deployment) -> dict[str, tuple[str, bool]]:
    return {k: (v.value, v.secret) for k, v in d.stack.get_all_config().items()}


@pytest.mark.timeout(900)
def test_nan_logprobs_fail_the_up_as_nan(deployed: Deployment) -> None:
    message, _ = fails(deployed, {"SIM_FAULT": "nan-logits"})
    assert "NaN" in message, message


@pytest.mark.timeout(900)
def test_worker_exit_after_load_fails_naming_the_worker(deployed: Deployment) -> None:
    message, _ = fails(deployed, {"SIM_FAULT": "worker-exit-after-load"})
    assert "rank 1" in message and "node-2" in message, message
    assert_both_ranks_tails(message, deployed)


@pytest.mark.timeout(900)
def test_rank_that_never_joins_fails_naming_the_rank(deployed: Deployment) -> None:
    # The head's store gives up after 10 s (real vLLM's after its own timeout): the gate names the rank either way.
    message, elapsed = fails(deployed, {"SIM_FAULT": "rank-never-joins", "SIM_RENDEZVOUS_TIMEOUT_S": "10"})
    assert "rank 1" in message, message
    assert_both_ranks_tails(message, deployed)
    bound = deployed.config["gates"]["rendezvousTimeoutSeconds"]
    assert elapsed < bound + 90, f"must fail by the rendezvous timeout ({bound} s) plus the up's own work: {elapsed}"


@pytest.mark.timeout(900)
def test_stall_after_load_fails_near_stall_seconds(deployed: Deployment) -> None:
    # Half the stack's limit: the rule is the same, and the silence it waits out is the test's longest wait.
    stall = deployed.config["gates"]["stallSeconds"] // 2
    message, elapsed = fails(deployed, {"SIM_FAULT": "stall-after-load"}, stallSeconds=stall)
    # The ready gate's stall wording (decisions._stall_cause), not the timeout's or another failure's.
    assert "no rank logged anything new for" in message and f"(stall limit {stall:g} s)" in message, message
    assert "a rank is probably hung" in message and "not ready within" not in message, message
    # The node counters (docs/hardware.md) stayed flat too: a silence with them flat is a stall.
    assert "no node's NFS reads, fabric rx or MemAvailable moved meanwhile" in message, message
    assert_both_ranks_tails(message, deployed)
    assert elapsed < stall + 90, f"a stall must be called near stallSeconds ({stall} s), took {elapsed:.0f} s"


@pytest.mark.timeout(900)
def test_a_rank_whose_start_finds_no_memavailable_is_not_started_and_the_gate_names_it(deployed: Deployment) -> None:
    # Every rank starts through components/serving/rank_entry.sh under the sim image's own sh (Debian's dash); every
    # sim boot passes its floor (preflight.minMemAvailableGiB 1). Pointed at an empty meminfo, each rank refuses
    # before vLLM, and the rendezvous gate fails on that line at once, not at its timeout.
    message, _ = fails(deployed, {"DSV41_MEMINFO": "/dev/null"})
    assert "was not started: its node's MemAvailable was below the preflight's floor, or unreadable" in message
    assert "rank not started on node node-" in message and "cannot read MemAvailable from /dev/null" in message
    assert "rendezvous did not complete within" not in message, message
    assert_both_ranks_tails(message, deployed)


@pytest.mark.timeout(900)
def test_watchdog_floor_above_memavailable_stops_the_rank_and_records_why(deployed: Deployment) -> None:
    healthy = deployed.config
    cfg = json.loads(json.dumps(healthy))
    # Above this machine's memory, below a Spark's (config refuses a floor no Spark can meet).
    cfg["watchdog"].update(memAvailableFloorGiB=100, sampleSeconds=1, consecutiveSamples=2)
    cfg["serve"]["extraEnv"]["SIM_LOAD_SECONDS"] = "20"  # the watchdog acts while the gates wait
    deployed.write_config(cfg)
    try:
        message, _ = deployed.up_fails(diff=True)
        # The head's env holds no key any more (it reads it from a file), so it is not one secret: the update's
        # diff names the changed value on the head too, not `[secret]` (issue 35).
        head_step = step_diff(message, f"serving-node-{deployed.sim['nodes'][0]['index']}")
        assert "SIM_LOAD_SECONDS=20" in head_step and "[secret]" not in head_step, head_step
        # Real vLLM exits 0 on SIGTERM (a loading worker ignores it: 137 after docker's grace); either way the
        # gates' hint points at the watchdog's log.
        assert re.search(r"exit(?: code)? (?:0|137)\b", message) and "watchdog" in message, (
            f"the gates must see the stopped rank and name the watchdog:\n{message}"
        )
        # The sim's nodes share this machine's home directory, where each node's watchdog logs (per stack).
        path = Path.home() / ".local" / "state" / f"dsv41-exl3-{deployed.name}" / "watchdog.log"

        def mine() -> list[str]:
            return [line for line in path.read_text().splitlines() if deployed.name in line]

        # The gates fail on the stopped rank's die event, which can be before the tripped watchdog has finished
        # asking its peer (its ssh to the other node): wait for the watchdog's lines, within a bound.
        deadline = time.monotonic() + 30
        while (
            not any("STOP requested by the watchdog of node-" in line for line in mine())
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        log = path.read_text()
        assert any("STOP: MemAvailable below" in line for line in mine()), f"the watchdog logs why:\n{log[-3000:]}"
        assert any("holder (pid rss_kib command)" in line for line in mine()), "and which processes held the memory"
        # Every rank is stopped, not one: each tripped watchdog asked its peer over ssh with its own key.
        assert any("STOP requested by the watchdog of node-" in line for line in mine()), (
            f"a peer's rank must be stopped at the tripped watchdog's request:\n{log[-3000:]}"
        )
    finally:
        deployed.write_config(healthy)  # deployed by the next test that needs a verified stack (`verified`)


@pytest.mark.timeout(900)
def test_a_rank_that_exits_at_once_shows_vllms_own_error(deployed: Deployment) -> None:
    healthy = deployed.config
    cfg = json.loads(json.dumps(healthy))
    cfg["serve"]["extraArgs"] = [*cfg["serve"]["extraArgs"], "--no-such-flag"]
    deployed.write_config(cfg)
    try:
        message, _ = deployed.up_fails()
        # Kept (must_run=False), the exited container's own log reaches the gate's message. (The pinned docker
        # provider no longer deletes a must_run container that exits at once, so this guards, it does not
        # tell must_run apart; test_serving pins the input.)
        assert "vllm serve: error: unrecognized arguments: --no-such-flag" in message, message
        assert "exit code 2" in message and "(node node-" in message, message
        assert "container exited immediately" not in message, message
    finally:
        deployed.write_config(healthy)


@pytest.mark.timeout(300)
def test_rollback_of_a_stack_never_verified_says_so_and_changes_nothing(
    sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path, weights_root: Path, tmp_path: Path
) -> None:
    d = new_deployment(sim, f"rb-{uuid.uuid4().hex[:6]}", program_env, pulumi_root, weights_root=weights_root)
    try:
        before = config_values(d)
        refused = rollback_command(d, "--yes", env={"DSV41_STATE_HOME": str(tmp_path)})
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "no verified update in its history" in refused.stderr and "nothing was changed" in refused.stderr
        assert config_values(d) == before and not (tmp_path / "rollback").exists()
    finally:
        d.stack.workspace.remove_stack(d.name, force=True)


def rollback_command(d: Deployment, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "components", "rollback", "--stack", d.name, *args],
        cwd=REPO,
        env={**os.environ, **d.env, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )


def answers(outputs: dict[str, Any]) -> bool:
    import requests

    try:
        reply = requests.get(
            f"{outputs['endpoint'].value}/models",
            headers={"Authorization": f"Bearer {outputs['apiKey'].value}"},
            timeout=2,
        )
    except requests.RequestException:
        return False
    return reply.status_code == 200


def ranks_running(d: Deployment) -> dict[int, str]:
    return {
        n["index"]: docker_on(n["index"], "inspect", "--format", "{{.Id}} {{.State.Running}}", d.container(n)).stdout
        for n in d.sim["nodes"]
    }


@pytest.mark.timeout(1500)
def test_an_image_change_serves_on_until_every_node_has_pulled_and_a_failed_pull_names_the_node(
    deployed: Deployment,
) -> None:
    import threading

    from pulumi import automation as auto

    healthy = deployed.config
    # After the fault tests, also the up that proves a failed up leaves nothing that keeps the next from verifying.
    outputs = verified(deployed)
    first, last = deployed.sim["nodes"][0], deployed.sim["nodes"][-1]
    # On the head only, not pushed: the others cannot pull it.
    tag = build_image_variant(deployed.config["image"], first["index"], f"next-{uuid.uuid4().hex[:6]}")
    before = ranks_running(deployed)
    try:
        deployed.write_config({**healthy, "image": tag})
        message, _ = deployed.up_fails()
        assert f"image-node-{last['index']}-pull" in message, message[-3000:]
        assert ranks_running(deployed) == before, "a failed pull must leave every old rank as it was, running"
        assert answers(outputs), "the old endpoint must still answer after a failed pull"

        pushed = docker_on(first["index"], "push", tag)
        assert pushed.returncode == 0, pushed.stderr
        probes: list[tuple[float, bool]] = []
        events: list[tuple[float, str, str]] = []  # (when, pre|outputs, resource name)
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                probes.append((time.monotonic(), answers(outputs)))
                time.sleep(0.3)

        def record(event: auto.EngineEvent) -> None:
            for kind, item in (("pre", event.resource_pre_event), ("outputs", event.res_outputs_event)):
                # A replaced image's old resource is deleted (retained) at the very end: not a pull.
                if item is not None and str(item.metadata.op.value) != "delete-replaced":
                    events.append((time.monotonic(), kind, item.metadata.urn.split("::")[-1]))

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        try:
            up = deployed.stack.up(on_event=record, on_output=lambda _l: None, color="never")
        finally:
            done.set()
            prober.join(5)
        assert_verified(deployed, up.outputs)
        pulled: dict[str, float] = {}  # each node's pull: when it finished
        for t, kind, name in events:
            if kind == "outputs" and re.fullmatch(r"image-node-\d+-pull", name):
                pulled.setdefault(name, t)
        stops = [t for t, kind, name in events if kind == "pre" and re.fullmatch(r"preflight-node-\d+-check", name)]
        assert len(pulled) == len(deployed.sim["nodes"]) and stops, events
        assert min(stops) > max(pulled.values()), "no node's old rank may stop before every node holds the new image"
        served = [ok for t, ok in probes if t <= max(pulled.values())]
        assert served and all(served), f"the old endpoint failed to answer while the image downloaded: {probes}"
        assert not all(ok for _, ok in probes), "the probe never saw the boot: it measured nothing"
    finally:
        deployed.write_config(healthy)
        assert_verified(deployed, deployed.up().outputs)
        for node in deployed.sim["nodes"]:
            docker_on(node["index"], "rmi", tag)


@contextlib.contextmanager
def nfs_reads(path: Path, server: str, bytes_per_s: float = 64 << 20) -> Iterator[None]:
    """Plays a worker node's NFS client while the block runs: the node's mountstats (the sim's per-node file)
    counts bytes read from `server`, as a GB10 worker's does while it streams the weights (docs/hardware.md)."""
    stop = threading.Event()

    def run() -> None:
        start = time.monotonic()
        while not stop.wait(0.5):
            n = int((time.monotonic() - start) * bytes_per_s)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(
                f"device {server}:/srv/dsv41 mounted on /var/lib/docker/volumes/w/_data with fstype nfs4 "
                f"statvers=1.1\n\tbytes:\t{n} 0 0 0 {n} 0 {n >> 12} 0\n"
            )
            tmp.replace(path)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


@pytest.mark.timeout(900)
def test_a_silent_worker_load_past_stall_seconds_passes_while_its_nfs_reads_move(deployed: Deployment) -> None:
    # GB10: the worker streams its weights over NFS in silence with its container's counters flat; only the
    # node's own counters move. (The same silence with them flat is a stall: test_stall_after_load_fails_...)
    # A short stall limit for this one up keeps the silence short; the rule is the same at any limit.
    stall = 12
    head, worker = deployed.sim["nodes"][0], deployed.sim["nodes"][1]
    mountstats = cluster.default_layout().mountstats(worker["index"])
    healthy = deployed.config
    cfg = deployed.with_env(SIM_WORKER_LOAD_SECONDS=str(stall + 10))
    cfg["gates"]["stallSeconds"] = stall
    try:
        deployed.write_config(cfg)
        with nfs_reads(mountstats, head["ip"]):
            up = deployed.up()
        assert_verified(deployed, up.outputs)
    finally:
        mountstats.unlink(missing_ok=True)
        deployed.write_config(healthy)  # last in the module: its teardown destroys the stack
