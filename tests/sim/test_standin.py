"""The simulated cluster's vLLM stand-in, run as real local processes on 127.0.0.1.

Each cluster is started with exactly what the program renders (`serve_spec.rank_command` and
`serve_spec.node_env`, only the /model and /engram-src mount points and the image's chat template
path swapped for a temp dir), and
judged with the program's own gates (`rank_watch`) and verifier (`verify`), so the stand-in is
held to what the deployment actually checks.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from components.config import Settings, parse
from components.gates import decisions, log_patterns, observations
from components.gates.decisions import ModelsEndpoint, ReadySettings, RendezvousSettings
from components.gates.log_patterns import PHASES
from components.gates.observations import (
    ContainerState,
    ContainerUsage,
    GateFailure,
    LogLine,
    RankSpec,
    SourceError,
    SystemClock,
)
from components.serving import spec as serve_spec
from components.verify.client import DecodeMeasurement, Passed, measure_decode, probe_endpoint, verify_endpoint
from components.verify.verdict import DECODE_PROBE_PROMPTS, VERIFY_PROMPT, Failed, Reason
from components.weights import manifest as wm
from sim import checkpoint as checkpoint_data
from tests.support.bounds import bounds

REPO = Path(__file__).resolve().parents[2]
STANDIN_DIR = REPO / "sim" / "standin"
ENTRYPOINT = STANDIN_DIR / "vllm"
API_KEY = "sk-sim-standin-0123456789-012345"
LOOPBACK = "127.0.0.1"
WORKER_IP = "127.0.0.2"  # the worker's "fabric IP": also loopback, so VLLM_HOST_IP binds for real
LOAD_SECONDS = "0.4"
IMAGE_CHAT_TEMPLATE = "/opt/dsv41/chat_template.jinja"
VLLM_LINE = re.compile(
    r"^(?:\((?:APIServer|EngineCore(?:_DP\d+)?|Worker(?:_TP\d+)?|MainProcess) pid=\d+\) )?"
    r"(?:(?:INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] "
    r"|INFO:     |Loading safetensors|Capturing CUDA)"
)


def _load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_standin", STANDIN_DIR / "vllm_standin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_standin"] = module
    spec.loader.exec_module(module)
    return module


standin = _load_module()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# A tiny checkpoint in the layout components/weights/manifest.py stages


ENGRAM_TABLES = {
    47: ["model.layers.1.engram.embed.weight", "model.layers.1.engram.embed.scale"],
    48: ["model.layers.14.engram.embed.weight", "model.layers.14.engram.embed.scale"],
}


def engram_shard(i: int, tables: Sequence[str], salt: str = "") -> bytes:
    """Base shard 47 or 48 in the safetensors layout: its layer tensor, then its Engram embed tables."""
    return checkpoint_data.safetensors_tensors(
        {f"model.layers.{i - 1}.weight": f"layer {i}{salt}".encode(), **{t: f"{t}{salt}".encode() for t in tables}},
        {"format": "pt"},
    )


def write_checkpoint(root: Path, salt: str = "") -> Path:
    """/model, the base repo's Engram files as staged (engram-src/) and the slim directory the ranks mount at
    /engram-src (engram-vllm/: hardlinks of shards 47/48 and config.json, an index of the embed tables only)."""
    model, engram, slim = root / "model", root / "engram-src", root / wm.ENGRAM_VLLM_DIR
    model.mkdir(parents=True)
    engram.mkdir()
    slim.mkdir()
    weight_map = {}
    for i in range(1, 40):
        name = f"model-{i:05d}-of-00039.safetensors"
        (model / name).write_bytes(f"exl3 shard {i}{salt}".encode())
        weight_map[f"model.layers.{i - 1}.weight"] = name
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "max_position_embeddings": 1048576}))
    engram_map = {f"model.layers.{i - 1}.weight": f"model-{i:05d}-of-00048.safetensors" for i in range(1, 49)}
    embed = {t: f"model-{i:05d}-of-00048.safetensors" for i, tables in ENGRAM_TABLES.items() for t in tables}
    (engram / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**engram_map, **embed}}))
    (engram / "config.json").write_text('{"model_type": "deepseek_v4"}')
    for i, tables in ENGRAM_TABLES.items():
        (engram / f"model-{i:05d}-of-00048.safetensors").write_bytes(engram_shard(i, tables, salt))
    for name in ["config.json", *{*embed.values()}]:
        os.link(engram / name, slim / name)
    (slim / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": embed}))
    # what the image carries at /opt/dsv41/chat_template.jinja
    (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("weights"))


# ---------------------------------------------------------------------------------------------
# Ranks as local processes, observed the way the gates observe containers


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen[bytes]
    lines: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # arrival of each line (monotonic)

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.times.append(time.monotonic())
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if regex.search(line):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"rank {self.rank} logged no line matching {pattern!r} in {timeout_s} s:\n{self.text()}")

    def wait_exit(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=2)
        return code


class LocalRanks:
    """observations.RankPoller over local processes: their merged stdout/stderr and liveness."""

    def __init__(self, ranks: Sequence[RankProcess]) -> None:
        self.ranks = {r.rank: r for r in ranks}
        self.read_upto = dict.fromkeys(self.ranks, 0)

    def new_lines(self, rank: int) -> list[LogLine]:
        fresh = self.ranks[rank].lines[self.read_upto[rank] :]
        self.read_upto[rank] += len(fresh)
        return [LogLine(text=t) for t in fresh]

    def state(self, rank: int) -> ContainerState:
        code = self.ranks[rank].proc.poll()
        if code is not None:  # as docker's: an exited container's log is complete
            self.ranks[rank]._reader.join(timeout=2)
        return ContainerState("running" if code is None else "exited", code, "2026-01-01T00:00:00Z")

    def usage(self, rank: int) -> ContainerUsage:
        raise SourceError("local processes have no container counters")  # the stall rule is the log's alone


@dataclass
class Cluster:
    settings: Settings
    ranks: list[RankProcess]

    @property
    def head(self) -> RankProcess:
        return self.ranks[0]

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.settings.serve.port}/v1"

    @property
    def model(self) -> str:
        return self.settings.serve.served_model_name

    @property
    def api_key(self) -> str | None:
        key = self.settings.serve.api_key
        return key.get_secret_value() if key else None

    def specs(self) -> list[RankSpec]:
        return [
            RankSpec(rank=r.rank, node=f"node{r.rank}", host=LOOPBACK, user="sim", container=f"rank{r.rank}")
            for r in self.ranks
        ]

    def source(self) -> observations.PollingRankSource:
        return observations.PollingRankSource(LocalRanks(self.ranks), [r.rank for r in self.ranks], SystemClock())


def cluster_settings(
    *,
    extra_env: Mapping[str, str] | None = None,
    api_key: str | None = None,
    serve: Mapping[str, Any] | None = None,
) -> Settings:
    ips = [LOOPBACK, WORKER_IP]
    raw: dict[str, Any] = {
        "nodes": [{"name": f"spark-{i}", "host": ip, "user": "sim", "fabricIp": ip} for i, ip in enumerate(ips)],
        "ssh": {"agentSocket": "/nonexistent/agent.sock"},  # required by the config; never used here
        "serve": {
            "port": free_port(),
            "masterPort": free_port(),
            "extraArgs": ["--host", LOOPBACK],  # the real default binds every interface
            "extraEnv": {"SIM_LOAD_SECONDS": LOAD_SECONDS, "SIM_GRAPH_SECONDS": "0.2", **(extra_env or {})},
            **({"apiKey": api_key} if api_key else {}),
            **(serve or {}),
        },
    }
    return parse(raw).settings


def mounted(argv: list[str], checkpoint: Path) -> list[str]:
    """The rendered command with the container's mount points (and the image's chat template) replaced
    by the temp checkpoint."""
    out = [str(checkpoint / "model") if a == serve_spec.MODEL_MOUNT else a for a in argv]
    out = [str(checkpoint / "chat_template.jinja") if a == IMAGE_CHAT_TEMPLATE else a for a in out]
    return [a.replace(serve_spec.ENGRAM_MOUNT, str(checkpoint / wm.ENGRAM_VLLM_DIR)) for a in out]


def as_single_node(argv: list[str]) -> list[str]:
    """The head's command for a one-node deployment (the program's config insists on two: weights)."""
    out = list(argv)
    for flag in ("--tensor-parallel-size", "--nnodes"):
        out[out.index(flag) + 1] = "1"
    return out


def start_rank(argv: Sequence[str], env: Mapping[str, str], rank: int = 0) -> RankProcess:
    proc = subprocess.Popen(
        [str(ENTRYPOINT), *argv],
        env={"PATH": os.environ["PATH"], **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return RankProcess(rank, proc)


def stop(ranks: Sequence[RankProcess]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.kill()
    for r in ranks:
        r.proc.wait(timeout=10)
        if r.proc.stdout is not None:
            r.proc.stdout.close()


@pytest.fixture
def launch(checkpoint: Path) -> Iterator[Callable[..., Cluster]]:
    """Start a cluster as the program would; every process is killed when the test ends."""
    started: list[RankProcess] = []

    def _launch(
        settings: Settings,
        *,
        weights: Path | None = None,
        ranks: Sequence[int] | None = None,
        single_node: bool = False,
    ) -> Cluster:
        procs = []
        for rank in [0] if single_node else ranks if ranks is not None else range(len(settings.nodes)):
            env = serve_spec.node_env(settings, settings.nodes[rank], 3)
            if rank == 0 and settings.serve.api_key:
                env["VLLM_API_KEY"] = settings.serve.api_key.get_secret_value()
            argv = mounted(serve_spec.rank_command(settings, rank), weights or checkpoint)
            if single_node:
                argv = as_single_node(argv)
            procs.append(start_rank(argv, env, rank))
            started.append(procs[-1])
        return Cluster(settings, procs)

    yield _launch
    stop(started)


def run_gates(
    cluster: Cluster, *, ready_timeout_s: float = 20.0, stall_s: float = 10.0
) -> tuple[decisions.RendezvousResult, decisions.ReadyResult]:
    # each gate reads the logs from the container's start, as the program's gates do
    clock = SystemClock()
    joined = decisions.wait_for_rendezvous(
        cluster.specs(),
        cluster.source(),
        RendezvousSettings(bounds=bounds(rendezvous_timeout_s=20), poll_interval_s=0.05),
        clock,
        lambda _: None,
    )
    probe = ModelsEndpoint(cluster.endpoint, cluster.model, cluster.api_key, timeout_s=2)
    ready = decisions.wait_for_ready(
        cluster.specs(),
        cluster.source(),
        ReadySettings(bounds=bounds(ready_timeout_s=ready_timeout_s, stall_s=stall_s), poll_interval_s=0.05),
        clock,
        lambda _: None,
        probe,
        cluster.model,
    )
    return joined, ready


def post(
    cluster: Cluster,
    body: Mapping[str, Any],
    *,
    key: str | None = None,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    timeout_s: float = 10.0,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, cluster.settings.serve.port, timeout=timeout_s)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, body=json.dumps(body).encode() if method == "POST" else None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}], **extra}


def refused(port: int) -> bool:
    try:
        socket.create_connection((LOOPBACK, port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


# ---------------------------------------------------------------------------------------------
# A healthy two-rank cluster with an API key, shared by the tests that only read from it


@dataclass
class Healthy:
    cluster: Cluster
    joined: decisions.RendezvousResult
    ready: decisions.ReadyResult


@pytest.fixture(scope="module")
def healthy(checkpoint: Path) -> Iterator[Healthy]:
    settings = cluster_settings(api_key=API_KEY, extra_env={"SIM_DECODE_TOKENS_PER_SECOND": "40"})
    procs = []
    try:
        for rank in (1, 0):  # the worker first: it must wait (connection refused) for the master
            env = serve_spec.node_env(settings, settings.nodes[rank], 3)
            if rank == 0:
                env["VLLM_API_KEY"] = API_KEY
            procs.append(start_rank(mounted(serve_spec.rank_command(settings, rank), checkpoint), env, rank))
            time.sleep(0.3)
        cluster = Cluster(settings, sorted(procs, key=lambda r: r.rank))
        joined, ready = run_gates(cluster)
        yield Healthy(cluster, joined, ready)
    finally:
        stop(procs)


class TestHealthyCluster:
    def test_gates_see_both_ranks_join_and_every_boot_phase_in_order(self, healthy: Healthy) -> None:
        assert healthy.joined.world_size == 2 and sorted(healthy.joined.joined_at) == [0, 1]
        assert set(healthy.ready.phases) == set(PHASES)
        stamps = [healthy.ready.phases[p] for p in PHASES]
        assert stamps == sorted(stamps), f"phases out of order: {healthy.ready.phases}"

    def test_log_lines_carry_vllm_prefixes_and_the_rendezvous_address(self, healthy: Healthy) -> None:
        c = healthy.cluster
        for r in c.ranks:
            lines = list(r.lines)
            bad = [ln for ln in lines if not VLLM_LINE.match(ln)]
            assert not bad, f"rank {r.rank} lines not in vLLM's format: {bad[:3]}"
            assert any(log_patterns.assigned_rank(ln) == (r.rank, 2) for ln in lines)
            addresses = {log_patterns.init_method_address(ln) for ln in lines} - {None}
            assert addresses == {f"{LOOPBACK}:{c.settings.serve.master_port}"}
        worker = c.ranks[1].text()
        assert "headless multiproc executor, with head node address 127.0.0.1" in worker
        assert not any(log_patterns.is_ready_line(ln) for ln in c.ranks[1].lines), "a headless worker serves no API"
        head = c.head.text()
        order = [
            "world_size=2 rank=0",
            "is assigned as",
            "vLLM is using nccl==",
            "Starting to load model",
            "Loading weights took",
            "Model loading took",
            "Available KV cache memory: 2.50 GiB",
            "GPU KV cache size: 1,310,720 tokens, Maximum concurrency for 600,000 tokens per request: 2.18x",
            "Capturing CUDA graphs",
            "Graph capturing finished",
            "init engine (profile",
            "Starting vLLM server on http://127.0.0.1:",
            "Application startup complete.",
        ]
        positions = [head.find(s) for s in order]
        assert -1 not in positions and positions == sorted(positions), dict(zip(order, positions, strict=True))

    def test_api_key_never_reaches_the_logs(self, healthy: Healthy) -> None:
        for r in healthy.cluster.ranks:
            assert API_KEY not in r.text()
        # a key given on the command line is masked in vLLM's args line too
        shown = standin.args_line(standin.parse_serve_args(["/model", "--api-key", API_KEY, "--port", "1"]))
        assert API_KEY not in shown and "'api_key': '***'" in shown and "'port': 1" in shown

    def test_recipe_request_verifies_paris_with_real_logprobs(self, healthy: Healthy) -> None:
        c = healthy.cluster
        outcome = verify_endpoint(c.endpoint, c.model, API_KEY, timeout_s=10)
        assert isinstance(outcome, Passed), outcome
        assert outcome.answer == "Paris"
        assert outcome.logprobs[0].token == "Paris"
        assert all(math.isfinite(t.logprob) and -9999.0 < t.logprob <= 0 for t in outcome.logprobs)

    def test_streamed_recipe_request_verifies_too(self, healthy: Healthy) -> None:
        c = healthy.cluster
        outcome = verify_endpoint(c.endpoint, c.model, API_KEY, timeout_s=10, stream=True)
        assert isinstance(outcome, Passed), outcome
        assert outcome.answer == "Paris"

    def test_logprobs_are_a_log_softmax_with_clamped_masked_tokens(self, healthy: Healthy) -> None:
        status, body = post(
            healthy.cluster,
            chat(
                "Describe the river in the morning.",
                max_tokens=6,
                temperature=0,
                logprobs=True,
                top_logprobs=20,
            ),
            key=API_KEY,
        )
        assert status == 200, body
        answer = json.loads(body)
        items = answer["choices"][0]["logprobs"]["content"]
        assert len(items) == 6 and answer["usage"]["completion_tokens"] == 6
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["choices"][0]["message"]["content"] == "".join(i["token"] for i in items)
        for item in items:
            top = item["top_logprobs"]
            assert len(top) == 20 and top[0]["token"] == item["token"] and top[0]["logprob"] == item["logprob"]
            real = [t["logprob"] for t in top if t["logprob"] > -9999.0]
            assert any(t["logprob"] == -9999.0 for t in top), "masked (-inf) tokens are reported as -9999.0"
            # every token with a real probability is listed, so they sum to 1: a true log-softmax
            assert math.isclose(sum(math.exp(lp) for lp in real), 1.0, rel_tol=1e-9)
            assert item["logprob"] == max(real), "greedy (temperature 0) picks the most likely token"
            assert item["bytes"] == list(item["token"].encode())

    def test_greedy_decoding_is_deterministic(self, healthy: Healthy) -> None:
        request = chat("Summarize the history of the city.", max_tokens=5, temperature=0, logprobs=True)
        first, second = (post(healthy.cluster, request, key=API_KEY) for _ in range(2))
        assert first[0] == second[0] == 200
        assert json.loads(first[1])["choices"][0]["logprobs"] == json.loads(second[1])["choices"][0]["logprobs"]

    def test_api_key_is_required_on_v1_routes_but_not_on_health(self, healthy: Healthy) -> None:
        c = healthy.cluster
        for key in (None, "wrong-key"):
            status, body = post(c, chat(VERIFY_PROMPT), key=key)
            assert status == 401 and json.loads(body)["error"]["message"] == "Unauthorized"
            assert post(c, {}, key=key, path="/v1/models", method="GET")[0] == 401
        assert post(c, {}, path="/health", method="GET") == (200, b"")
        outcome = verify_endpoint(c.endpoint, c.model, None, timeout_s=10)
        assert isinstance(outcome, Failed) and outcome.reason is Reason.UNAUTHORIZED

    def test_unknown_model_is_vllms_404_and_the_verifier_names_it(self, healthy: Healthy) -> None:
        c = healthy.cluster
        status, body = post(c, chat(VERIFY_PROMPT, model="nope"), key=API_KEY)
        assert status == 404
        assert json.loads(body) == {
            "error": {
                "message": "The model `nope` does not exist. Valid aliases: DeepSeek-v4.1-Flash-EXL3.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
        outcome = verify_endpoint(c.endpoint, "nope", API_KEY, timeout_s=10)
        assert isinstance(outcome, Failed) and outcome.reason is Reason.UNKNOWN_MODEL
        assert c.model in outcome.message

    def test_models_and_version_answer_like_vllm(self, healthy: Healthy) -> None:
        c = healthy.cluster
        status, body = post(c, {}, key=API_KEY, path="/v1/models", method="GET")
        models = json.loads(body)
        assert status == 200 and models["object"] == "list"
        assert [(m["id"], m["max_model_len"], m["owned_by"]) for m in models["data"]] == [(c.model, 600000, "vllm")]
        status, body = post(c, {}, path="/version", method="GET")
        assert status == 200 and json.loads(body) == {"version": "0.33.0"}

    def test_metrics_count_generated_tokens(self, healthy: Healthy) -> None:
        def generated() -> float:
            status, body = post(healthy.cluster, {}, path="/metrics", method="GET")
            assert status == 200
            lines = body.decode().splitlines()
            line = next(ln for ln in lines if ln.startswith("vllm:generation_tokens_total{"))
            return float(line.rsplit(" ", 1)[1])

        before = generated()
        assert post(healthy.cluster, chat("Tell me about the sun.", max_tokens=3), key=API_KEY)[0] == 200
        assert generated() == before + 3

    def test_bad_requests_get_vllms_400(self, healthy: Healthy) -> None:
        c = healthy.cluster
        status, body = post(c, chat(VERIFY_PROMPT, top_logprobs=21, logprobs=True), key=API_KEY)
        assert status == 400 and "greater than max allowed: 20" in json.loads(body)["error"]["message"]
        status, body = post(c, chat(VERIFY_PROMPT, top_logprobs=2), key=API_KEY)
        assert status == 400 and "`logprobs` must be set to true" in json.loads(body)["error"]["message"]
        status, body = post(c, chat(VERIFY_PROMPT, max_tokens=700000), key=API_KEY)
        assert (
            status == 400
            and "max_tokens=700000 cannot be greater than max_model_len=600000" in json.loads(body)["error"]["message"]
        )
        status, body = post(c, chat(VERIFY_PROMPT, max_tokens=599999), key=API_KEY)
        assert status == 400 and "maximum context length is 600000" in json.loads(body)["error"]["message"]

    def test_decode_rate_matches_the_configured_40_tokens_per_second(self, healthy: Healthy) -> None:
        c = healthy.cluster
        measured = measure_decode(
            c.endpoint, c.model, API_KEY, timeout_s=10, prompts=DECODE_PROBE_PROMPTS[:3], max_tokens=32
        )
        assert isinstance(measured, DecodeMeasurement), measured
        assert measured.median_tokens_per_second == pytest.approx(40, rel=0.10), measured

    def test_non_streamed_answers_take_the_decode_time(self, healthy: Healthy) -> None:
        started = time.monotonic()
        status, body = post(healthy.cluster, chat("Write about bread and flour.", max_tokens=20), key=API_KEY)
        elapsed = time.monotonic() - started
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 20
        assert 19 / 40 <= elapsed < 19 / 40 + 1.0


# ---------------------------------------------------------------------------------------------
# Decode pacing at another rate, and weights that decide the numbers


def test_decode_rate_matches_the_configured_20_tokens_per_second(launch: Callable[..., Cluster]) -> None:
    cluster = launch(cluster_settings(extra_env={"SIM_DECODE_TOKENS_PER_SECOND": "20"}))
    run_gates(cluster)
    measured = measure_decode(
        cluster.endpoint, cluster.model, None, timeout_s=10, prompts=DECODE_PROBE_PROMPTS[:3], max_tokens=32
    )
    assert isinstance(measured, DecodeMeasurement), measured
    assert measured.median_tokens_per_second == pytest.approx(20, rel=0.10), measured


def test_logprobs_come_from_the_weight_files(launch: Callable[..., Cluster], tmp_path: Path) -> None:
    other = write_checkpoint(tmp_path / "other", salt=" retrained")
    request = chat("Explain the blue sky.", max_tokens=4, temperature=0, logprobs=True)
    answers = []
    for weights in (None, other):
        cluster = launch(
            cluster_settings(extra_env={"SIM_DECODE_TOKENS_PER_SECOND": "200"}),
            weights=weights,
            single_node=True,
        )
        run_gates(cluster)
        status, body = post(cluster, request)
        assert status == 200, body
        answers.append([i["logprob"] for i in json.loads(body)["choices"][0]["logprobs"]["content"]])
    assert answers[0] != answers[1]


# ---------------------------------------------------------------------------------------------
# Faults the program must diagnose


def test_nan_logits_answer_400_unstreamed_and_null_streamed(launch: Callable[..., Cluster]) -> None:
    cluster = launch(cluster_settings(extra_env={"SIM_FAULT": "nan-logits", "SIM_DECODE_TOKENS_PER_SECOND": "100"}))
    run_gates(cluster)
    status, body = post(cluster, chat(VERIFY_PROMPT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=1))
    assert status == 400
    assert json.loads(body) == {
        "error": {
            "message": "Out of range float values are not JSON compliant",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    outcome = verify_endpoint(cluster.endpoint, cluster.model, timeout_s=10)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.NAN and "HTTP 400" in outcome.message
    streamed = verify_endpoint(cluster.endpoint, cluster.model, timeout_s=10, stream=True)
    assert isinstance(streamed, Failed) and streamed.reason is Reason.NAN and "null" in streamed.message


def test_nan_on_a_worker_alone_poisons_the_heads_answers(checkpoint: Path) -> None:
    settings = cluster_settings(extra_env={"SIM_DECODE_TOKENS_PER_SECOND": "100"})
    head_env = serve_spec.node_env(settings, settings.nodes[0], 3)
    worker_env = {**serve_spec.node_env(settings, settings.nodes[1], 3), "SIM_FAULT": "nan-logits"}
    ranks = [
        start_rank(mounted(serve_spec.rank_command(settings, r), checkpoint), env, r)
        for r, env in ((0, head_env), (1, worker_env))
    ]
    try:
        cluster = Cluster(settings, ranks)
        run_gates(cluster)
        outcome = verify_endpoint(cluster.endpoint, cluster.model, timeout_s=10)
        assert isinstance(outcome, Failed) and outcome.reason is Reason.NAN, outcome
    finally:
        stop(ranks)


def test_a_dead_worker_leaves_health_200_then_fails_the_next_request_and_the_head_exits_0(
    launch: Callable[..., Cluster],
) -> None:
    # As real vLLM 0.32 did (tests/support/fixtures/real-vllm/killed-worker): the idle head says nothing and
    # /health stays 200; the next request fails at once with the EngineCore 500; the head then exits 0.
    cluster = launch(cluster_settings(extra_env={"SIM_FAULT": "worker-exit-after-load"}))
    head, worker = cluster.ranks
    assert worker.wait_exit(15) == 1
    assert "WorkerProc hit an exception" in worker.text() and "Loading weights took" in worker.text()
    head.wait_for_line(r"Application startup complete", 15)
    time.sleep(0.5)
    quiet = len(head.lines)
    assert post(cluster, {}, path="/health", method="GET") == (200, b"")
    assert [ln for ln in head.lines[quiet:] if "GET /health" not in ln] == [], "an idle head notices nothing"
    started = time.monotonic()
    outcome = verify_endpoint(cluster.endpoint, cluster.model, timeout_s=10)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.DEAD_RANK, outcome
    assert time.monotonic() - started < 3, "the request fails at once, not at a timeout"
    assert head.wait_exit(10) == 0
    assert "WorkerProc hit an exception." in head.text()
    assert "RuntimeError: Worker failed with error" in head.text() and "Connection closed by peer" in head.text()


def test_a_worker_alive_but_not_answering_times_the_step_out(launch: Callable[..., Cluster]) -> None:
    # A rank that hangs (not dead: its connection stays open) is what VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS is for.
    cluster = launch(cluster_settings(extra_env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "2"}))
    head, worker = cluster.ranks
    head.wait_for_line(r"Application startup complete", 15)
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        outcome = verify_endpoint(cluster.endpoint, cluster.model, timeout_s=1.0)
        assert isinstance(outcome, Failed) and outcome.reason is Reason.HUNG_RANK, outcome
        assert head.wait_exit(10) == 1
        assert "TimeoutError: RPC call to sample_tokens timed out." in head.text()
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)


def test_a_worker_stopped_by_sigterm_exits_0_and_one_loading_ignores_it(launch: Callable[..., Cluster]) -> None:
    # Real vLLM 0.32 (fixtures/real-vllm/stopped-worker): a headless worker stopped by SIGTERM exits 0; while
    # it loads it does not run the handler, so docker's stop ends in SIGKILL (137).
    cluster = launch(cluster_settings(extra_env={"SIM_LOAD_SECONDS": "3"}))
    head, worker = cluster.ranks
    worker.wait_for_line(r"Starting to load model", 10)
    worker.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert worker.proc.poll() is None, "a loading worker does not stop on SIGTERM"
    head.wait_for_line(r"Application startup complete", 20)
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit(10) == 0


def test_a_worker_whose_head_died_stays_alive_and_silent(launch: Callable[..., Cluster]) -> None:
    # Real vLLM 0.32 (fixtures/real-vllm/killed-head): the worker neither exits nor prints.
    cluster = launch(cluster_settings())
    head, worker = cluster.ranks
    head.wait_for_line(r"Application startup complete", 15)
    before = len(worker.lines)
    head.proc.kill()
    head.wait_exit(5)
    time.sleep(2)
    assert worker.proc.poll() is None and worker.lines[before:] == []


def test_rank_that_never_joins_fails_the_rendezvous_with_dist_store_error(
    launch: Callable[..., Cluster],
) -> None:
    cluster = launch(cluster_settings(extra_env={"SIM_FAULT": "rank-never-joins", "SIM_RENDEZVOUS_TIMEOUT_S": "1.5"}))
    head, worker = cluster.ranks
    started = time.monotonic()
    with pytest.raises(GateFailure) as failure:
        decisions.wait_for_rendezvous(
            cluster.specs(),
            cluster.source(),
            RendezvousSettings(bounds=bounds(rendezvous_timeout_s=15), poll_interval_s=0.05),
            SystemClock(),
            lambda _: None,
        )
    assert "DistStoreError: Timed out after 2 seconds waiting for clients. 1/2 clients joined." in str(failure.value)
    assert head.wait_exit(5) == 1 and time.monotonic() - started < 6
    assert worker.proc.poll() is None, "the rank that never joins stays alive"
    assert any(log_patterns.is_reached_line(ln) for ln in worker.lines)
    assert not any(log_patterns.is_join_line(ln) for ln in worker.lines)


def test_stall_after_load_logs_no_ready_line_and_never_listens(launch: Callable[..., Cluster]) -> None:
    cluster = launch(cluster_settings(extra_env={"SIM_FAULT": "stall-after-load"}))
    with pytest.raises(GateFailure) as failure:
        run_gates(cluster, ready_timeout_s=20, stall_s=1.5)
    assert "no rank logged anything new" in str(failure.value)
    assert "loading weights" in str(failure.value)
    for r in cluster.ranks:
        assert r.proc.poll() is None, f"rank {r.rank} must stay alive"
        assert "Model loading took" in r.text()
        assert "Available KV cache memory" not in r.text() and "Application startup" not in r.text()
    assert refused(cluster.settings.serve.port)


def test_api_port_refuses_connections_until_ready(launch: Callable[..., Cluster], checkpoint: Path) -> None:
    settings = cluster_settings(extra_env={"SIM_LOAD_SECONDS": "1.5"})
    cluster = launch(settings, ranks=[0])  # the worker is late: the head waits at the rendezvous
    cluster.head.wait_for_line(r"distributed_init_method=", 10)
    assert refused(settings.serve.port)
    late = start_rank(
        mounted(serve_spec.rank_command(settings, 1), checkpoint),
        serve_spec.node_env(settings, settings.nodes[1], 3),
        1,
    )
    try:
        cluster.ranks.append(late)
        cluster.head.wait_for_line(r"Starting to load model", 10)
        assert refused(settings.serve.port)
        cluster.head.wait_for_line(r"Application startup complete", 15)
        assert post(cluster, {}, path="/health", method="GET") == (200, b"")
    finally:
        stop([late])


# ---------------------------------------------------------------------------------------------
# CLI and loading failures


def run_cli(
    argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 20
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ENTRYPOINT), *argv],
        env={"PATH": os.environ["PATH"], **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def single_node_argv(checkpoint: Path, *extra: str) -> list[str]:
    settings = cluster_settings(serve={"extraArgs": ["--host", LOOPBACK, *extra]})
    return as_single_node(mounted(serve_spec.rank_command(settings, 0), checkpoint))


def test_unknown_flag_is_rejected_like_argparse(checkpoint: Path) -> None:
    done = run_cli([*single_node_argv(checkpoint), "--bogus"])
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == "vllm serve: error: unrecognized arguments: --bogus"
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        (
            "--speculative-config",
            "{not json",
            "argument --speculative-config: invalid loads value: '{not json'",
        ),
        ("--hf-overrides", "[1]", "argument --hf-overrides: invalid loads value: '[1]'"),
        (
            "--override-generation-config",
            "{'temperature': 1}",
            "argument --override-generation-config: invalid loads",
        ),
        ("--port", "eighty", "argument --port: invalid int value: 'eighty'"),
        (
            "--distributed-executor-backend",
            "slurm",
            "argument --distributed-executor-backend: invalid choice: 'slurm'",
        ),
    ],
)
def test_bad_flag_values_are_rejected_like_argparse(checkpoint: Path, flag: str, value: str, message: str) -> None:
    with pytest.raises(standin.UsageError, match=re.escape(message)):
        standin.parse_serve_args([*single_node_argv(checkpoint), flag, value])
    done = run_cli([*single_node_argv(checkpoint), f"{flag}={value}"])
    assert done.returncode == 2 and f"vllm serve: error: {message}" in done.stderr


def test_a_flag_missing_its_value_is_rejected() -> None:
    with pytest.raises(standin.UsageError, match="argument --port: expected one argument"):
        standin.parse_serve_args(["/model", "--port", "--enforce-eager"])
    with pytest.raises(standin.UsageError, match="argument --cudagraph-capture-sizes: expected at least one"):
        standin.parse_serve_args(["/model", "--cudagraph-capture-sizes", "--headless"])


@pytest.mark.parametrize("eager", [False, True])
def test_every_rendered_flag_parses_with_its_arity(eager: bool) -> None:
    settings = cluster_settings(serve={"enforceEager": eager, "extraArgs": ["--safetensors-load-strategy", "eager"]})
    for rank in (0, 1):
        argv = serve_spec.rank_command(settings, rank)
        args = standin.parse_serve_args(argv[1:])
        assert args.model == "/model" and args.node_rank == rank and args.nnodes == 2 and args.world_size == 2
        assert args.is_worker is (rank == 1) and args.enforce_eager is eager
        assert args.engram_dir == "/engram-src"
        assert args.get("--override-generation-config") == {"temperature": 1.0, "top_p": 0.95}
        if not eager:
            assert args.get("--cudagraph-capture-sizes") == [1, 2, 3, 4, 6, 8, 12, 18, 24]
            assert args.get("--speculative-config") == {"method": "dspark", "num_speculative_tokens": 3}
        assert args.switch("enable-prefix-caching") and args.switch("language-model-only")
        assert not args.switch("enable-flashinfer-autotune") and args.get("--no-enable-flashinfer-autotune")
    equals_form = standin.parse_serve_args(["/m", "--max-model-len=600k", "--served_model_name=a", "b", "-tp", "2"])
    assert equals_form.get("--max-model-len") == 600_000
    assert equals_form.served_model_names == ("a", "b") and equals_form.world_size == 2


def test_missing_model_shard_fails_loading_with_file_not_found(tmp_path: Path) -> None:
    weights = write_checkpoint(tmp_path / "w")
    (weights / "model" / "model-00007-of-00039.safetensors").unlink()
    done = run_cli(single_node_argv(weights), {"SIM_LOAD_SECONDS": "0.2"})
    missing = weights / "model" / "model-00007-of-00039.safetensors"
    assert done.returncode == 1
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'" in done.stderr
    assert "Starting to load model" in done.stdout and "Model loading took" not in done.stdout


def test_missing_engram_shard_fails_loading_with_file_not_found(tmp_path: Path) -> None:
    weights = write_checkpoint(tmp_path / "w")
    missing = weights / wm.ENGRAM_VLLM_DIR / "model-00048-of-00048.safetensors"
    missing.unlink()
    done = run_cli(single_node_argv(weights), {"SIM_LOAD_SECONDS": "0.2"})
    assert done.returncode == 1
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'" in done.stderr
    assert _fatal(done.stderr) == "Engram tables"


# --- the Engram table directory: what the ranks mount at /engram-src (issue 34) --------------------------------


def _fatal(stderr: str) -> str | None:
    """The fatal-pattern entry that fails the gates at once on a rank's output: its first line that is one."""
    found = (f for ln in stderr.splitlines() if (f := log_patterns.fatal_of(ln)) is not None and f.at_once)
    return next((f.name for f in found), None)


def _slim_index(weights: Path, weight_map: Mapping[str, str]) -> None:
    index = weights / wm.ENGRAM_VLLM_DIR / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": dict(weight_map)}))


def _fails_loading(weights: Path) -> subprocess.CompletedProcess[str]:
    done = run_cli(single_node_argv(weights), {"SIM_LOAD_SECONDS": "0.2"})
    assert done.returncode == 1, done.stdout[-2000:]
    assert "Starting to load model" in done.stdout and "Model loading took" not in done.stdout
    assert "WorkerProc failed to start." in done.stdout and "EngineCore failed to start." in done.stdout
    return done


def test_the_slim_engram_directory_loads_its_two_shards(healthy: Healthy, checkpoint: Path) -> None:
    for rank in healthy.cluster.ranks:
        loaded = re.findall(r"Loaded Engram table shard (\S+) from (\S+)", rank.text())
        assert [name for name, _ in loaded] == ["model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors"]
        assert {where for _, where in loaded} == {str(checkpoint / wm.ENGRAM_VLLM_DIR)}


def test_an_engram_dir_with_the_native_index_fails_the_boot_naming_the_engram_tables(
    launch: Callable[..., Cluster], tmp_path: Path
) -> None:
    # The base repo's own index mounted at /engram-src: 48 shards listed, 2 present. The loader opens what the
    # index names, and the first shard absent ends the boot, the way vLLM's loader "pulling the whole tree" would.
    weights = write_checkpoint(tmp_path / "w")
    native = (weights / "engram-src" / "model.safetensors.index.json").read_text()
    (weights / wm.ENGRAM_VLLM_DIR / "model.safetensors.index.json").write_text(native)
    cluster = launch(cluster_settings(), weights=weights)
    with pytest.raises(GateFailure) as failure:
        run_gates(cluster, ready_timeout_s=20, stall_s=10)
    message = str(failure.value)
    absent = weights / wm.ENGRAM_VLLM_DIR / "model-00001-of-00048.safetensors"
    assert "could not load the Engram tables from /engram-src" in message, message
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{absent}'" in message
    assert "engram-vllm" in message and "--replace" in message, "the advice names the slim directory and the fix"
    assert [r.wait_exit(5) for r in cluster.ranks] == [1, 1], "every rank loads the tables: every rank fails"


def test_an_engram_index_listing_a_tensor_that_is_not_an_embed_table_is_refused(tmp_path: Path) -> None:
    weights = write_checkpoint(tmp_path / "w")
    embed = {t: f"model-{i:05d}-of-00048.safetensors" for i, tables in ENGRAM_TABLES.items() for t in tables}
    _slim_index(weights, {**embed, "model.layers.46.weight": "model-00047-of-00048.safetensors"})
    done = _fails_loading(weights)
    assert "not Engram embed tables (model.layers.46.weight)" in done.stderr
    assert _fatal(done.stderr) == "Engram tables"


def test_an_engram_index_naming_a_shard_that_is_not_there_fails_with_file_not_found(tmp_path: Path) -> None:
    weights = write_checkpoint(tmp_path / "w")
    embed = {t: f"model-{i:05d}-of-00048.safetensors" for i, tables in ENGRAM_TABLES.items() for t in tables}
    _slim_index(weights, {**embed, "model.layers.5.engram.embed.weight": "model-00012-of-00048.safetensors"})
    done = _fails_loading(weights)
    absent = weights / wm.ENGRAM_VLLM_DIR / "model-00012-of-00048.safetensors"
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{absent}'" in done.stderr
    assert _fatal(done.stderr) == "Engram tables"


def test_an_engram_table_absent_from_its_shard_fails_loading(tmp_path: Path) -> None:
    weights = write_checkpoint(tmp_path / "w")
    embed = {t: f"model-{i:05d}-of-00048.safetensors" for i, tables in ENGRAM_TABLES.items() for t in tables}
    _slim_index(weights, {**embed, "model.layers.2.engram.embed.scale": "model-00047-of-00048.safetensors"})
    done = _fails_loading(weights)
    assert "KeyError: Engram table 'model.layers.2.engram.embed.scale' is not in" in done.stderr
    assert _fatal(done.stderr) == "Engram tables"


def test_an_engram_dir_without_config_json_fails_every_rank_at_boot(tmp_path: Path) -> None:
    # An owner's first run: staged fine, NCCL came up, then FileNotFoundError: /engram-src/config.json.
    weights = write_checkpoint(tmp_path / "w")
    (weights / wm.ENGRAM_VLLM_DIR / "config.json").unlink()
    done = _fails_loading(weights)
    missing = weights / wm.ENGRAM_VLLM_DIR / "config.json"
    assert f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'" in done.stderr
    assert _fatal(done.stderr) == "Engram tables"


def test_graph_capture_takes_the_time_it_logs(tmp_path: Path) -> None:
    rank = start_rank(
        single_node_argv(write_checkpoint(tmp_path / "w")), {"SIM_LOAD_SECONDS": "0.2", "SIM_GRAPH_SECONDS": "1.5"}
    )
    try:
        rank.wait_for_line(r"Application startup complete", 20)
        start = next(t for t, ln in zip(rank.times, rank.lines, strict=False) if "Capturing CUDA graphs" in ln)
        done = next(t for t, ln in zip(rank.times, rank.lines, strict=False) if "Graph capturing finished" in ln)
        assert done - start >= 1.4
        assert any("Graph capturing finished in 1.5 secs" in ln for ln in rank.lines)
    finally:
        stop([rank])


def test_load_progress_is_logged_at_least_every_two_seconds(tmp_path: Path) -> None:
    # stall-after-load keeps the process alive and quiet once loading is done
    rank = start_rank(
        single_node_argv(write_checkpoint(tmp_path / "w")),
        {"SIM_LOAD_SECONDS": "3", "SIM_FAULT": "stall-after-load"},
    )
    try:
        rank.wait_for_line(r"Model loading took", 10)
        first = next(i for i, ln in enumerate(rank.lines) if "Starting to load model" in ln)
        last = next(i for i, ln in enumerate(rank.lines) if "Loading weights took" in ln)
        times = rank.times[first : last + 1]
        assert times[-1] - times[0] >= 2.5
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert max(gaps) <= 2.0, gaps
        assert any(log_patterns.phase_of(ln) == "loading weights" for ln in rank.lines[first + 1 : last])
    finally:
        stop([rank])


def test_unknown_fault_name_is_a_clear_error(checkpoint: Path) -> None:
    done = run_cli(single_node_argv(checkpoint), {"SIM_FAULT": "nan"})
    assert done.returncode == 1 and "SIM_FAULT='nan' is not a known fault" in done.stderr


def test_sigterm_stops_a_serving_head_promptly(launch: Callable[..., Cluster]) -> None:
    cluster = launch(cluster_settings(), single_node=True)
    cluster.head.wait_for_line(r"Application startup complete", 15)
    started = time.monotonic()
    cluster.head.proc.send_signal(signal.SIGTERM)
    assert cluster.head.wait_exit(5) == 0  # real vLLM 0.32's head (fixtures/real-vllm/stopped-head)
    assert time.monotonic() - started < 2


# ---------------------------------------------------------------------------------------------
# Issue 10: tools, the chat template and the wrong-answer fault, as vLLM behaves

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class TestTools:
    def test_tools_without_auto_tool_choice_get_vllms_400(self, launch: Callable[..., Cluster]) -> None:
        cluster = launch(cluster_settings(serve={"enableAutoToolChoice": False}), single_node=True)
        run_gates(cluster)
        status, body = post(cluster, chat("What is the weather in Paris?", tools=[WEATHER_TOOL], max_tokens=5))
        assert status == 400
        assert json.loads(body)["error"] == {
            "message": '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        # tool_choice none ignores the tools, as vLLM does
        status, _ = post(cluster, chat("Hi", tools=[WEATHER_TOOL], tool_choice="none", max_tokens=3))
        assert status == 200

    def test_tools_with_the_rendered_flags_get_a_tool_call_in_vllms_shape(self, healthy: Healthy) -> None:
        status, body = post(healthy.cluster, chat("What is the weather in Paris?", tools=[WEATHER_TOOL]), key=API_KEY)
        assert status == 200
        choice = json.loads(body)["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    def test_streamed_tool_call_arrives_as_a_delta(self, healthy: Healthy) -> None:
        conn = http.client.HTTPConnection(LOOPBACK, healthy.cluster.settings.serve.port, timeout=10)
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
                body=json.dumps(chat("Weather in Rome?", tools=[WEATHER_TOOL], stream=True)).encode(),
            )
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c.get("choices")]
        calls = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
        assert calls and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
        assert deltas[-1]["finish_reason"] == "tool_calls" and text.rstrip().endswith("data: [DONE]")

    def test_official_openai_client_gets_a_tool_call_and_then_an_answer(self, healthy: Healthy) -> None:
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=healthy.cluster.endpoint, api_key=API_KEY, timeout=20, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(
            model=healthy.cluster.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=64
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
        ]
        second = client.chat.completions.create(
            model=healthy.cluster.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=8
        )
        assert second.choices[0].message.content and not second.choices[0].message.tool_calls
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.chat.completions.create(model="nope", messages=messages, max_tokens=2)


def test_wrong_answer_fault_is_fluent_and_finite_and_the_verifier_fails_it(launch: Callable[..., Cluster]) -> None:
    cluster = launch(cluster_settings(extra_env={"SIM_FAULT": "wrong-answer", "SIM_DECODE_TOKENS_PER_SECOND": "100"}))
    run_gates(cluster)
    status, body = post(cluster, chat(VERIFY_PROMPT, max_tokens=40, temperature=0, logprobs=True, top_logprobs=1))
    assert status == 200
    choice = json.loads(body)["choices"][0]
    assert choice["message"]["content"] == "Lyon"
    assert all(
        math.isfinite(item["logprob"]) and -9999.0 < item["logprob"] <= 0 for item in choice["logprobs"]["content"]
    )
    outcome = verify_endpoint(cluster.endpoint, cluster.model, timeout_s=10)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.WRONG_ANSWER and "'Lyon'" in outcome.message


def test_a_chat_template_that_does_not_exist_stops_the_head_like_vllm(checkpoint: Path) -> None:
    argv = single_node_argv(checkpoint)
    argv[argv.index("--chat-template") + 1] = "/opt/dsv41/missing.jinja"
    done = run_cli(argv)
    assert done.returncode == 1
    assert (
        "ValueError: The supplied chat template (/opt/dsv41/missing.jinja) looks like a file path, but it "
        "failed to be opened"
    ) in done.stdout + done.stderr


def test_the_rendered_chat_template_is_what_the_sim_image_carries() -> None:
    argv = serve_spec.rank_command(cluster_settings(), 0)
    assert argv[argv.index("--chat-template") + 1] == IMAGE_CHAT_TEMPLATE
    build = (REPO / "sim" / "image" / "build.sh").read_text()
    assert '"$ctx/opt/dsv41/chat_template.jinja"' in build
    assert (REPO / "sim" / "image" / "chat_template.jinja").is_file()


def test_a_runtime_fault_file_breaks_a_verified_head_and_clearing_it_heals(
    launch: Callable[..., Cluster], tmp_path: Path
) -> None:
    """What LiveRanks must catch: a deployment that verified, then answers NaN or hangs (SIM_FAULT_FILE)."""
    switch = tmp_path / "fault"
    cluster = launch(cluster_settings(extra_env={"SIM_FAULT_FILE": str(switch), "SIM_DECODE_TOKENS_PER_SECOND": "100"}))
    run_gates(cluster)
    assert isinstance(verify_endpoint(cluster.endpoint, cluster.model, timeout_s=10), Passed)
    switch.write_text("nan-logits\n")
    outcome = verify_endpoint(cluster.endpoint, cluster.model, timeout_s=10)
    assert isinstance(outcome, Failed) and outcome.reason is Reason.NAN, outcome
    assert probe_endpoint(cluster.endpoint, cluster.model, timeout_s=5).state == "drift"
    switch.write_text("hang\n")
    hung = verify_endpoint(cluster.endpoint, cluster.model, timeout_s=1.5)
    assert isinstance(hung, Failed) and hung.reason is Reason.HUNG_RANK, hung
    probe = probe_endpoint(cluster.endpoint, cluster.model, timeout_s=1)
    assert probe.state == "drift" and "step counter stayed" in probe.seen, probe
    switch.unlink()
    assert isinstance(verify_endpoint(cluster.endpoint, cluster.model, timeout_s=10), Passed)
    assert probe_endpoint(cluster.endpoint, cluster.model, timeout_s=5).state == "healthy"


def test_the_oom_fault_reads_the_containers_memory_limit_from_either_cgroup_version(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    assert standin.memory_limit_bytes([str(v2), str(v1)]) is None, "cgroup v2's `max`: no limit"
    v2.write_text("268435456\n")
    assert standin.memory_limit_bytes([str(v2), str(v1)]) == 256 << 20
    v1.write_text("9223372036854771712\n")  # v1's "unlimited"
    assert standin.memory_limit_bytes([str(tmp_path / "none"), str(v1)]) is None
    v1.write_text("67108864\n")
    assert standin.memory_limit_bytes([str(tmp_path / "none"), str(v1)]) == 64 << 20


@pytest.mark.parametrize("limit", [None, 64 << 30])
def test_the_oom_fault_never_takes_a_machine_without_a_low_container_limit(tmp_path: Path, limit: int | None) -> None:
    switch = tmp_path / "fault"
    switch.write_text("oom\n")
    standin.exhaust_memory(str(switch), "Worker_TP1", limit=limit)  # returns: nothing allocated
    assert switch.read_text() == "oom\n", "refused, the switch stays as the operator wrote it"
