"""The rendered vLLM command, RoCE/NCCL environment and cluster generation."""

from __future__ import annotations

import json
from typing import Any

from components import serve_spec
from components.config import Settings, parse
from tests.test_config import two_sparks


def settings(**overrides: Any) -> Settings:
    return parse(two_sparks(**overrides)).settings


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_head_and_worker_get_mp_multinode_flags_and_only_workers_are_headless() -> None:
    s = settings()
    head, worker = serve_spec.rank_command(s, 0), serve_spec.rank_command(s, 1)
    for rank, argv in ((0, head), (1, worker)):
        assert argv[:2] == ["serve", "/model"]
        assert flag(argv, "--distributed-executor-backend") == "mp"
        assert flag(argv, "--tensor-parallel-size") == "2" and flag(argv, "--nnodes") == "2"
        assert flag(argv, "--node-rank") == str(rank)
        assert flag(argv, "--master-addr") == "192.168.100.1"
        assert flag(argv, "--master-port") == "29521"
    assert "--headless" not in head and "--headless" in worker


def test_recipe_serve_flags_come_from_config() -> None:
    argv = serve_spec.rank_command(settings(serve={"maxNumSeqs": 1, "maxModelLen": 400000}), 0)
    assert flag(argv, "--quantization") == "exl3"
    assert flag(argv, "--kv-cache-memory-bytes") == "2684354560"
    assert flag(argv, "--max-model-len") == "400000"
    assert flag(argv, "--max-num-seqs") == "1"
    assert flag(argv, "--max-num-batched-tokens") == "1536"
    assert flag(argv, "--gpu-memory-utilization") == "0.88"
    assert flag(argv, "--served-model-name") == "DeepSeek-v4.1-Flash-EXL3"
    assert flag(argv, "--port") == "8888"
    assert json.loads(flag(argv, "--speculative-config")) == {"method": "dspark", "num_speculative_tokens": 3}
    assert json.loads(flag(argv, "--override-generation-config")) == {"temperature": 1.0, "top_p": 0.95}
    assert json.loads(flag(argv, "--hf-overrides")) == {"engram_table_dir": "/engram-src"}
    assert "--enforce-eager" not in argv and "--kv-cache-dtype" not in argv


def test_enforce_eager_drops_cuda_graphs_and_speculation() -> None:
    argv = serve_spec.rank_command(settings(serve={"enforceEager": True}), 0)
    assert "--enforce-eager" in argv
    assert "--cudagraph-capture-sizes" not in argv and "--speculative-config" not in argv


def test_extra_args_are_appended() -> None:
    argv = serve_spec.rank_command(settings(serve={"extraArgs": ["--safetensors-load-strategy", "eager"]}), 1)
    assert flag(argv, "--safetensors-load-strategy") == "eager"


def test_api_key_never_rendered_into_argv() -> None:
    s = settings(serve={"apiKey": "sk-secret"})
    for rank in (0, 1):
        assert not any("sk-secret" in a or a == "--api-key" for a in serve_spec.rank_command(s, rank))


def test_per_node_env_uses_each_nodes_fabric_and_omits_unresolved_gid() -> None:
    s = settings()
    head = serve_spec.node_env(s, s.head, gid_index=3)
    worker = serve_spec.node_env(s, s.workers[0], gid_index=None)
    assert head["VLLM_HOST_IP"] == "192.168.100.1" and worker["VLLM_HOST_IP"] == "192.168.100.2"
    assert head["NCCL_SOCKET_IFNAME"] == head["GLOO_SOCKET_IFNAME"] == "enp1s0f1np1"
    assert worker["NCCL_SOCKET_IFNAME"] == "enp1s0f0np0" and worker["NCCL_IB_HCA"] == "rocep1s0f0"
    assert head["NCCL_IB_GID_INDEX"] == "3"
    # Empty is not unset: NCCL_IB_GID_INDEX= parses as 0 and hangs NCCL.
    assert "NCCL_IB_GID_INDEX" not in worker
    assert all(v != "" for v in worker.values())
    assert head["NCCL_PROTO"] == "^LL128" and head["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] == "1"


def test_no_hcas_means_no_nccl_ib_hca_variable() -> None:
    raw = two_sparks()
    raw["nodes"][1]["ibHcas"] = []
    s = parse(raw).settings
    assert "NCCL_IB_HCA" not in serve_spec.node_env(s, s.workers[0], None)


def test_extra_env_overrides_and_an_empty_value_removes() -> None:
    s = settings(serve={"extraEnv": {"NCCL_DEBUG": "INFO", "NCCL_NET_PLUGIN": ""}})
    env = serve_spec.node_env(s, s.head, 3)
    assert env["NCCL_DEBUG"] == "INFO" and "NCCL_NET_PLUGIN" not in env


def test_generation_changes_with_anything_ranks_agree_on_and_not_otherwise() -> None:
    base = serve_spec.cluster_generation(settings())
    assert serve_spec.cluster_generation(settings()) == base
    assert serve_spec.cluster_generation(settings(serve={"maxNumSeqs": 1})) != base
    assert serve_spec.cluster_generation(settings(image="other:tag")) != base
    raw = two_sparks()
    raw["nodes"][1]["fabricIp"] = "192.168.100.9"
    assert serve_spec.cluster_generation(parse(raw).settings) != base
    # Gate timing is not something the ranks agree on.
    assert serve_spec.cluster_generation(settings(gates={"stallSeconds": 30})) == base


def test_rotating_the_api_key_is_a_new_generation_but_the_label_does_not_reveal_it() -> None:
    a = serve_spec.cluster_generation(settings(serve={"apiKey": "one"}))
    b = serve_spec.cluster_generation(settings(serve={"apiKey": "two"}))
    assert a != b, "a head replaced alone leaves the worker hanging at rendezvous"
    assert "one" not in a and len(a) == 16


def test_runtime_generation_changes_when_any_node_resolves_differently() -> None:
    base = serve_spec.runtime_generation("g", [("sha256:a", 3), ("sha256:b", 3)])
    assert serve_spec.runtime_generation("g", [("sha256:a", 3), ("sha256:b", 3)]) == base
    assert serve_spec.runtime_generation("g", [("sha256:a", 3), ("sha256:b", 4)]) != base
    assert serve_spec.runtime_generation("h", [("sha256:a", 3), ("sha256:b", 3)]) != base
