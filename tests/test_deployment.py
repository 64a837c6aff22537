"""The whole graph under the recording mock: the order the hardware requires, secrets, outputs."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml

from components import serve_spec
from components.config import parse
from components.deployment import deploy
from tests import recording
from tests.test_config import two_sparks

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "command:remote:Command"
CONTAINER = "docker:index/container:Container"
SECRETS = ["-----BEGIN OPENSSH PRIVATE KEY-----", "sk-deploy-secret", "hf_token_secret"]


def fake_stdout(args: pulumi.runtime.MockResourceArgs) -> dict[str, Any]:
    """What the nodes would print: the preflight's JSON line, the staging manifest."""
    if "-preflight-" in f"-{args.name}-" or args.name.startswith("preflight-"):
        node = args.name.removeprefix("preflight-").removesuffix("-check")
        # These nodes have no RDMA devices (as on the simulated cluster): no GID is resolved.
        return {"stdout": json.dumps({"node": node, "mem_available_gib": 115.0, "gid_index": None,
                                      "stopped": [], "findings": []})}
    if args.name.endswith("-keygen"):
        key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFake" + args.name.replace("-", "")
        return {"stdout": f"DSV41_WATCHDOG_PUBKEY {key}"}
    if "stage" in args.name:
        return {"stdout": "DSV41_WEIGHTS_MANIFEST " + json.dumps(
            {"root": "/home/me/dsv41-exl3", "files": {"model/a.safetensors": 1}})}
    return {"stdout": ""}


FIXTURES = {COMMAND: fake_stdout}


def config(count: int = 2, **overrides: Any) -> dict[str, Any]:
    raw = two_sparks(**overrides)
    raw["nodes"] = [
        {"name": f"spark-{i}", "host": f"10.0.0.{i + 1}", "user": "me", "fabricIp": f"192.168.100.{i + 1}",
         "gpus": "", "rdmaDevices": [], "ibHcas": []}
        for i in range(count)
    ]
    raw["weights"] = {"share": "bind", "hfToken": "hf_token_secret"}
    raw.setdefault("serve", {})
    raw["serve"] = {**raw["serve"], "apiKey": "sk-deploy-secret"}
    return raw


def run(raw: dict[str, Any]) -> recording.Recorded:
    loaded = parse(raw)
    return recording.run(lambda: deploy(loaded, "dev"), FIXTURES)


@pytest.fixture(scope="module")
def two() -> recording.Recorded:
    return run(config(2))


def container(rec: recording.Recorded, node: str) -> recording.Registration:
    return rec.named(f"serving-{node}")


def test_preflight_weights_and_image_precede_each_nodes_container(two: recording.Recorded) -> None:
    for node in ("spark-0", "spark-1"):
        c = container(two, node)
        assert two.depends_on(c, two.named(f"preflight-{node}")), f"{node}: preflight must run before the container"
        assert two.depends_on(c, two.named(f"image-{node}")), f"{node}: the image must be on the node first"
        assert two.depends_on(c, two.named(f"weights-visible-{node}")), (
            f"{node}: the container must wait until the weights are visible on that node")


def test_workers_start_before_the_head_and_never_wait_for_it(two: recording.Recorded) -> None:
    head, worker = container(two, "spark-0"), container(two, "spark-1")
    assert two.depends_on(head, worker)
    assert not two.depends_on(worker, head)


def test_gates_and_verifier_follow_every_container_in_order(two: recording.Recorded) -> None:
    rendezvous = two.named("rendezvous")
    ready, verify = two.named("ready"), two.named("verify")
    for node in ("spark-0", "spark-1"):
        assert two.depends_on(rendezvous, container(two, node))
    assert two.depends_on(ready, rendezvous)
    assert two.depends_on(verify, ready)
    assert not two.depends_on(rendezvous, ready) and not two.depends_on(ready, verify)


def test_verifier_and_gates_rerun_on_every_container_id(two: recording.Recorded) -> None:
    ids = ["serving-spark-0-id", "serving-spark-1-id"]
    for name in ("rendezvous", "ready", "verify"):
        assert sorted(two.named(name).inputs["rerun_on"]) == sorted(ids), name


def test_nothing_waits_on_health_before_the_head_exists(two: recording.Recorded) -> None:
    head = container(two, "spark-0")
    for name in ("rendezvous", "ready", "verify"):
        assert not two.depends_on(head, two.named(name))
    assert "wait" not in head.inputs or head.inputs["wait"] is False


def test_weights_and_images_survive_destroy(two: recording.Recorded) -> None:
    staging = [r for r in two.of_type(COMMAND) if "stage" in r.name]
    assert staging and all(r.retain_on_delete for r in staging)
    for image in two.of_type("docker:index/remoteImage:RemoteImage"):
        assert image.retain_on_delete and image.inputs["keepLocally"] is True


def test_secrets_never_appear_in_plain_inputs(two: recording.Recorded) -> None:
    for r in two.registrations:
        secret_keys = r.secret_paths()
        for key, value in r.raw_inputs.items():
            if key in secret_keys or key == "__provider":
                continue
            text = json.dumps(value)
            for secret in SECRETS:
                assert secret not in text, f"{r.typ} {r.name}: input {key!r} holds a secret in plain text"


def test_outputs_name_the_endpoint_model_and_containers(two: recording.Recorded) -> None:
    out = two.outputs
    assert out["endpoint"] == "http://10.0.0.1:8888/v1"
    assert out["model"] == "DeepSeek-v4.1-Flash-EXL3"
    assert out["containers"] == {"spark-0": "dsv41-exl3-dev-spark-0", "spark-1": "dsv41-exl3-dev-spark-1"}
    assert isinstance(out["clusterGeneration"], str) and len(out["clusterGeneration"]) == 16
    assert set(out["verification"]) == {"answer", "logprobs", "latencySeconds", "verifiedAt"}


def test_each_node_is_reached_through_its_own_provider(two: recording.Recorded) -> None:
    providers = two.of_type("pulumi:providers:docker")
    assert {p.inputs["host"] for p in providers} == {"ssh://me@10.0.0.1:22", "ssh://me@10.0.0.2:22"}
    for p in providers:
        assert "ControlMaster=auto" in p.inputs["sshOpts"], "multiplex: sshd MaxStartups drops bursts"
        assert not any("PRIVATE KEY" in o for o in p.inputs["sshOpts"])


def test_four_nodes_make_four_ranks_with_three_headless_workers() -> None:
    rec = run(config(4, serve={"maxModelLen": 1_000_000, "kvCacheMemoryBytes": 4 * 1024**3}))
    containers = rec.of_type(CONTAINER)
    assert len(containers) == 4
    headless = [c for c in containers if "--headless" in c.inputs["command"]]
    assert len(headless) == 3
    head = container(rec, "spark-0")
    for i in (1, 2, 3):
        assert rec.depends_on(head, container(rec, f"spark-{i}"))


def test_watchdog_is_per_node_and_optional() -> None:
    on = run(config(2))
    assert len(on.of_type("dsv41-exl3:watchdog:MemoryWatchdog")) == 2
    off = run(config(2, watchdog={"enabled": False}))
    assert off.of_type("dsv41-exl3:watchdog:MemoryWatchdog") == []


def test_unfilled_dev_stack_fails_before_any_resource_or_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    stack = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())["config"]
    config = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in stack.items()}
    monkeypatch.chdir(ROOT)
    saved = pulumi.runtime.config.CONFIG.get()
    pulumi.runtime.config.CONFIG.set(config)
    registered: list[recording.Registration] = []
    try:
        with pytest.raises(pulumi.RunError) as err:
            recording.run(lambda: runpy.run_path(str(ROOT / "__main__.py")) and None, into=registered)
    finally:
        pulumi.runtime.config.CONFIG.set(saved)
    assert registered == [], "config errors must stop the program before any resource (and any SSH dial)"
    text = str(err.value)
    assert "nodes[0].host" in text and "nodes[1].fabricIp" in text and "ssh" in text


def test_preflight_reruns_with_the_generation_and_knows_it_to_spare_a_running_deployment() -> None:
    raw = config(2)
    generation = serve_spec.cluster_generation(parse(raw).settings)
    rec = run(raw)
    for node in ("spark-0", "spark-1"):
        check = rec.named(f"preflight-{node}-check")
        assert generation in check.inputs["triggers"], "replaced exactly when the ranks' generation changes"
        assert generation in check.inputs["create"], "the script must know which generation is current"
    other = run(config(2, serve={"maxNumSeqs": 1}))
    assert other.named("preflight-spark-0-check").inputs["triggers"] != rec.named("preflight-spark-0-check").inputs[
        "triggers"]


def test_an_unrelated_change_leaves_the_verifier_inputs_alone() -> None:
    """The verifier re-runs when its inputs change (a replaced container changes `rerun_on`);
    a change that replaces no container must leave them byte-identical."""
    base = run(config(2)).named("verify").raw_inputs
    for overrides in ({"watchdog": {"memAvailableFloorGiB": 7}}, {"gates": {"stallSeconds": 900}}):
        changed = run(config(2, **overrides))
        assert changed.named("verify").raw_inputs == base, overrides
        assert changed.outputs["clusterGeneration"] == run(config(2)).outputs["clusterGeneration"]


def test_a_serve_change_is_a_new_generation_for_every_rank() -> None:
    a = run(config(2))
    b = run(config(2, serve={"maxNumSeqs": 1}))
    for node in ("spark-0", "spark-1"):
        labels_a = {x["label"]: x["value"] for x in container(a, node).inputs["labels"]}
        labels_b = {x["label"]: x["value"] for x in container(b, node).inputs["labels"]}
        assert labels_a["dsv41-exl3.generation"] != labels_b["dsv41-exl3.generation"], (
            f"{node}: a changed serve flag must replace every rank together")


def test_every_rank_is_replaced_together_when_live_ranks_finds_one_down(two: recording.Recorded) -> None:
    live = two.named("live-ranks")
    assert live.typ == "pulumi-python:dynamic/drift:LiveRanks"
    for c in two.of_type(CONTAINER):
        assert c.replacement_trigger == "live-ranks-id", (
            f"{c.name} must be replaced whenever LiveRanks is (a rank found not running)")
    assert [r["container"] for r in live.inputs["ranks"]] == [
        serve_spec.container_name("dev", n) for n in parse(config()).settings.nodes]
    assert "ssh_private_key" in live.secret_paths()


def test_live_ranks_probes_the_verified_endpoint_with_the_api_key_as_a_secret(two: recording.Recorded) -> None:
    live, verifier = two.named("live-ranks"), two.named("verify")
    assert (live.inputs["endpoint"], live.inputs["model"]) == (verifier.inputs["endpoint"], verifier.inputs["model"]), (
        "the drift probe must ask the endpoint and model the verifier verified")
    assert "api_key" in live.secret_paths(), "serve.apiKey reaches LiveRanks only as a secret, like the ssh key"
