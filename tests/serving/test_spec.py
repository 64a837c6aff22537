"""The rendered vLLM command, RoCE/NCCL environment and cluster generation."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from components import labels
from components.config import Settings, parse
from components.gates.log_patterns import fatal_of
from components.serving import spec as serve_spec
from tests.support.configs import two_sparks


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
    s = settings(serve={"apiKey": "sk-secret-0123456789abcdef012345"})
    for rank in (0, 1):
        assert not any(
            "sk-secret-0123456789abcdef012345" in a or a == "--api-key" for a in serve_spec.rank_command(s, rank)
        )


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


def test_the_config_generation_holds_no_key_and_no_hash_of_it() -> None:
    """The generation is a label and a metric label: a hash of the key there is an offline check for a weak key.
    A new key replaces every rank through the key file's command instead (test_serving)."""
    key = "sk-rotate-0123456789abcdef-01234"
    s = settings(serve={"apiKey": key})
    a = serve_spec.cluster_generation(s)
    assert a == serve_spec.cluster_generation(settings(serve={"apiKey": "sk-rotate-other-0123456789abcdef"}))
    assert a == serve_spec.cluster_generation(settings()), "a generated key is a key too"
    assert a != serve_spec.cluster_generation(settings(serve={"apiKey": "none"})), (
        "whether the endpoint has a key is agreed on: it changes what the head serves"
    )
    digest = hashlib.sha256(key.encode()).hexdigest()
    rendered = json.dumps(
        [serve_spec.rank_command(s, r) for r in (0, 1)]
        + [labels.container_labels("dev", a, a, 0), serve_spec.node_env(s, s.head, 3)]
        + [serve_spec.container_entrypoint(s, n, key_file=serve_spec.KEY_FILE) for n in s.nodes]
    )
    assert key not in rendered and digest[:16] not in rendered and digest[:16] != a


def test_per_node_values_win_over_extra_env_even_past_validation() -> None:
    # components/config refuses these names; the renderer does not rely on it.
    s = settings()
    s = s.model_copy(
        update={
            "serve": s.serve.model_copy(
                update={
                    "extra_env": {"NCCL_IB_GID_INDEX": "0", "VLLM_HOST_IP": "10.9.9.9", "NCCL_SOCKET_IFNAME": "eth9"}
                }
            )
        }
    )
    env = serve_spec.node_env(s, s.workers[0], 3)
    assert env["NCCL_IB_GID_INDEX"] == "3" and env["VLLM_HOST_IP"] == "192.168.100.2"
    assert env["NCCL_SOCKET_IFNAME"] == "enp1s0f0np0"


def test_runtime_generation_changes_when_any_node_resolves_differently() -> None:
    base = serve_spec.runtime_generation("g", [("sha256:a", 3), ("sha256:b", 3)])
    assert serve_spec.runtime_generation("g", [("sha256:a", 3), ("sha256:b", 3)]) == base
    assert serve_spec.runtime_generation("g", [("sha256:a", 3), ("sha256:b", 4)]) != base
    assert serve_spec.runtime_generation("h", [("sha256:a", 3), ("sha256:b", 3)]) != base


# --- issue 10: the launcher's settings ------------------------------------------------------------

LAUNCHER_VALUES = {
    "DSV41_CACHE_GIB": "0",
    "DSV41_RESIDENT_SCALES": "0",
    "NNODES": "2",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "EXL3_FAT_GROUPED": "1",
    "EXL3_TEMP_ROWS_FUSED": "16",
    "DSV41_INDEXER_PREFILL_FACTOR": "1",
    "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "256",
    "FLASHINFER_DISABLE_VERSION_CHECK": "1",
}


def test_launcher_env_is_on_every_rank_with_the_launchers_values() -> None:
    s = settings()
    for node, gid in ((s.head, 3), (s.workers[0], None)):
        env = serve_spec.node_env(s, node, gid)
        for key, value in LAUNCHER_VALUES.items():
            assert env.get(key) == value, f"{key} on {node.name}"
        assert env["DSV41_SOURCE"] == serve_spec.ENGRAM_MOUNT
        assert env["TRITON_CACHE_DIR"].startswith(serve_spec.CACHE_VOLUMES["triton"] + "/")
        assert env["TILELANG_CACHE_DIR"].startswith(serve_spec.CACHE_VOLUMES["tilelang"] + "/")


def test_engram_and_allocator_settings_come_from_config() -> None:
    s = settings(
        serve={
            "engramCacheGiB": 2.5,
            "engramResidentScales": True,
            "exl3TempRowsFused": 32,
            "pytorchCudaAllocConf": "expandable_segments:False",
        }
    )
    env = serve_spec.node_env(s, s.head, 3)
    assert env["DSV41_CACHE_GIB"] == "2.5" and env["DSV41_RESIDENT_SCALES"] == "1"
    assert env["EXL3_TEMP_ROWS_FUSED"] == "32" and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


def test_nnodes_is_the_node_count() -> None:
    raw = two_sparks()
    raw["nodes"] += [
        {"name": f"spark-{i}", "host": f"10.0.0.{i}", "user": "me", "fabricIp": f"192.168.100.{i}"} for i in (3, 4)
    ]
    s = parse(raw).settings
    assert {serve_spec.node_env(s, n, None)["NNODES"] for n in s.nodes} == {"4"}


def test_long_prefill_threshold_is_derived_from_the_batch_size() -> None:
    assert flag(serve_spec.rank_command(settings(), 0), "--long-prefill-token-threshold") == "1280"
    argv = serve_spec.rank_command(settings(serve={"maxNumBatchedTokens": 2048}), 1)
    assert flag(argv, "--long-prefill-token-threshold") == "1792"
    argv = serve_spec.rank_command(settings(serve={"longPrefillTokenThreshold": 1024}), 0)
    assert flag(argv, "--long-prefill-token-threshold") == "1024"


def test_tool_choice_and_chat_template_are_passed_like_the_launcher() -> None:
    for rank in (0, 1):
        argv = serve_spec.rank_command(settings(), rank)
        assert "--enable-auto-tool-choice" in argv and flag(argv, "--tool-call-parser") == "deepseek_v41"
        assert flag(argv, "--chat-template") == "/opt/dsv41/chat_template.jinja"
    argv = serve_spec.rank_command(settings(serve={"enableAutoToolChoice": False, "chatTemplate": ""}), 0)
    assert "--enable-auto-tool-choice" not in argv and "--chat-template" not in argv


def test_engine_ready_timeout_outlasts_the_gates_that_wait_for_it() -> None:
    s = settings()
    value = int(serve_spec.node_env(s, s.head, 3)["VLLM_ENGINE_READY_TIMEOUT_S"])
    assert value > s.gates.rendezvous_timeout_seconds + s.gates.ready_timeout_seconds
    s = settings(gates={"readyTimeoutSeconds": 3600, "rendezvousTimeoutSeconds": 900})
    assert int(serve_spec.node_env(s, s.workers[0], None)["VLLM_ENGINE_READY_TIMEOUT_S"]) > 3600 + 900


def test_generation_changes_with_the_rendered_launcher_env() -> None:
    base = serve_spec.cluster_generation(settings())
    assert serve_spec.cluster_generation(settings(serve={"engramCacheGiB": 1})) != base
    assert serve_spec.cluster_generation(settings(serve={"longPrefillTokenThreshold": 1024})) != base


GIB_KIB = 1024 * 1024


def fake_meminfo(path: Path, *, available_kib: int, total_kib: int = 124_781_000) -> Path:
    """A /proc/meminfo as a GB10 Spark's kernel writes it (the fields around the two the check reads included)."""
    path.write_text(
        f"MemTotal:       {total_kib} kB\n"
        "MemFree:         1981236 kB\n"
        f"MemAvailable:   {available_kib} kB\n"
        "Buffers:           12345 kB\n"
        "Cached:        105000000 kB\n"
        "SwapTotal:             0 kB\n"
    )
    return path


def fake_vllm(tmp_path: Path, also: str = "") -> Path:
    """A `vllm` on PATH that says it ran, with its oom score and argv (and runs `also` first)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "vllm"
    fake.write_text(f'#!/bin/sh\n{also}\necho "oom=$(cat /proc/self/oom_score_adj) pid=$$ args=$*"\n')
    fake.chmod(0o755)
    return bindir


def start(
    tmp_path: Path,
    s: Settings,
    node_index: int,
    meminfo: Path,
    *,
    shell: str = "/bin/sh",
    entry: list[str] | None = None,
    vllm: str = "",
) -> subprocess.CompletedProcess[str]:
    """The rank's container start: its entrypoint with its command, /proc/meminfo replaced by `meminfo`."""
    entry = entry or serve_spec.container_entrypoint(s, s.nodes[node_index])
    return subprocess.run(
        [shell, *entry[1:], *serve_spec.rank_command(s, node_index)],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
        env={
            "PATH": f"{fake_vllm(tmp_path, vllm)}:{os.environ['PATH']}",
            "DSV41_MEMINFO": str(meminfo),
        },
    )


def test_container_entrypoint_sets_oom_score_adj_then_execs_vllm_with_the_command(tmp_path: Path) -> None:
    s = settings()
    entry = serve_spec.container_entrypoint(s, s.workers[0])
    assert entry[:2] == ["/bin/sh", "-c"] and entry[-1] == "vllm"
    assert 'exec vllm "$@"' in entry[2]
    done = start(tmp_path, s, 1, fake_meminfo(tmp_path / "meminfo", available_kib=118 * GIB_KIB))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("oom=1000 ")
    assert done.stdout.strip().endswith("args=" + " ".join(serve_spec.rank_command(s, 1)))
    assert "dsv41-exl3: node spark-worker: MemAvailable 118.00 GiB of 119.00 GiB, floor 111.5 GiB: starting vLLM" in (
        done.stderr
    ), "the start says the figures it passed"


def test_container_entrypoint_refuses_to_start_vllm_when_the_score_cannot_be_set(tmp_path: Path) -> None:
    s = settings()
    entry = serve_spec.container_entrypoint(s, s.head)
    # Same script against a path that cannot be written: it must stop, not run vLLM unprotected.
    script = entry[2].replace("/proc/self/oom_score_adj", str(tmp_path / "missing" / "oom_score_adj"))
    done = start(
        tmp_path,
        s,
        0,
        fake_meminfo(tmp_path / "meminfo", available_kib=118 * GIB_KIB),
        entry=[*entry[:2], script, entry[3]],
    )
    assert done.returncode == 1 and "refusing to start vLLM" in done.stderr
    assert "oom=" not in done.stdout


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_a_rank_below_its_nodes_floor_is_not_started_and_the_line_gives_the_nodes_figures(
    tmp_path: Path, shell: str
) -> None:
    # Page cache the GB10 driver does not reclaim, or another process: 80 GiB left where the preflight asked 111.5.
    s = settings()
    meminfo = fake_meminfo(tmp_path / "meminfo", available_kib=80 * GIB_KIB + GIB_KIB // 8)
    done = start(tmp_path, s, 1, meminfo, shell=shell)
    assert done.returncode == 1
    assert done.stdout == "", "vLLM must not have been started"
    line = done.stderr.strip()
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (
        "dsv41-exl3: rank not started on node spark-worker: MemAvailable 80.12 GiB (MemTotal 119.00 GiB) is below the "
        "floor of 111.5 GiB (preflight.minMemAvailableGiB 111.5); fix: free memory on spark-worker" in line
    ), line
    assert "sync; echo 3 | sudo tee /proc/sys/vm/drop_caches" in line
    assert "or lower preflight.minMemAvailableGiB" in line
    fatal = fatal_of(line)
    assert fatal is not None and fatal.name == "memory before start", "the gates must fail the boot on this line"


def test_the_ranks_floor_is_the_key_alone_so_the_observability_layer_never_touches_a_rank(tmp_path: Path) -> None:
    # The preflight adds the layer's ~0.1 GiB on the head; a rank's container spec must not depend on the layer:
    # turning it off replaced the head alone (its entrypoint changed, the generation did not) and broke the group.
    on, off = settings(), settings(observability={"enabled": False})
    assert on.observing and not off.observing
    for node in on.nodes:
        assert serve_spec.container_entrypoint(on, node) == serve_spec.container_entrypoint(off, node)
    meminfo = fake_meminfo(tmp_path / "meminfo", available_kib=int(111.5 * GIB_KIB) + 50 * 1024)
    assert start(tmp_path, on, 0, meminfo).returncode == 0 and start(tmp_path, on, 1, meminfo).returncode == 0
    below = start(tmp_path, on, 0, fake_meminfo(tmp_path / "below", available_kib=int(111.5 * GIB_KIB) - 1))
    assert "below the floor of 111.5 GiB (preflight.minMemAvailableGiB 111.5)" in below.stderr, below.stderr


def test_the_floor_is_inclusive_to_the_kib(tmp_path: Path) -> None:
    s = settings(preflight={"minMemAvailableGiB": 2})
    at = start(tmp_path, s, 1, fake_meminfo(tmp_path / "at", available_kib=2 * GIB_KIB))
    below = start(tmp_path, s, 1, fake_meminfo(tmp_path / "below", available_kib=2 * GIB_KIB - 1))
    assert at.returncode == 0, at.stderr
    assert below.returncode == 1 and "MemAvailable 1.99 GiB" in below.stderr, below.stderr


def test_the_simulated_clusters_floor_passes_on_a_small_machine(tmp_path: Path) -> None:
    # The simulated cluster sets preflight.minMemAvailableGiB to 1: a 4 GiB CI runner starts its ranks.
    s = settings(preflight={"minMemAvailableGiB": 1})
    meminfo = fake_meminfo(tmp_path / "meminfo", available_kib=2 * GIB_KIB, total_kib=4 * GIB_KIB)
    for rank in (0, 1):
        assert start(tmp_path, s, rank, meminfo).returncode == 0


@pytest.mark.parametrize(
    "text",
    ["", "MemTotal: 124781000 kB\nMemFree: 1000 kB\n", "MemAvailable: lots kB\n"],
    ids=["empty", "no MemAvailable (kernel < 3.14)", "not a number"],
)
def test_a_meminfo_without_a_readable_memavailable_refuses_naming_the_file(tmp_path: Path, text: str) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(text)
    s = settings()
    done = start(tmp_path, s, 0, meminfo)
    assert done.returncode == 1 and done.stdout == ""
    assert f"rank not started on node spark-head: cannot read MemAvailable from {meminfo}" in done.stderr
    missing = start(tmp_path, s, 0, tmp_path / "absent")
    assert missing.returncode == 1 and "cannot read MemAvailable" in missing.stderr
    fatal = fatal_of(done.stderr.strip())
    assert fatal is not None and fatal.name == "memory before start"


def test_image_specific_names_left_empty_leave_their_flags_out() -> None:
    # Another image's vLLM (the sim's for CPUs) may not know the recipe image's quantization, tokenizer mode or
    # parsers: empty leaves the flag out, so vLLM's default applies; the recipe's values are the defaults.
    recipe = serve_spec.rank_command(settings(), 0)
    for name in ("--quantization", "--tokenizer-mode", "--tool-call-parser", "--reasoning-parser"):
        assert flag(recipe, name) == ("exl3" if name == "--quantization" else "deepseek_v41")
    other = serve_spec.rank_command(
        settings(serve={"quantization": "", "tokenizerMode": "", "reasoningParser": "", "toolCallParser": "hermes"}), 0
    )
    assert not {"--quantization", "--tokenizer-mode", "--reasoning-parser"} & set(other)
    assert flag(other, "--tool-call-parser") == "hermes"


def test_the_container_shape_keeps_the_generation() -> None:
    # Stacks deployed with a container setting (the sim's memlockBytes) must keep their generation across a
    # program upgrade; the preflight stops old ranks of another shape instead (tests/preflight).
    base = serve_spec.cluster_generation(settings())
    assert serve_spec.cluster_generation(settings(container={"ipcMode": "private"})) == base
    assert serve_spec.cluster_generation(settings(container={"memlockBytes": 65536})) == base


# The recipe's argv exactly, in order: a rank's command is a container input, so rendering the same settings in
# another order would replace every running rank on the program's next upgrade (a 20-25 minute outage).
RECIPE_MODEL_FLAGS = [
    *("--quantization", "exl3", "--kv-cache-memory-bytes", "2684354560", "--block-size", "64"),
    *("--max-model-len", "600000", "--max-num-seqs", "2", "--max-num-batched-tokens", "1536"),
    *("--long-prefill-token-threshold", "1280", "--gpu-memory-utilization", "0.88"),
    *("--tokenizer-mode", "deepseek_v41", "--tool-call-parser", "deepseek_v41", "--reasoning-parser", "deepseek_v41"),
    *("--enable-auto-tool-choice", "--chat-template", "/opt/dsv41/chat_template.jinja"),
    *("--enable-prefix-caching", "--no-enable-flashinfer-autotune"),
    *("--hf-overrides", '{"engram_table_dir": "/engram-src"}', "--language-model-only"),
    *("--override-generation-config", '{"temperature": 1.0, "top_p": 0.95}'),
    *("--served-model-name", "DeepSeek-v4.1-Flash-EXL3", "--port", "8888"),
    *("--cudagraph-capture-sizes", "1", "2", "3", "4", "6", "8", "12", "18", "24"),
    *("--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}'),
]
RANK_FLAGS = [
    *("--distributed-executor-backend", "mp", "--tensor-parallel-size", "2", "--nnodes", "2"),
    *("--node-rank", "{rank}", "--master-addr", "192.168.100.1", "--master-port", "29521"),
]


def test_the_recipe_argv_is_rendered_exactly_and_in_order() -> None:
    s = settings()
    for rank in (0, 1):
        rank_flags = [f.format(rank=rank) for f in RANK_FLAGS] + (["--headless"] if rank else [])
        assert serve_spec.rank_command(s, rank) == ["serve", "/model", *RECIPE_MODEL_FLAGS, *rank_flags]


def test_switched_off_settings_leave_their_flags_out_and_keep_the_order() -> None:
    off = {"enforceEager": True, "quantization": "", "chatTemplate": "", "enableAutoToolChoice": False}
    flags = serve_spec.model_flags(settings(serve=off))
    dropped = {"--quantization", "exl3", "--chat-template", "/opt/dsv41/chat_template.jinja"}
    dropped |= {"--enable-auto-tool-choice", "--cudagraph-capture-sizes", "--speculative-config"}
    kept = [f for f in RECIPE_MODEL_FLAGS[: RECIPE_MODEL_FLAGS.index("--cudagraph-capture-sizes")] if f not in dropped]
    assert flags == [*kept, "--enforce-eager"]


def test_the_head_exports_the_api_key_from_its_file_and_refuses_to_start_without_it(tmp_path: Path) -> None:
    """The key reaches vLLM's own environment from the mounted file, never through the container's configured env
    (`docker inspect` shows that). A missing or empty file stops the head with a line the gates fail on at once."""
    s = settings()
    key_file = tmp_path / "api-key"
    entry = serve_spec.container_entrypoint(s, s.head, key_file=str(key_file))
    meminfo = fake_meminfo(tmp_path / "meminfo", available_kib=118 * GIB_KIB)
    key_file.write_text("sk-from-the-file-0123456789abcde\n")
    done = start(tmp_path, s, 0, meminfo, entry=entry, vllm='echo "key=$VLLM_API_KEY"')
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("key=sk-from-the-file-0123456789abcde\n"), done.stdout
    assert "sk-from-the-file-0123456789abcde" not in " ".join(entry), (
        "the key is read at start, not rendered into the entrypoint"
    )
    for broken in ("missing", "empty"):
        if broken == "missing":
            key_file.unlink()
        else:
            key_file.write_text("")
        refused = start(tmp_path, s, 0, meminfo, entry=entry, vllm='echo "key=$VLLM_API_KEY"')
        assert refused.returncode == 1 and refused.stdout == "", (broken, refused.stdout)
        fatal = fatal_of(refused.stderr.strip().splitlines()[-1])
        assert fatal is not None and fatal.name == "api key file", (broken, refused.stderr)
    # A worker, or an open endpoint, has no key file: nothing is exported.
    worker = start(tmp_path, s, 1, meminfo, vllm='echo "key=${VLLM_API_KEY-unset}"')
    assert worker.stdout.startswith("key=unset\n"), worker.stdout
