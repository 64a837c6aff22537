"""The whole graph under the recording mock: the order the hardware requires, secrets, outputs."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pulumi
import pytest
import yaml

from components import labels
from components.config import parse
from components.deployment import deploy
from components.serving import spec as serve_spec
from components.weights import manifest as wm
from tests.support import recording
from tests.support.graph import COMMAND, CONTAINER, FIXTURES, FULL_MANIFEST, GIDS, WORKER_COPY, config, run
from tests.support.host_keys import fake_host_key
from tests.support.scripts import header_value

ROOT = Path(__file__).resolve().parents[1]
SECRETS = ["-----BEGIN OPENSSH PRIVATE KEY-----", "sk-deploy-secret-0123456789abcde", "hf_token_secret"]


@pytest.fixture(scope="module")
def two() -> recording.Recorded:
    return run(config(2))


def rank_containers(rec: recording.Recorded) -> list[recording.Registration]:
    """The serving ranks (the supervisor's agents are containers too)."""
    return [c for c in rec.of_type(CONTAINER) if c.name.startswith("serving-")]


def container(rec: recording.Recorded, node: str) -> recording.Registration:
    return rec.named(f"serving-{node}")


def test_preflight_weights_and_image_precede_each_nodes_container(two: recording.Recorded) -> None:
    for node in ("spark-0", "spark-1"):
        c = container(two, node)
        assert two.depends_on(c, two.named(f"preflight-{node}-check")), f"{node}: preflight must run first"
        assert two.depends_on(c, two.named(f"image-{node}")), f"{node}: the image must be on the node first"
        assert two.depends_on(c, two.named(f"weights-visible-{node}")), (
            f"{node}: the container must wait until the weights are visible on that node"
        )


def test_old_ranks_stop_only_after_every_nodes_check_and_image_pull(two: recording.Recorded) -> None:
    """An image change serves on while the new image downloads: no node's stop phase runs before every node
    holds the image and passed its check phase; the check phase waits for no pull (it fails fast)."""
    nodes = ("spark-0", "spark-1")
    for node in nodes:
        stop = two.named(f"preflight-{node}-check")
        assert " STOP=1;" in stop.inputs["create"]
        check = two.named(f"precheck-{node}-check")
        assert " STOP=0;" in check.inputs["create"]
        for other in nodes:
            assert two.depends_on(stop, two.named(f"precheck-{other}-check")), (node, other)
            assert two.depends_on(stop, two.named(f"image-{other}")), (node, other)
            assert not two.depends_on(check, two.named(f"image-{other}")), (node, other)


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
    assert set(out["lastVerified"]) == {"verifiedAt", "generation", "imageIds"}
    assert out["lastVerified"]["generation"] == out["clusterGeneration"]
    assert set(out["lastVerified"]["imageIds"]) == {"spark-0", "spark-1"}


def test_a_failed_verification_names_the_rollback_of_this_stack(two: recording.Recorded) -> None:
    assert two.named("verify").raw_inputs["rollback_command"] == "dsv41-exl3 rollback --stack dev"


def test_each_node_is_reached_through_its_own_provider(two: recording.Recorded) -> None:
    providers = two.of_type("pulumi:providers:docker")
    assert {p.inputs["host"] for p in providers} == {"ssh://me@10.0.0.1:22", "ssh://me@10.0.0.2:22"}
    for p in providers:
        assert "ControlMaster=auto" in p.inputs["sshOpts"], "multiplex: sshd MaxStartups drops bursts"
        assert not any("PRIVATE KEY" in o for o in p.inputs["sshOpts"])


def test_four_nodes_make_four_ranks_with_three_headless_workers() -> None:
    rec = run(config(4, serve={"maxModelLen": 1_000_000, "kvCacheMemoryBytes": 4 * 1024**3}))
    containers = rank_containers(rec)
    assert len(containers) == 4
    headless = [c for c in containers if "--headless" in c.inputs["command"]]
    assert len(headless) == 3
    head = container(rec, "spark-0")
    for i in (1, 2, 3):
        assert rec.depends_on(head, container(rec, f"spark-{i}"))


def watchdog_commands(rec: recording.Recorded) -> list[str]:
    return sorted(c.name for c in rec.of_type(COMMAND) if c.name.startswith("watchdog-"))


def test_watchdog_is_per_node_and_optional(two: recording.Recorded) -> None:
    assert watchdog_commands(two) == [
        "watchdog-key-spark-0-keygen",
        "watchdog-key-spark-1-keygen",
        "watchdog-spark-0-install",
        "watchdog-spark-1-install",
    ]
    off = run(config(2, watchdog={"enabled": False}))
    assert watchdog_commands(off) == []


# Each per-node command that had a component of its own until issue 36, and that component's type.
FLATTENED = {
    "precheck-{}-check": ("dsv41-exl3:preflight:PreflightCheck", "precheck-{}"),
    "preflight-{}-check": ("dsv41-exl3:preflight:Preflight", "preflight-{}"),
    "watchdog-key-{}-keygen": ("dsv41-exl3:watchdog:WatchdogKey", "watchdog-key-{}"),
    "watchdog-{}-install": ("dsv41-exl3:watchdog:MemoryWatchdog", "watchdog-{}"),
}


def test_commands_whose_component_was_merged_sit_under_the_root_with_aliases_to_both_old_parents(
    two: recording.Recorded,
) -> None:
    """Removing a wiring-only component changes its child's URN; without an alias naming the old parent, in each
    layout a deployed stack may hold, the next `up` would replace (re-run) the command (tests/integration/
    test_program_upgrade.py proves the upgrade on the engine)."""
    root = two.named("deployment")
    assert not [r for r in two.registrations if r.typ in {t for t, _ in FLATTENED.values()}]
    for node in ("spark-0", "spark-1"):
        for command, (typ, old) in FLATTENED.items():
            cmd = two.named(command.format(node))
            assert cmd.parent == root.urn, f"{cmd.name} hangs off the root Deployment"
            parents = {a["spec"]["parentUrn"] for a in cmd.aliases}
            stack_urn = "urn:pulumi:test::dsv41-exl3::"  # recording.run's stack and project
            assert parents == {
                f"{stack_urn}dsv41-exl3:index:Deployment${typ}::{old.format(node)}",
                f"{stack_urn}{typ}::{old.format(node)}",
            }, cmd.aliases


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
    assert (
        other.named("preflight-spark-0-check").inputs["triggers"]
        != rec.named("preflight-spark-0-check").inputs["triggers"]
    )


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
            f"{node}: a changed serve flag must replace every rank together"
        )


def test_every_rank_is_replaced_together_when_live_ranks_finds_one_down(two: recording.Recorded) -> None:
    live = two.named("live-ranks")
    assert live.typ == "pulumi-python:dynamic/drift:LiveRanks"
    for c in rank_containers(two):
        assert c.replacement_trigger == "live-ranks-id", (
            f"{c.name} must be replaced whenever LiveRanks is (a rank found not running)"
        )
    assert [r["container"] for r in live.inputs["ranks"]] == [
        labels.container_name("dev", n.name) for n in parse(config()).settings.nodes
    ]
    assert "ssh" in live.secret_paths()


@pytest.mark.parametrize("count", [2, 4])
def test_rdma_nodes_get_their_own_resolved_gid_hca_and_devices(count: int) -> None:
    rec = (
        two_run()
        if count == 2
        else run(config(4, serve={"maxModelLen": 1_000_000, "kvCacheMemoryBytes": 4_100_000_000}))
    )
    for i in range(count):
        c = container(rec, f"spark-{i}")
        envs = c.inputs["envs"]
        env = dict(e.split("=", 1) for e in (envs["value"] if isinstance(envs, dict) else envs))
        assert env["NCCL_IB_GID_INDEX"] == str(GIDS[f"spark-{i}"]), "each node's own preflight-resolved GID"
        assert env["NCCL_IB_HCA"] == "rocep1s0f1" and env["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1"
        assert c.inputs["gpus"] == "all"
        assert c.inputs["devices"] == [{"hostPath": "/dev/infiniband", "containerPath": "/dev/infiniband"}]


def two_run() -> recording.Recorded:
    return run(config(2))


def test_every_remote_command_checks_the_nodes_pinned_host_key(two: recording.Recorded) -> None:
    commands = two.of_type(COMMAND)
    assert commands
    by_host = {f"10.0.0.{i + 1}": fake_host_key(f"10.0.0.{i + 1}", 22).line() for i in range(2)}
    for c in commands:
        assert "connection" in c.secret_paths(), f"{c.name}: the connection (with the key) must stay secret"
        conn = c.inputs["connection"]["value"]
        assert conn.get("hostKey") == by_host[conn["host"]], (
            f"{c.name}: without hostKey the command provider talks to whatever answers at {conn['host']}"
        )


def test_docker_providers_keep_their_key_in_the_stack_directory_removed_last_on_destroy(
    two: recording.Recorded,
) -> None:
    (keys,) = two.of_type("pulumi-python:dynamic/keys:StackKeys")
    directory = keys.inputs["directory"]
    assert directory.endswith("/dsv41-exl3/keys/dsv41-exl3-dev")
    for p in two.of_type("pulumi:providers:docker"):
        assert two.depends_on(p, keys), "destroy must remove the key directory after the containers are gone"
        opts = json.loads(p.inputs["sshOpts"])
        assert Path(opts[opts.index("-i") + 1]).parent == Path(directory)
        assert f"ControlPath={directory}/" in " ".join(opts), "the master's socket must exist after a reboot too"


def test_a_changed_host_key_stops_the_program_before_any_resource(tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(f"10.0.0.2 {fake_host_key('10.0.0.9', 22).line()}\n")
    raw = config(2)
    raw["ssh"] = {**raw["ssh"], "knownHostsFile": str(known)}
    registered: list[recording.Registration] = []
    with pytest.raises(pulumi.RunError) as err:
        recording.run(lambda: deploy(parse(raw), "dev"), FIXTURES, into=registered)
    assert registered == [], "no resource (so no connection) after a refused host key"
    text = str(err.value)
    assert "host key of node spark-1 (10.0.0.2:22) changed" in text
    assert f"ssh-keygen -R '10.0.0.2' -f {known}" in text
    assert f"10.0.0.1 {fake_host_key('10.0.0.1', 22).line()}" in known.read_text(), "the new node is recorded"


def test_everything_named_on_a_node_is_per_stack_and_rank_names_are_unchanged() -> None:
    """Issue 12 item 10: two stacks on one head have their own export file, containers and watchdog files;
    the rank containers keep the names they had (a rename would replace a running deployment)."""
    raw = config()
    raw["weights"] = {"share": "nfs"}
    creates: dict[str, dict[str, str]] = {}
    for stack in ("dev", "prod"):
        rec = recording.run(lambda stack=stack: deploy(parse(raw), stack), FIXTURES, stack=stack)  # type: ignore[misc]
        commands = {c.name: c for c in rec.of_type(COMMAND)}
        prefix = f"dsv41-exl3-{stack}"
        export = commands["weights-nfs-export"]
        for action in ("create", "delete"):
            assert header_value(export.inputs[action], "EXPORTS_FILE") == f"/etc/exports.d/{prefix}.exports"
            assert "exportfs -ra" not in export.inputs[action]
        assert "exportfs -u" in export.inputs["delete"]
        assert header_value(commands["weights-stage"].inputs["create"], "CONTAINER") == f"{prefix}-stage-weights"
        check = commands["weights-visible-spark-1"].inputs["create"]
        assert header_value(check, "CONTAINER") == f"{prefix}-weights-check"
        assert f".local/share/{prefix}" in commands["watchdog-spark-0-install"].inputs["create"]
        assert f".local/state/{prefix}" in commands["watchdog-key-spark-0-keygen"].inputs["create"]
        names = sorted(c.inputs["name"] for c in rec.of_type(CONTAINER))
        assert names == sorted(
            [
                f"{prefix}-spark-0",
                f"{prefix}-spark-1",
                f"{prefix}-supervisor-spark-0",
                f"{prefix}-supervisor-spark-1",
                *sorted(f"{prefix}-{c}-{n}" for c in ("exporter", "node-exporter") for n in ("spark-0", "spark-1")),
                f"{prefix}-prometheus",
            ]
        )
        creates[stack] = {n: c.inputs["create"] for n, c in commands.items()}
    shared = [n for n in creates["dev"] if n in creates["prod"] and creates["dev"][n] == creates["prod"][n]]
    # The head's own check only stats files: it names nothing on the node.
    assert shared == ["weights-visible-spark-0"], f"the same node command for two stacks (would collide): {shared}"


def test_every_node_checks_the_full_39_and_48_manifest_before_its_rank_starts(two: recording.Recorded) -> None:
    shards = [p for p in FULL_MANIFEST if p.startswith(f"{wm.MODEL_DIR}/") and p.endswith(".safetensors")]
    assert len(shards) == wm.MODEL_SHARD_COUNT
    for node in ("spark-0", "spark-1"):
        check = two.named(f"weights-visible-{node}").inputs["create"]
        missing = [p for p in FULL_MANIFEST if p not in check]
        assert not missing, f"{node}: the visibility check skips {missing[:3]}"
        for i in wm.ENGRAM_SHARDS:
            assert wm.engram_shard_name(i) in check


def test_live_ranks_probes_the_verified_endpoint_with_the_api_key_as_a_secret(two: recording.Recorded) -> None:
    live, verifier = two.named("live-ranks"), two.named("verify")
    assert (live.inputs["endpoint"], live.inputs["model"]) == (verifier.inputs["endpoint"], verifier.inputs["model"]), (
        "the drift probe must ask the endpoint and model the verifier verified"
    )
    assert "api_key" in live.secret_paths(), "serve.apiKey reaches LiveRanks only as a secret, like the ssh key"


def test_copy_mode_mounts_each_workers_own_copy_read_only_after_its_disk_check() -> None:
    """Issue 15: each worker's rank loads its local copy; its preflight checks that worker's disk first."""
    raw = config(4)
    raw["weights"] = {"share": "copy", "copyRoot": "/nvme/{node}/dsv41"}
    rec = run(raw)
    containers = {c.name: c for c in rec.of_type(CONTAINER)}
    for node in ("spark-1", "spark-2", "spark-3"):
        copy = rec.named(f"weights-copy-{node}")
        assert copy.typ == WORKER_COPY and copy.inputs["copy_root"] == f"/nvme/{node}/dsv41"
        assert rec.depends_on(copy, rec.named("weights-stage")), "the copy reads what staging verified"
        preflight = rec.named(f"preflight-{node}-check")
        assert rec.depends_on(copy, preflight), "the disk is checked before anything is copied"
        create = preflight.inputs["create"]
        assert f" WEIGHTS_ROOT=/nvme/{node}/dsv41;" in create and " MIN_DISK=387;" in create
        rank = (
            containers[f"serving-{node}"]
            if f"serving-{node}" in containers
            else next(c for c in containers.values() if c.inputs["name"].endswith(node))
        )
        mounts = {m["target"]: m for m in rank.inputs["mounts"]}
        assert mounts[serve_spec.MODEL_MOUNT] == {
            "target": serve_spec.MODEL_MOUNT,
            "type": "bind",
            "readOnly": True,
            "source": f"/nvme/{node}/dsv41/{wm.MODEL_DIR}",
        }
        assert rec.depends_on(rank, copy), f"{node}'s rank starts only on a verified copy"
    head_preflight = rec.named("preflight-spark-0-check").inputs["create"]
    assert " CHECK_EXPORT=0;" in head_preflight, "no NFS export in copy mode"
    assert not [r for r in rec.registrations if r.name == "weights-nfs-export"]


def test_destroy_removes_the_supervisor_before_any_rank(two: recording.Recorded) -> None:
    # Pulumi deletes a resource before what it depends on: every supervisor agent waits for the verifier, so a
    # destroy ends the agents before it deletes a rank and no agent heals a rank the destroy is removing
    # (which is why a destroy needs no update lock).
    def waits_for(reg: recording.Registration) -> set[str]:
        """Every urn `reg` waits for, through any chain of dependencies."""
        seen: set[str] = set()
        todo = [reg]
        while todo:
            for other in two.registrations:
                if other.urn not in seen and two.depends_on(todo[-1], other):
                    seen.add(other.urn)
                    todo.insert(0, other)
            todo.pop()
        return seen

    agents = [c for c in two.of_type(CONTAINER) if c.name.startswith("supervisor-")]
    assert len(agents) == 2, [c.name for c in two.of_type(CONTAINER)]
    for agent in agents:
        before = waits_for(agent)
        for rank in rank_containers(two):
            assert rank.urn in before, f"{agent.name} must wait for {rank.name}"


def test_the_heads_preflight_asks_for_the_observability_layers_memory_too() -> None:
    def min_mem(rec: recording.Recorded, node: str) -> str:
        return header_value(rec.named(f"preflight-{node}-check").inputs["create"], "MIN_MEM")

    observed = run(config())
    # 111.5 GiB for the rank, plus the layer's bounds on the head (100 MiB), which start after the load.
    assert min_mem(observed, "spark-0") == f"{111.5 + 100 / 1024:g}"
    assert min_mem(observed, "spark-1") == "111.5", "the workers run no Prometheus"
    off = run(config(observability={"enabled": False}))
    assert min_mem(off, "spark-0") == "111.5"


def test_each_ranks_start_and_the_supervisors_restart_check_the_preflights_floor() -> None:
    # The preflight ran before staging; each rank's entrypoint checks MemAvailable again just before vLLM, against
    # preflight.minMemAvailableGiB (the key alone on every node: a rank's spec must not depend on the observability
    # layer), and a supervisor restart waits for the preflight's own per-node figure first.
    from tests.supervisor.test_supervisor import stdin_of

    rec = run(config())
    with stdin_of(rec, "supervisor-spark-0-files") as tar:
        agent_cfg = json.loads(tar.extractfile("config.json").read())  # type: ignore[union-attr]
    waits = {n["name"]: n["min_mem_gib"] for n in agent_cfg["leader"]["nodes"]}
    for node in ("spark-0", "spark-1"):
        preflight = header_value(rec.named(f"preflight-{node}-check").inputs["create"], "MIN_MEM")
        entry = rec.named(f"serving-{node}").inputs["entrypoints"][2]
        assert header_value(entry, "MIN_MEM_GIB") == "111.5", f"{node}: the rank's start checks another floor"
        assert header_value(entry, "NODE") == node
        assert f"{waits[node]:g}" == preflight, f"{node}: a supervisor restart waits for another floor"
    assert float(header_value(rec.named("serving-spark-0").inputs["entrypoints"][2], "MIN_MEM_KIB")) == (
        111.5 * 1024 * 1024
    ), "the floor in KiB"
