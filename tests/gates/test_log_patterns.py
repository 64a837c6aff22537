"""vLLM's log lines as the gates read them: joins, phases, readiness, and the fatal-pattern table, over real vLLM
wording (recorded real vLLM 0.32 and public logs of CUDA builds)."""

from __future__ import annotations

import pytest

from components.gates import log_patterns
from components.gates.log_patterns import FATAL_PATTERNS, fatal_of
from tests.gates.test_decisions import (
    L_ARGS_WITH_KEY,
    L_ASSIGNED_0,
    L_ASSIGNED_1,
    L_ASSIGNED_OLD,
    L_COMPLETE,
    L_DIST_STORE,
    L_GRAPH,
    L_GRAPH_DONE,
    L_HEADLESS,
    L_INIT,
    L_INIT_W,
    L_KV,
    L_KV_OLD,
    L_KV_SIZE,
    L_LEADER,
    L_LOAD,
    L_LOADED,
    L_NCCL,
    L_SERVER,
    L_SERVER_OLD,
    L_SHM,
    L_WARM,
    L_WEIGHTS_OLD,
)


class TestPatterns:
    def test_join_lines_new_and_old_wording(self) -> None:
        for line in (L_ASSIGNED_0, L_ASSIGNED_1, L_ASSIGNED_OLD, L_NCCL):
            assert log_patterns.is_join_line(line), line
        for line in (L_INIT, L_LEADER, L_HEADLESS, L_LOAD, L_SHM):
            assert not log_patterns.is_join_line(line), line

    def test_reached_lines_are_the_pre_rendezvous_ones(self) -> None:
        for line in (L_INIT, L_INIT_W, L_LEADER, L_HEADLESS):
            assert log_patterns.is_reached_line(line), line
        assert not log_patterns.is_reached_line(L_LOAD)

    def test_rank_numbers_and_master_address_are_read_from_lines(self) -> None:
        assert log_patterns.assigned_rank(L_ASSIGNED_1) == (1, 2)
        assert log_patterns.assigned_rank(L_ASSIGNED_OLD) == (1, 2)
        assert log_patterns.assigned_rank(L_NCCL) is None
        assert log_patterns.init_method_address(L_INIT) == "10.0.0.1:29521"

    def test_dist_store_error_is_a_rendezvous_failure(self) -> None:
        assert log_patterns.is_rendezvous_failure(L_DIST_STORE)
        assert log_patterns.is_rendezvous_failure("[W] 1/2 clients joined")
        assert not log_patterns.is_rendezvous_failure(L_ASSIGNED_0)

    def test_ready_lines(self) -> None:
        assert log_patterns.is_ready_line(L_COMPLETE)
        assert log_patterns.is_ready_line(L_SERVER_OLD)
        assert not log_patterns.is_ready_line(L_SERVER)  # 0.33's line comes before uvicorn is up
        assert not log_patterns.is_ready_line(L_WARM)

    @pytest.mark.parametrize(
        ("line", "phase"),
        [
            (L_INIT, "rendezvous"),
            (L_LEADER, "rendezvous"),
            (L_ASSIGNED_0, "rendezvous"),
            (L_NCCL, "rendezvous"),
            (L_LOAD, "loading weights"),
            (L_LOADED, "loading weights"),
            (L_WEIGHTS_OLD, "loading weights"),
            (L_KV, "KV cache"),
            (L_KV_SIZE, "KV cache"),
            (L_KV_OLD, "KV cache"),
            (L_GRAPH, "graph capture"),
            (L_GRAPH_DONE, "graph capture"),
            (L_WARM, "warm-up"),
            (L_SERVER, "API starting"),
            (L_SERVER_OLD, "API starting"),
            (L_COMPLETE, "ready"),
            (L_SHM, None),
            (L_ARGS_WITH_KEY, None),
        ],
    )
    def test_phase_of(self, line: str, phase: str | None) -> None:
        assert log_patterns.phase_of(line) == phase

    def test_shm_broadcast_lines_are_noise(self) -> None:
        assert log_patterns.is_noise(L_SHM)
        assert not log_patterns.is_noise(L_LOAD)


# vLLM's own wording of each fatal line (v1/core/kv_cache_utils.py, v1/worker/utils.py, torch, NCCL), with the
# prefixes a rank adds; one per table entry.
FATAL_LINES = {
    # Not vLLM's: the head's entrypoint when its key file is gone (rank_entry.sh).
    "api key file": (
        "components/serving/rank_entry.sh: dsv41-exl3: rank not started on node spark-a: the API key file "
        "/run/dsv41-exl3/api-key is not readable; fix: run pulumi up again (it rewrites the key file on the head)"
    ),
    # Not vLLM's: the rank's entrypoint (components/serving/rank_entry.sh), as dash prints it under `sh -c`.
    "memory before start": (
        "components/serving/rank_entry.sh: dsv41-exl3: rank not started on node spark-a: MemAvailable 80.12 GiB "
        "(MemTotal 119.00 GiB) is below the floor of 111.598 GiB (preflight.minMemAvailableGiB 111.5 + 100 MiB for "
        "the observability layer on the head); fix: free memory on spark-a (ps aux --sort=-rss | head; docker ps), "
        "drop its page cache (sync; echo 3 | sudo tee /proc/sys/vm/drop_caches), or lower "
        "preflight.minMemAvailableGiB"
    ),
    "rendezvous": L_DIST_STORE,
    "KV cache too small": (
        "(EngineCore_DP0 pid=180) ValueError: To serve at least one request with the model's max seq len (1048576), "
        "7.89 GiB KV cache is needed, which is larger than the available KV cache memory (4.0 GiB). Based on the "
        "available memory, the estimated maximum model length is 530432."
    ),
    "memory taken at startup": (
        "(EngineCore_DP0 pid=17635) ValueError: Free memory on device cuda:0 (15.32/119.70 GiB) on startup is less "
        "than desired GPU memory utilization (0.88, 105.34 GiB). Decrease GPU memory utilization or reduce GPU memory "
        "used by other processes."
    ),
    "out of memory": "(Worker_TP0 pid=211) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    "engine start failed": (
        "(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause "
        "above. Failed core proc(s): {}"
    ),
    "NCCL": "(Worker_TP1 pid=88) RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO)",
    # What an owner's every rank died with, its Engram config.json not staged (issue 34).
    "Engram tables": "FileNotFoundError: [Errno 2] No such file or directory: '/engram-src/config.json'",
}

# The other Engram load failures, as the simulated cluster's stand-in raises them (sim/standin/vllm_standin.py).
ENGRAM_LOAD_ERRORS = [
    "FileNotFoundError: [Errno 2] No such file or directory: '/engram-src/model-00001-of-00048.safetensors'",
    "ValueError: Engram table index /engram-src/model.safetensors.index.json lists 1 tensor(s) that are not "
    "Engram embed tables (model.layers.46.weight); engram_table_dir must hold an index of *.engram.embed.weight "
    "/ *.engram.embed.scale only",
    "KeyError: Engram table 'model.layers.1.engram.embed.scale' is not in /engram-src/model-00047-of-00048.safetensors",
]


class TestFatalPatterns:
    def test_every_table_entry_has_a_line_of_vllm_wording(self) -> None:
        assert sorted(FATAL_LINES) == sorted(f.name for f in FATAL_PATTERNS)

    @pytest.mark.parametrize("name", sorted(FATAL_LINES))
    def test_each_line_is_read_as_its_entry(self, name: str) -> None:
        fatal = fatal_of(FATAL_LINES[name])
        assert fatal is not None and fatal.name == name
        assert fatal.cause and fatal.advice

    @pytest.mark.parametrize(
        "line",
        [
            L_KV,
            L_KV_SIZE,
            L_KV_OLD,
            L_NCCL,
            L_ASSIGNED_0,
            L_LOAD,
            L_COMPLETE,
            L_SHM,
            "(Worker_TP0 pid=211) INFO 12-02 10:39:00 [gpu_worker.py:400] Available KV cache memory: 4.0 GiB",
            "spark-a:211:211 [0] NCCL INFO NET/IB : Using [0]rocep1s0f1:1/RoCE [RO]; OOB enp1s0f1np1:10.0.0.1<0>",
            '(APIServer pid=1) INFO: 127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 OK',
            "(Worker_TP0 pid=7) INFO 12-02 10:39:00 [engram.py:214] Loaded Engram table shard "
            "model-00047-of-00048.safetensors from /engram-src",
            "(APIServer pid=1) INFO 12-02 10:38:00 [api_utils.py:286] non-default args: {'hf_overrides': "
            "{'engram_table_dir': '/engram-src'}, 'disable_log_errors': False}",
            "dsv41-exl3: node spark-a: MemAvailable 118.00 GiB of 119.00 GiB, floor 111.5 GiB: starting vLLM",
        ],
    )
    def test_healthy_lines_are_not_fatal(self, line: str) -> None:
        assert fatal_of(line) is None

    @pytest.mark.parametrize("line", ENGRAM_LOAD_ERRORS)
    def test_every_engram_load_error_fails_at_once_naming_the_slim_directory(self, line: str) -> None:
        fatal = fatal_of(line)
        assert fatal is not None and fatal.name == "Engram tables" and fatal.at_once
        assert "engram-vllm" in fatal.advice and "--replace" in fatal.advice

    def test_only_nccl_and_the_heads_pointer_wait_for_the_exit(self) -> None:
        # NCCL prints errors it recovers from; "Engine core initialization failed" points at a cause another line
        # names; every other entry is only ever printed as a raised exception.
        assert sorted(f.name for f in FATAL_PATTERNS if not f.at_once) == ["NCCL", "engine start failed"]

    def test_advice_templates_fill_in(self) -> None:
        for fatal in FATAL_PATTERNS:
            text = fatal.advice.format(nodes="spark-b", where="master 10.0.0.1:29501")
            assert "{" not in text, fatal.name
