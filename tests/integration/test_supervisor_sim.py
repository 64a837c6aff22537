"""The supervisor on the simulated cluster: a verified stand-in deployment that breaks heals with no Pulumi
command, within its budget, never while paused (test_supervisor_metrics_sim, with the alert that fires
meanwhile), and the next preview stays a no-op.

The session's supervised stack (conftest `supervised`, observed too) serves the module after
test_supervisor_metrics_sim; each test leaves it verified (or says why not) for the next; the last one destroys
it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from program_support import REPO, Deployment, assert_verified, docker_on

from components import labels
from components.observability.observability import LABEL
from sim.supervisor_view import armed, leader, restarted, restarts, status, wait_for

pytestmark = [pytest.mark.sim, pytest.mark.engine]


def rank_state(d: Deployment, node: dict[str, Any]) -> dict[str, Any]:
    out = docker_on(node["index"], "inspect", "--format", "{{json .State}} {{.Id}}", d.container(node)).stdout
    state, _, cid = out.strip().rpartition(" ")
    return {**json.loads(state), "Id": cid}


def cli(d: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **d.env, "PATH": f"{d.pulumi_root / 'bin'}:{os.environ['PATH']}"}
    return subprocess.run(
        [sys.executable, "-m", "components", "supervisor", *args, "--stack", d.name],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def config_values(d: Deployment) -> dict[str, tuple[str, bool]]:
    return {k: (v.value, v.secret) for k, v in d.stack.get_all_config().items()}


def rollback(d: Deployment, state_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "components", "rollback", "--stack", d.name, *args, "--yes"],
        cwd=REPO,
        env={**os.environ, **d.env, "DSV41_STATE_HOME": str(state_home)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def notify_events(d: Deployment) -> list[dict[str, Any]]:
    head = d.sim["nodes"][0]
    prefix = labels.stack_prefix("dsv41-exl3", d.name)
    path = Path.home() / ".local" / "state" / prefix / f"supervisor-node-{head['index']}" / "notify.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(900)
def test_a_killed_worker_is_healed_with_no_pulumi_command_and_preview_stays_a_no_op(supervised: Deployment) -> None:
    d = supervised
    assert cli(d, "resume").returncode == 0  # a fresh budget (maxRestarts 2): the metrics module's heal spent one
    before = armed(d)
    worker = d.sim["nodes"][1]
    ids = {n["index"]: rank_state(d, n)["Id"] for n in d.sim["nodes"]}
    killed_at = time.monotonic()
    assert docker_on(worker["index"], "kill", d.container(worker)).returncode == 0
    after = wait_for(
        d,
        "a verified restart",
        lambda s: len(restarts(s)) > len(restarts(before)) and restarts(s)[-1].get("result") not in (None, "running"),
        300,
    )
    healed_s = time.monotonic() - killed_at
    last = restarts(after)[-1]
    assert last["result"] == "verified", last
    assert "node-2" in last["cause"] and "exited" in last["cause"], last
    print(f"\n[supervisor] worker killed -> verified again in {healed_s:.1f} s (restart took {last['seconds']} s)")
    # The same containers, started again: Pulumi's state stays true.
    for n in d.sim["nodes"]:
        state = rank_state(d, n)
        assert state["Running"] and state["Id"] == ids[n["index"]], (n, state)
    d.preview()
    assert not d.ops, f"after a heal the preview must change nothing: {d.ops}\n" + "\n".join(d.lines[-40:])
    kinds = [e["event"] for e in notify_events(d)]
    assert "restarting" in kinds and "restarted" in kinds, kinds


@pytest.mark.timeout(900)
def test_a_killed_head_is_healed_and_recorded_with_its_cause(supervised: Deployment) -> None:
    d = supervised
    before = armed(d)
    head = d.sim["nodes"][0]
    assert docker_on(head["index"], "kill", d.container(head)).returncode == 0
    after = wait_for(
        d,
        "a verified restart",
        lambda s: len(restarts(s)) > len(restarts(before)) and restarts(s)[-1].get("result") not in (None, "running"),
        300,
    )
    last = restarts(after)[-1]
    assert last["result"] == "verified" and "node-1" in last["cause"], last
    out = cli(d, "status")
    assert out.returncode == 0, out.stderr
    assert "restarts:" in out.stdout and "node-1" in out.stdout, out.stdout


@pytest.mark.timeout(900)
def test_an_oom_killed_worker_is_healed_and_recorded_with_its_cause(supervised: Deployment) -> None:
    d = supervised
    assert cli(d, "resume").returncode == 0  # a fresh budget (maxRestarts 2 here): the earlier tests spent it
    before = armed(d)
    worker = d.sim["nodes"][1]
    name = d.container(worker)
    # The rank containers have no memory limit by config; under this one the kernel's OOM killer ends the
    # worker (State.OOMKilled, exit 137) as it ends a rank on a Spark whose memory runs out, and the limit stays
    # through the restart's `docker start`, as a Spark's memory does.
    limited = docker_on(worker["index"], "update", "--memory", "256m", "--memory-swap", "256m", name)
    assert limited.returncode == 0, limited.stderr
    # The stand-in's `oom` fault: at its next model step (the supervisor's probe) the worker allocates until
    # killed; a one-shot, so the same container started again serves.
    assert docker_on(worker["index"], "exec", name, "sh", "-c", "echo oom > /tmp/sim-fault").returncode == 0
    after = wait_for(d, "a restart after the OOM kill", restarted(before), 300)
    last = restarts(after)[-1]
    assert last["cause"] == "the rank on node-2 was OOM-killed", last
    assert last["result"] == "verified", last
    assert rank_state(d, worker)["Running"]


@pytest.mark.timeout(900)
def test_nan_after_ready_is_healed_within_the_budget_then_given_up_with_a_notification(supervised: Deployment) -> None:
    d = supervised
    assert cli(d, "resume").returncode == 0  # a fresh budget: the earlier tests' restarts count no more
    before = armed(d)
    head = d.sim["nodes"][0]
    # The stand-in's runtime fault lives in the container's /tmp: it outlasts every restart, a crash loop.
    assert (
        docker_on(head["index"], "exec", d.container(head), "sh", "-c", "echo nan-logits > /tmp/sim-fault").returncode
        == 0
    )
    try:
        gave_up = wait_for(d, "a give-up", lambda s: bool(s.get("given_up")), 600)
        assert "supervisor.maxRestarts" in gave_up["given_up"], gave_up["given_up"]
        new = restarts(gave_up)[len(restarts(before)) :]
        assert len(new) == 2 and all(r["result"] != "verified" for r in new), new
        kinds = [e["event"] for e in notify_events(d)]
        assert "gave-up" in kinds, kinds
        out = cli(d, "status")
        assert "gave up:" in out.stdout, out.stdout
    finally:
        docker_on(head["index"], "exec", d.container(head), "rm", "-f", "/tmp/sim-fault")
    assert cli(d, "resume").returncode == 0
    healed = wait_for(
        d,
        "healthy after resume",
        lambda s: (
            (s.get("last_probe") or {}).get("state") == "healthy"
            or (restarts(s) and restarts(s)[-1].get("result") == "verified")
        ),
        300,
    )
    assert not healed.get("given_up"), healed


@pytest.mark.timeout(900)
def test_a_rank_killed_during_an_up_is_left_to_the_up(supervised: Deployment) -> None:
    d = supervised
    before = armed(d)
    url, headers = leader(d)
    # What the program does for the length of an update (update_lock.py): hold the head's lock.
    lock = requests.post(f"{url}/lock", json={"holder": "test update", "ttl_s": 30}, headers=headers, timeout=10)
    assert lock.status_code == 200
    worker = d.sim["nodes"][1]
    try:
        assert docker_on(worker["index"], "kill", d.container(worker)).returncode == 0
        time.sleep(10)
        held = status(d)
        assert held["lock_holder"] == "test update" and restarts(held) == restarts(before), held
        assert not rank_state(d, worker)["Running"]
    finally:
        requests.delete(f"{url}/lock", json={"holder": "test update"}, headers=headers, timeout=10)
    after = wait_for(
        d,
        "a restart once the lock is gone",
        lambda s: len(restarts(s)) > len(restarts(before)) and restarts(s)[-1].get("result") not in (None, "running"),
        300,
    )
    assert restarts(after)[-1]["result"] == "verified"


@pytest.mark.timeout(900)
def test_after_a_failed_up_a_rollback_and_an_up_to_another_generation_the_supervisor_is_armed_and_heals(
    supervised: Deployment, tmp_path: Path
) -> None:
    """Issue 43's sequence: verified, a change that fails, the rollback, an up to another generation, a kill.
    The rollback command's own promises are checked on the way (a supervised stack is the default one)."""
    d = supervised
    assert cli(d, "resume").returncode == 0  # a fresh budget (maxRestarts 2 here): this test restarts once
    healthy, healthy_values = json.loads(json.dumps(d.config)), config_values(d)
    d.up()  # the verified update the rollback goes back to: the newest that succeeded
    before = armed(d)
    d.write_config(d.with_env(SIM_FAULT="wrong-answer"))
    message, _ = d.up_fails()
    assert f"To go back to the last verified deployment: dsv41-exl3 rollback --stack {d.name}" in message
    assert restarts(status(d)) == restarts(before), "the supervisor never acts on a failing update's ranks"
    from components.operator.rollback import history_of

    failed = max(u.version for u in history_of(d.stack) if u.result == "failed")
    refused = rollback(d, tmp_path, "--to", str(failed))
    assert refused.returncode == 2 and f"--to {failed}" in refused.stderr and "verified versions" in refused.stderr
    assert "SIM_FAULT" in json.dumps(config_values(d)), "a refused rollback must change nothing"
    rolled = rollback(d, tmp_path)
    assert rolled.returncode == 0, rolled.stdout[-2000:] + rolled.stderr
    assert "serve.extraEnv.SIM_FAULT: wrong-answer -> (unset)" in rolled.stdout, rolled.stdout[:3000]
    assert config_values(d) == healthy_values, "the rollback restores the verified update's config, secrets too"
    assert d.private_key.strip().splitlines()[1] not in rolled.stdout + rolled.stderr
    assert [p.name.split(".yaml.")[0] for p in (tmp_path / "rollback").iterdir()] == [f"Pulumi.{d.name}"]
    rolled_back = d.stack.outputs()
    assert_verified(d, rolled_back)
    assert rolled_back["lastVerified"].value["generation"] == rolled_back["clusterGeneration"].value
    assert set(d.preview().change_summary) == {"same"}, d.ops
    d.config = healthy
    d.write_config(d.with_env(SIM_GENERATION_NOTE="issue-43"))  # a serve change: another generation
    outputs = d.up().outputs
    assert_verified(d, outputs)
    generation = outputs["clusterGeneration"].value
    now = wait_for(d, f"armed for {generation}", lambda s: s.get("armed_generation") == generation, 60)
    by_update = [e for e in now["events"] if e["event"] == "armed" and e.get("generation") == generation]
    assert by_update and by_update[-1].get("by"), f"the update that verified {generation} arms it: {now['events']}"
    worker = d.sim["nodes"][1]
    assert docker_on(worker["index"], "kill", d.container(worker)).returncode == 0
    after = wait_for(d, "a verified restart of the new generation", restarted(now), 300)
    last = restarts(after)[-1]
    assert last["result"] == "verified" and "node-2" in last["cause"], last
    assert after["armed_generation"] == generation and after["last_verified"]["generation"] == generation


@pytest.mark.timeout(900)
def test_an_up_killed_mid_boot_then_the_readmes_recovery_steps_verify_and_release_the_lock(
    supervised: Deployment,
) -> None:
    """Issue 41: the CLI killed during the gates (a dropped session), then `cancel`, `refresh
    --clear-pending-creates` and `up` as the README's quick start says."""
    d = supervised
    before = armed(d)
    d.write_config(d.with_env(SIM_GENERATION_NOTE="interrupted"))
    cli_path = str(d.pulumi_root / "bin" / "pulumi")
    proc = subprocess.Popen(
        [cli_path, "up", "--yes", "--skip-preview", "--non-interactive", "--stack", d.name],
        cwd=REPO,
        env={**os.environ, **d.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            seen.append(line)
            if "rendezvous" in line and ("updating" in line or "creating" in line):
                os.killpg(proc.pid, signal.SIGKILL)  # the CLI only: the plugins and the program run on (own groups)
                break
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, "".join(seen[-30:])
        # The program left behind finds its engine gone and releases the supervisor's lock.
        wait_for(d, "the orphaned update's lock released", lambda s: not s.get("lock_holder"), 30)
        assert "currently locked" in d.cli("up", "--yes", "--skip-preview", check=False).stderr
    finally:
        end_orphans(d.name)
        d.cli("cancel", "--yes", check=False)  # the killed CLI's backend lock: else nothing after this runs
    d.cli("refresh", "--yes", "--skip-preview", "--clear-pending-creates")
    d.cli("up", "--yes", "--skip-preview")
    outputs = d.stack.outputs()
    assert_verified(d, outputs)
    generation = outputs["clusterGeneration"].value
    wait_for(d, f"armed for {generation}", lambda s: s.get("armed_generation") == generation, 60)
    assert restarts(status(d)) == restarts(before), "the supervisor left the interrupted update's ranks alone"


def end_orphans(stack: str) -> None:
    """Kill what a killed CLI left running for `stack`: its program and the plugins, all named by its engine's
    address (an operator's machine keeps them until they are killed or it reboots; CI must not)."""
    engines = set()
    cmdlines = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdlines[int(proc.name)] = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
    for argv in cmdlines.values():
        if b"--stack" in argv and stack.encode() in argv and b"--engine" in argv:
            engines.add(argv[argv.index(b"--engine") + 1])
    for pid, argv in cmdlines.items():
        if engines & set(argv):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def reboot(index: int) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sim.cluster", "reboot", str(index)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


@pytest.mark.timeout(1200)
def test_a_rebooted_worker_then_a_rebooted_head_are_served_again_with_no_pulumi_command(supervised: Deployment) -> None:
    d = supervised
    assert cli(d, "resume").returncode == 0  # a fresh budget (maxRestarts 2 here): one restart per reboot
    for node in (d.sim["nodes"][1], d.sim["nodes"][0]):
        before = armed(d)
        started = time.monotonic()
        print(f"\n[supervisor] {reboot(node['index']).strip()}")
        after = wait_for(d, f"a verified restart after rebooting node-{node['index']}", restarted(before), 600)
        last = restarts(after)[-1]
        print(f"[supervisor] node-{node['index']} rebooted -> verified again in {time.monotonic() - started:.1f} s")
        assert last["result"] == "verified" and f"node-{node['index']}" in last["cause"], last
        for n in d.sim["nodes"]:
            assert rank_state(d, n)["Running"], n
    # The memory guard lives in the agents, which docker brought back on both nodes.
    prefix = labels.stack_prefix("dsv41-exl3", d.name)
    for n in d.sim["nodes"]:
        ps = docker_on(
            n["index"], "ps", "--filter", f"name={prefix}-supervisor-node-{n['index']}", "--format", "{{.Status}}"
        ).stdout
        assert ps.startswith("Up"), (n, ps)


def data_volume(d: Deployment) -> str:
    return f"{labels.stack_prefix('dsv41-exl3', d.name)}-prometheus-data"


def layer_containers(d: Deployment) -> dict[int, list[str]]:
    """The observability containers on each node, by the layer's label."""
    out = {}
    for n in d.sim["nodes"]:
        ps = docker_on(n["index"], "ps", "-a", "--filter", f"label={LABEL}={d.name}", "--format", "{{.Names}}")
        assert ps.returncode == 0, ps.stderr
        out[n["index"]] = sorted(ps.stdout.split())
    return out


def volume_exists(d: Deployment) -> bool:
    inspected = docker_on(d.sim["nodes"][0]["index"], "volume", "inspect", data_volume(d))
    return bool(inspected.returncode == 0)


@pytest.mark.timeout(900)
def test_the_layer_goes_with_one_line_and_destroy_removes_the_supervisor_keeping_weights_and_kept_data(
    supervised: Deployment,
) -> None:
    d = supervised
    nodes = [n["index"] for n in d.sim["nodes"]]
    before = layer_containers(d)
    prefix = labels.stack_prefix("dsv41-exl3", d.name)
    assert before[nodes[0]] == sorted(
        [f"{prefix}-prometheus", f"{prefix}-exporter-node-{nodes[0]}", f"{prefix}-node-exporter-node-{nodes[0]}"]
    ), before
    assert all(len(before[i]) == 2 for i in nodes[1:]), before
    assert volume_exists(d)

    # Off is one line of config: the layer goes, its data with it (no keepData); the serving stays.
    off = json.loads(json.dumps(d.config))
    off["observability"]["enabled"] = False
    d.write_config(off)
    d.up()
    assert all(not names for names in layer_containers(d).values()), layer_containers(d)
    assert not volume_exists(d), "without observability.keepData the data volume goes with the layer"
    assert "prometheusUrl" not in d.stack.outputs()
    for n in d.sim["nodes"]:
        assert docker_on(n["index"], "inspect", "-f", "{{.State.Running}}", d.container(n)).stdout.strip() == "true"

    # Back, with keepData: destroy removes every container of the layer and of the supervisor, and leaves the
    # data volume and the weights.
    kept = json.loads(json.dumps(d.config))
    kept["observability"].update({"enabled": True, "keepData": True})
    d.write_config(kept)
    d.up()
    assert layer_containers(d) == before, "the layer is back as it was"
    for n in d.sim["nodes"]:
        ps = docker_on(
            n["index"], "ps", "--filter", f"label=dsv41-exl3.supervisor={d.name}", "--format", "{{.Names}} {{.Status}}"
        ).stdout
        assert f"{prefix}-supervisor-node-{n['index']}" in ps and "Up" in ps, ps
    d.stack.destroy(on_output=lambda _line: None, color="never")
    assert all(not names for names in layer_containers(d).values()), layer_containers(d)
    assert volume_exists(d), "observability.keepData keeps Prometheus' data volume through destroy"
    for n in d.sim["nodes"]:
        left = docker_on(n["index"], "ps", "-a", "--filter", f"label=dsv41-exl3.supervisor={d.name}", "-q").stdout
        assert not left.strip(), f"supervisor container left on node-{n['index']}"
    assert not list((Path.home() / ".local" / "share" / prefix).glob("supervisor-*"))
    assert any(Path(d.config["weights"]["root"]).iterdir()), "the weights stay"
