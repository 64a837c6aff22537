"""ServingCluster under the recording mock: one spec per rank, ordering, mounts, secrets."""

from __future__ import annotations

import json
from typing import Any

import pulumi_docker as docker
from pulumi_command import remote

from components.config import Settings, parse
from components.labels import CONFIG_LABEL, GENERATION_LABEL, RANK_LABEL, STACK_LABEL
from components.serving import spec as serve_spec
from components.serving.serving import RankInputs, ServingCluster, ServingClusterArgs
from tests.support import recording
from tests.support.configs import two_sparks
from tests.support.scripts import header_value

CONTAINER = "docker:index/container:Container"


def nodes(count: int) -> dict[str, Any]:
    raw = two_sparks()
    raw["nodes"] = [
        {"name": f"spark-{i}", "host": f"127.0.0.{i + 2}", "user": "me", "fabricIp": f"192.168.100.{i + 1}"}
        for i in range(count)
    ]
    return raw


def build(s: Settings, *, gid: Any = 3) -> dict[str, Any]:
    ranks = []
    for n in s.nodes:
        provider = docker.Provider(f"p-{n.name}", host=f"ssh://{n.user}@{n.host}")
        ranks.append(
            RankInputs(
                node=n,
                provider=provider,
                image_id=f"sha256:{n.name}",
                gid_index=gid,
                model_source="/w/model" if n is s.head else "vol-model",
                engram_source="/w/engram-src",
                mount_type="bind",
            )
        )
    cluster = ServingCluster(
        "serving",
        ServingClusterArgs(
            settings=s,
            stack="dev",
            generation="g1",
            ranks=ranks,
            replace_when="live-1",
            head_connection=remote.ConnectionArgs(host=s.head.host, user=s.head.user),
            state_dir=".local/state/dsv41-exl3-dev",
            api_key=None if s.open_endpoint or s.serve.api_key is None else s.serve.api_key.get_secret_value(),
        ),
    )
    return {"ids": cluster.container_ids, "generation": cluster.generation}


def run(raw: dict[str, Any], **kw: Any) -> recording.Recorded:
    s = parse(raw).settings
    return recording.run(lambda: build(s, **kw), {"command:remote:Command": key_command})


def key_command(args: Any) -> dict[str, Any]:
    """The key file command as a node answers it: the file's path on stdout."""
    return {"stdout": "/home/me/.local/state/dsv41-exl3-dev/api-key\n", **key_command_ids(args)}


def test_every_worker_container_precedes_the_head_and_never_the_reverse() -> None:
    rec = run(nodes(4))
    head = rec.named("serving-spark-0")
    workers = [rec.named(f"serving-spark-{i}") for i in (1, 2, 3)]
    for w in workers:
        assert w.urn in head.dependencies, "the head must be created after every worker (rendezvous order)"
        assert head.urn not in w.dependencies, "a worker must never wait for the head"
        for other in workers:
            assert other.urn not in w.dependencies, "workers start independently of each other"


def test_one_container_per_node_parented_to_the_cluster_with_fixed_names() -> None:
    rec = run(nodes(2))
    containers = rec.of_type(CONTAINER)
    assert len(containers) == 2
    cluster = rec.of_type("dsv41-exl3:serving:ServingCluster")[0]
    for c in containers:
        assert c.parent == cluster.urn
    assert {c.inputs["name"] for c in containers} == {"dsv41-exl3-dev-spark-0", "dsv41-exl3-dev-spark-1"}


def test_container_is_deleted_before_its_replacement_is_created() -> None:
    for c in run(nodes(2)).of_type(CONTAINER):
        assert c.delete_before_replace, "128 GB unified memory: the old rank must free its memory first"


def test_weights_are_mounted_read_only_and_caches_are_volumes() -> None:
    for c in run(nodes(2)).of_type(CONTAINER):
        mounts = {m["target"]: m for m in c.inputs["mounts"]}
        assert mounts["/model"]["readOnly"] is True and mounts["/engram-src"]["readOnly"] is True
        for path in serve_spec.CACHE_VOLUMES.values():
            assert mounts[path]["type"] == "volume"


def test_roce_devices_gpu_and_docker_run_shape() -> None:
    for c in run(nodes(2)).of_type(CONTAINER):
        i = c.inputs
        assert i["gpus"] == "all" and i["networkMode"] == "host" and i["ipcMode"] == "host"
        assert i["devices"] == [{"hostPath": "/dev/infiniband", "containerPath": "/dev/infiniband"}]
        assert {"name": "memlock", "soft": -1, "hard": -1} in i["ulimits"]
        assert set(i["capabilities"]["adds"]) == {"IPC_LOCK", "SYS_PTRACE"}
        assert i["restart"] == "no", "a rank restarted alone would block at rendezvous forever"


def test_a_rank_that_exits_at_once_is_kept_for_the_gates_to_read() -> None:
    for c in run(nodes(2)).of_type(CONTAINER):
        assert c.inputs.get("mustRun") is False, (
            f"{c.name}: with must_run the docker provider deletes a container that exits at once, and vLLM's "
            "own error (a bad flag) with it; kept, the rendezvous gate shows its exit code and last lines"
        )


def test_container_memlock_limit_comes_from_config() -> None:
    raw = {**nodes(2), "container": {"memlockBytes": 8_388_608}}
    for c in run(raw).of_type(CONTAINER):
        assert {"name": "memlock", "soft": 8_388_608, "hard": 8_388_608} in c.inputs["ulimits"], (
            "a host whose hard memlock limit is lower than unlimited must be able to say so in config"
        )


def test_simulated_nodes_without_gpu_or_rdma_get_neither() -> None:
    raw = nodes(2)
    for n in raw["nodes"]:
        n.update(gpus="", rdmaDevices=[], ibHcas=[])
    for c in run(raw).of_type(CONTAINER):
        assert "gpus" not in c.inputs and c.inputs.get("devices", []) == []


def test_each_rank_has_its_own_env_and_the_unresolved_gid_is_omitted() -> None:
    rec = run(nodes(2), gid=None)
    env0 = dict(e.split("=", 1) for e in rec.named("serving-spark-0").inputs["envs"])
    env1 = dict(e.split("=", 1) for e in rec.named("serving-spark-1").inputs["envs"])
    assert env0["VLLM_HOST_IP"] == "192.168.100.1" and env1["VLLM_HOST_IP"] == "192.168.100.2"
    assert "NCCL_IB_GID_INDEX" not in env0 and "NCCL_IB_GID_INDEX" not in env1


def key_command_ids(args: Any) -> dict[str, Any]:
    """The command provider's behaviour that matters here: a new id exactly when the triggers (the key) change."""
    if args.name.endswith("-api-key"):
        return {"__id": f"key-{hash(json.dumps(args.inputs['triggers'], sort_keys=True, default=str))}"}
    return {}


def test_api_key_reaches_only_the_head_through_a_file_never_env_argv_or_a_label() -> None:
    raw = nodes(2)
    raw["serve"] = {"apiKey": "sk-topsecret-0123456789abcdef012"}
    rec = run(raw)
    head, worker = rec.named("serving-spark-0"), rec.named("serving-spark-1")
    writer = rec.named("serving-spark-0-api-key")
    # On stdin, as a secret; the command text, argv and the triggers' plain text never hold it.
    assert writer.inputs["stdin"] == {**writer.inputs["stdin"], "value": "sk-topsecret-0123456789abcdef012"}
    assert {"stdin", "triggers"} <= writer.secret_paths()
    for field in ("create", "update", "delete"):
        assert "sk-topsecret-0123456789abcdef012" not in writer.inputs[field]
    assert writer.delete_before_replace, "the old file is removed before the new key is written, not after"
    # The head's env is plain again (a preview shows each change) and holds no key; nothing of a rank does.
    assert "envs" not in head.secret_paths()
    for c in (head, worker):
        assert "sk-topsecret-0123456789abcdef012" not in json.dumps(c.raw_inputs), c.name
    mounts = {m["target"]: m for m in head.inputs["mounts"]}
    assert mounts[serve_spec.KEY_FILE] == {
        "target": serve_spec.KEY_FILE,
        "source": "/home/me/.local/state/dsv41-exl3-dev/api-key",  # the path the command printed
        "type": "bind",
        "readOnly": True,
    }
    assert serve_spec.KEY_FILE not in {m["target"] for m in worker.inputs["mounts"]}
    assert writer.urn in head.dependencies, "the file is written before the head starts"
    assert "KEY_FILE=/run/dsv41-exl3/api-key" in head.inputs["entrypoints"][2].replace("'", "")
    assert "KEY_FILE=" in worker.inputs["entrypoints"][2] and "/run/dsv41-exl3" not in worker.inputs["entrypoints"][2]


def test_a_new_api_key_replaces_every_rank_and_the_same_key_none() -> None:
    """The key changes the key file command's id (its trigger), which every rank's generation label carries: a
    head replaced alone would leave a worker hanging at rendezvous."""

    def generations(key: str) -> list[str]:
        raw = nodes(2)
        raw["serve"] = {"apiKey": key}
        s = parse(raw).settings
        rec = recording.run(lambda: build(s), {"command:remote:Command": key_command})
        return [{x["label"]: x["value"] for x in c.inputs["labels"]}[GENERATION_LABEL] for c in rec.of_type(CONTAINER)]

    first, same, other = (
        generations("sk-first-key-0123-0123456789abcd"),
        generations("sk-first-key-0123-0123456789abcd"),
        generations("sk-other-0123456789abcdef0123456"),
    )
    assert first == same and len(set(first)) == 1
    assert all(a != b for a, b in zip(first, other, strict=True)), "every rank gets the new generation"


def test_an_open_endpoint_writes_no_key_file() -> None:
    raw = nodes(2)
    raw["serve"] = {"apiKey": "none"}
    rec = run(raw)
    assert not [r for r in rec.registrations if r.name.endswith("-api-key")]
    assert serve_spec.KEY_FILE not in {m["target"] for m in rec.named("serving-spark-0").inputs["mounts"]}


def test_all_ranks_carry_the_same_generation_label() -> None:
    rec = run(nodes(2))
    labels = [{x["label"]: x["value"] for x in c.inputs["labels"]} for c in rec.of_type(CONTAINER)]
    assert labels[0][GENERATION_LABEL] == labels[1][GENERATION_LABEL]
    assert labels[0][GENERATION_LABEL] == rec.outputs["generation"]
    assert {lab[RANK_LABEL] for lab in labels} == {"0", "1"}


def test_a_gid_resolved_differently_on_one_node_changes_every_ranks_generation() -> None:
    a = run(nodes(2), gid=3).outputs["generation"]
    b = run(nodes(2), gid=4).outputs["generation"]
    assert a != b


def test_container_ids_are_head_first() -> None:
    rec = run(nodes(2))
    assert rec.outputs["ids"] == ["serving-spark-0-id", "serving-spark-1-id"]


def test_providers_are_the_nodes_own() -> None:
    rec = run(nodes(2))
    for c in rec.of_type(CONTAINER):
        node = c.name.removeprefix("serving-")
        assert f"p-{node}" in c.provider, f"{c.name} must be created through its own node's docker provider"


def test_head_and_worker_containers_render_the_launchers_command_env_and_labels() -> None:
    rec = run(nodes(2))
    s = parse(nodes(2)).settings
    for rank, name in ((0, "serving-spark-0"), (1, "serving-spark-1")):
        c = rec.named(name)
        # oom_score_adj 1000 first (the kernel must take vLLM, not sshd), then the node's memory floor, then
        # `vllm serve` as the command
        assert c.inputs["entrypoints"] == serve_spec.container_entrypoint(s, s.nodes[rank])
        entry = c.inputs["entrypoints"][2]
        assert header_value(entry, "OOM_SCORE_ADJ") == "1000" and header_value(entry, "NODE") == s.nodes[rank].name
        command = c.inputs["command"]
        assert command == serve_spec.rank_command(s, rank)
        assert command[command.index("--long-prefill-token-threshold") + 1] == "1280"
        assert "--enable-auto-tool-choice" in command
        assert command[command.index("--chat-template") + 1] == "/opt/dsv41/chat_template.jinja"
        assert ("--headless" in command) == (rank == 1)
        env = dict(e.split("=", 1) for e in c.inputs["envs"])
        assert env["DSV41_CACHE_GIB"] == "0" and env["DSV41_RESIDENT_SCALES"] == "0" and env["NNODES"] == "2"
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert env["VLLM_ENGINE_READY_TIMEOUT_S"] == str(serve_spec.engine_ready_timeout_s(s))
        labels = {x["label"]: x["value"] for x in c.inputs["labels"]}
        assert labels[RANK_LABEL] == str(rank) and labels[STACK_LABEL] == "dev"
        assert labels[CONFIG_LABEL] == "g1"


def test_the_ipc_namespace_is_the_recipes_host_unless_config_says_otherwise() -> None:
    # container.ipcMode: the recipe's --ipc=host by default; the simulated nodes, which share one kernel, give each
    # rank its own (vLLM would otherwise take two "nodes" for one and wait on each other's ipc:// sockets).
    raw = nodes(2)
    raw["container"] = {"ipcMode": "private"}
    assert {c.inputs["ipcMode"] for c in run(raw).of_type(CONTAINER)} == {"private"}
    assert {c.inputs["ipcMode"] for c in run(nodes(2)).of_type(CONTAINER)} == {"host"}
