"""The stand-in held to real vLLM as `make record-real` recorded it (tests/support/fixtures/real-vllm).

The stand-in runs as real local processes with what the program renders (tests/sim/test_standin.py's
`launch`). For each rank: the kinds of line the program reads appear in the recorded order; each stand-in
line reads as a recorded one once numbers, addresses and paths are set aside; and after a fault (a worker
killed or stopped, the head killed or stopped) each rank does, prints and exits as recorded. The error
bodies, the completion's JSON and the metrics the program reads are compared too. Where the stand-in
plays the recipe's hardware (CUDA graphs, NCCL, the EXL3 image's tables), the difference is listed in
HARDWARE_ONLY with the reason; every other difference fails here.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest

from tests.sim.test_standin import LOOPBACK, Cluster, checkpoint, cluster_settings, launch  # noqa: F401
from tests.support import recorded
from tests.support.recorded import Line, normalized

# The kinds of line the program's gates and hints read, by message.
KINDS: dict[str, re.Pattern[str]] = {
    name: re.compile(p)
    for name, p in {
        "api args": r"^non-default args: ",
        "headless launch": r"^Launching vLLM \(v\S+\) headless multiproc executor",
        "engine config": r"^Initializing a V1 LLM engine",
        "dp leader": r"^DP group leader: ",
        "init method": r"^world_size=\d+ rank=\d+ local_rank=\d+ distributed_init_method=",
        "rank assigned": r"^rank \d+ in world size \d+ is assigned as ",
        "load start": r"^Starting to load model ",
        "load done": r"^Loading weights took ",
        "kv size": r"^(?:GPU|CPU) KV cache size: ",
        "init engine": r"^init engine \(profile, create kv cache, warmup model\) took ",
        "server start": r"^Starting vLLM server on ",
        "routes": r"^Available routes are",
        "startup": r"^(?:Started server process|Waiting for application startup|Application startup complete)",
        "worker exception": r"^WorkerProc hit an exception\.",
        "peer closed": r"^RuntimeError: \S+ Connection closed by peer ",
        "engine fatal": r"^EngineCore encountered a fatal error\.",
        "worker failed": r"^RuntimeError: Worker failed with error ",
        "engine dead": r"EngineDeadError: EngineCore encountered an issue",
        "shutdown": (
            r"^(?:Shutting down$|Waiting for application shutdown|Application shutdown complete|Finished server)"
        ),
    }.items()
}

# Lines the stand-in prints for the recipe's hardware that vLLM's CPU build cannot show here, each with why
# it is safe: the program reads none of them as a decision but the phase it names.
HARDWARE_ONLY: dict[str, tuple[re.Pattern[str], str]] = {
    name: (re.compile(p), why)
    for name, (p, why) in {
        "nccl": (r"^vLLM is using nccl==", "pynccl.py, CUDA builds only (rank 0); the CPU build runs gloo"),
        "load progress": (
            r"Loading safetensors checkpoint shards",
            "tqdm over 39 shards on rank 0 (weight_utils.py); "
            "the recorded one-file model drew only empty lines, on the head alone",
        ),
        "gpu load": (r"^Model loading took ", "gpu_model_runner.py; the CPU runner prints no such line"),
        "gpu kv": (r"^Available KV cache memory: ", "gpu_worker.py's profile; the CPU worker sets KV by config"),
        "graphs": (r"Capturing CUDA graphs|^Graph capturing finished", "CUDA graphs; the sim's real ranks run eager"),
        "engram": (r"^Loaded Engram table shard ", "the recipe image's EXL3 Engram tables; not in upstream vLLM"),
    }.items()
}

# Text that differs by platform only, set aside on both sides before the texts are compared.
VARIANTS = (
    (re.compile(r"backend=(?:nccl|gloo)"), "backend=<dist>"),  # NCCL on GPUs, gloo on CPUs
    (re.compile(r"^(?:GPU|CPU) KV cache size"), "<device> KV cache size"),
)
# The config itself: the stand-in's (the recipe's) differs from the tiny model's by design.
CONTENT_DIFFERS = {"api args", "engine config", "dp leader"}
# Traceback frames name the platform's own code paths; their final lines are compared.
_FRAME = re.compile(r"^(?:Traceback \(most recent call last\):|  File |    |\s*\^+\s*$)")


def kind_of(message: str) -> str | None:
    return next((name for name, p in KINDS.items() if p.search(message)), None)


def hardware_only(message: str) -> str | None:
    return next((name for name, (p, _) in HARDWARE_ONLY.items() if p.search(message)), None)


def comparable(message: str) -> str:
    out = normalized(message)
    for pattern, placeholder in VARIANTS:
        out = pattern.sub(placeholder, out)
    return out


def kinds_in_order(lines: Iterable[Line]) -> list[str]:
    """Each kind at its first appearance."""
    seen: list[str] = []
    for line in lines:
        kind = kind_of(line.message)
        if kind and kind not in seen:
            seen.append(kind)
    return seen


def all_recorded_texts() -> set[str]:
    texts = set()
    for path in recorded.FIXTURES.glob("*/*.log.jsonl"):
        role = path.name.split(".")[0]
        texts |= {comparable(ln.message) for ln in recorded.log(path.parent.name, role)}
    return texts


def assert_lines_conform(stand_in: Sequence[str], scenario: str, role: str) -> None:
    """Kinds in the recorded order, and every other stand-in line's text one real vLLM printed."""
    real = recorded.log(scenario, role)
    mine = [Line(0.0, text) for text in stand_in]
    assert kinds_in_order(ln for ln in mine if not hardware_only(ln.message)) == kinds_in_order(real), (
        f"{scenario}/{role}: the kinds of line differ from real vLLM's\n stand-in: {kinds_in_order(mine)}\n "
        f"recorded: {kinds_in_order(real)}"
    )
    known = all_recorded_texts()
    strange = [
        ln.text
        for ln in mine
        if not hardware_only(ln.message)
        and kind_of(ln.message) not in CONTENT_DIFFERS
        and not _FRAME.match(ln.message)
        and not ln.message.startswith(f"{LOOPBACK}:")
        and comparable(ln.message) not in known
    ]
    assert not strange, f"{scenario}/{role}: stand-in lines real vLLM never printed:\n" + "\n".join(strange)


def access_log(message: str) -> bool:
    return bool(re.match(r"^\S+:\d+ - \"", message))


def test_the_tables_name_real_kinds_and_real_hardware_differences() -> None:
    # A kind the recording never shows compares nothing; a hardware-only line real vLLM printed is no excuse.
    texts = [
        ln.message
        for path in recorded.FIXTURES.glob("*/*.log.jsonl")
        for ln in recorded.log(path.parent.name, path.name.split(".")[0])
    ]
    assert {kind for t in texts if (kind := kind_of(t))} == set(KINDS)
    assert not [t for t in texts if hardware_only(t)], "a HARDWARE_ONLY line appears in real vLLM's recording"


# --- boot ------------------------------------------------------------------------------------------------


@pytest.fixture
def booted(launch: Callable[..., Cluster]) -> Cluster:  # noqa: F811
    cluster = launch(cluster_settings())
    cluster.head.wait_for_line(r"Application startup complete", 20)
    time.sleep(0.3)
    return cluster


def test_boot_lines_of_each_rank_are_real_vllms(booted: Cluster) -> None:
    for rank, role in ((0, "head"), (1, "worker")):
        assert_lines_conform(booted.ranks[rank].lines, "boot", role)


def test_a_worker_loads_in_silence_as_real_vllm_does(booted: Cluster) -> None:
    # Between joining the group and its load finishing, a real worker prints no progress of its own.
    def between(lines: Sequence[str]) -> list[str]:
        msgs = [Line(0, t).message for t in lines]
        start = next(i for i, m in enumerate(msgs) if kind_of(m) == "load start")
        end = next(i for i, m in enumerate(msgs) if kind_of(m) == "load done")
        return [m for m in msgs[start + 1 : end] if m.strip() and not hardware_only(m) and "Loading safetensors" in m]

    assert between([ln.text for ln in recorded.log("boot", "worker")]) == []
    assert between(booted.ranks[1].lines) == []


# --- faults, as recorded -----------------------------------------------------------------------------


def request(
    cluster: Cluster,
    body: dict[str, Any] | None,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    stream: bool = False,
) -> dict[str, Any]:
    conn = http.client.HTTPConnection(LOOPBACK, cluster.settings.serve.port, timeout=30)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
    except (OSError, http.client.HTTPException) as err:
        return {"error": type(err).__name__}
    finally:
        conn.close()
    out: dict[str, Any] = {"status": resp.status, "contentType": resp.getheader("content-type", "")}
    if stream and resp.getheader("content-type", "").startswith("text/event-stream"):
        out["events"] = [ln for ln in raw.splitlines() if ln]
    else:
        try:
            out["body"] = json.loads(raw) if raw else ""
        except ValueError:
            out["body"] = raw
    return out


def chat(cluster: Cluster, **extra: Any) -> dict[str, Any]:
    """The recorder's request (sim/record.py `chat`)."""
    return {
        "model": cluster.model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        **extra,
    }


def exit_code(code: int) -> int:
    """A local process's return code as docker reports the container's (a signal N is 128 + N)."""
    return 128 - code if code < 0 else code


def assert_answers_as_recorded(mine: dict[str, Any], real: dict[str, Any], what: str) -> None:
    if "events" in real and not real["contentType"].startswith("text/event-stream"):
        # A streamed request answered with plain JSON (an engine already dead): the recorder kept its lines.
        real = {**{k: v for k, v in real.items() if k != "events"}, "body": json.loads("".join(real["events"]))}
    assert mine.get("status") == real.get("status"), f"{what}: {mine} vs recorded {real}"
    if "events" in real:
        assert [normalized(e) for e in mine.get("events", [])] == [normalized(e) for e in real["events"]], what
    else:
        assert mine.get("body") == real.get("body"), f"{what}: {mine.get('body')} vs recorded {real.get('body')}"
        assert mine.get("contentType") == real.get("contentType"), what


@pytest.mark.parametrize(
    ("scenario", "first"),
    [("killed-worker", "request"), ("killed-worker-streamed", "streamed"), ("stopped-worker", "request")],
)
def test_a_worker_gone_after_ready_plays_out_as_recorded(
    launch: Callable[..., Cluster],  # noqa: F811
    scenario: str,
    first: str,
) -> None:
    real = recorded.document(scenario, "sequence.json")
    cluster = launch(cluster_settings())
    head, worker = cluster.ranks
    head.wait_for_line(r"Application startup complete", 20)
    time.sleep(0.3)
    mark = len(head.lines)
    worker.proc.send_signal(signal.SIGTERM if scenario == "stopped-worker" else signal.SIGKILL)
    assert exit_code(worker.wait_exit(15)) == real["worker"]["exitCode"]
    time.sleep(1.0)
    assert head.proc.poll() is None and real["headAfter5s"]["running"], "the idle head lives on"
    assert [ln for ln in head.lines[mark:] if not access_log(Line(0, ln).message)] == [], "and says nothing"
    assert request(cluster, None, "/health", "GET")["status"] == real["healthAfter5s"]["status"]
    # The first request after the loss meets it, exactly as recorded.
    second = "request" if first == "streamed" else "streamed"
    mine = request(cluster, chat(cluster, stream=first == "streamed"), stream=first == "streamed")
    assert_answers_as_recorded(mine, real[first], f"{scenario}: {first}")
    # The second meets the dead engine's 500 or, the head having exited a fraction of a second after the
    # failure, a closed port: the recordings show both, as timing decides.
    mine = request(cluster, chat(cluster, stream=second == "streamed"), stream=second == "streamed")
    dead = {
        "status": 500,
        "contentType": "application/json",
        "body": recorded.document("killed-worker", "sequence.json")["request"]["body"],
    }
    assert mine.get("error") == "ConnectionRefusedError" or mine == dead, f"{scenario}: {second}: {mine}"
    assert real[second].get("error") == "ConnectionError" or (real[second]["status"], real[second]["contentType"]) == (
        500,
        "application/json",
    ), real[second]
    assert exit_code(head.wait_exit(15)) == real["head"]["exitCode"]
    assert_lines_conform(head.lines[mark:], scenario, "head")


@pytest.mark.parametrize("scenario", ["killed-head", "stopped-head"])
def test_a_head_gone_leaves_the_worker_as_recorded(
    launch: Callable[..., Cluster],  # noqa: F811
    scenario: str,
) -> None:
    real = recorded.document(scenario, "sequence.json")
    cluster = launch(cluster_settings())
    head, worker = cluster.ranks
    head.wait_for_line(r"Application startup complete", 20)
    mark = len(worker.lines)
    head.proc.send_signal(signal.SIGKILL if scenario == "killed-head" else signal.SIGTERM)
    assert exit_code(head.wait_exit(15)) == real["head"]["exitCode"]
    time.sleep(2.0)
    assert (worker.proc.poll() is None) == real["workerAfter60s"]["running"]
    assert_lines_conform(worker.lines[mark:], scenario, "worker")


# --- the API's answers ---------------------------------------------------------------------------------

ERRORS = sorted(p.stem.removeprefix("error-") for p in (recorded.FIXTURES / "http").glob("error-*.json"))


@pytest.mark.parametrize("name", ERRORS)
def test_an_error_answer_is_real_vllms(booted: Cluster, name: str) -> None:
    real = recorded.document("http", f"error-{name}.json")
    path = "/v1/no-such-path" if name == "unknown-path" else "/v1/chat/completions"
    mine = request(booted, real["request"], path, "GET" if real["request"] is None else "POST")
    assert (mine["status"], mine["contentType"]) == (real["status"], real["contentType"]), (name, mine, real)
    if real["status"] == 200:
        return
    if "error" not in real["body"]:
        assert mine["body"] == real["body"], name
        return
    mine_e, real_e = mine["body"]["error"], real["body"]["error"]
    assert {k: mine_e.get(k) for k in ("type", "code", "param")} == {k: real_e[k] for k in ("type", "code", "param")}
    assert normalized(mine_e["message"]) == normalized(real_e["message"]), name


def shape(value: Any) -> Any:
    """Keys at every level (the first item of a list for all)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


def assert_no_invented_keys(mine: Any, real: Any, where: str = "") -> None:
    if isinstance(mine, dict) and isinstance(real, dict):
        assert set(mine) <= set(real), f"{where}: keys real vLLM does not send: {sorted(set(mine) - set(real))}"
        for k in mine:
            assert_no_invented_keys(mine[k], real[k], f"{where}.{k}")
    elif isinstance(mine, list) and isinstance(real, list) and mine and real:
        assert_no_invented_keys(mine[0], real[0], f"{where}[0]")


# What the verifier and the drift probe read of a completion.
READ = ("id", "model", "choices", "usage")
READ_CHOICE = ("index", "message", "finish_reason", "logprobs")
READ_TOKEN = ("token", "logprob", "top_logprobs")


def test_a_completion_with_logprobs_has_real_vllms_shape(booted: Cluster) -> None:
    real = recorded.document("http", "chat-logprobs.json")["body"]
    mine = request(booted, chat(booted))["body"]
    assert_no_invented_keys(shape(mine), shape(real), "completion")
    for body in (mine, real):
        assert all(k in body for k in READ) and all(k in body["choices"][0] for k in READ_CHOICE)
        assert all(k in body["choices"][0]["logprobs"]["content"][0] for k in READ_TOKEN)


def test_a_streamed_completion_has_real_vllms_events(booted: Cluster) -> None:
    real = recorded.document("http", "chat-stream.json")
    mine = request(booted, chat(booted, stream=True), stream=True)
    assert (mine["status"], mine["contentType"]) == (real["status"], real["contentType"])
    assert mine["events"][-1] == real["events"][-1] == "data: [DONE]"
    first = [json.loads(e.removeprefix("data: ")) for e in (mine["events"][1], real["events"][1])]
    assert_no_invented_keys(shape(first[0]), shape(first[1]), "chunk")


# The series the drift probe and the supervisor read, with their types.
READ_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:iteration_tokens_total",
)
MOVING = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:iteration_tokens_total_count",
)


def test_the_metrics_the_program_reads_have_real_vllms_types_and_move_as_they_do(booted: Cluster) -> None:
    idle_real, busy_real = recorded.metrics("idle.txt"), recorded.metrics("after-two-completions.txt")
    idle = request(booted, None, "/metrics", "GET")["body"]
    for _ in range(2):
        request(booted, chat(booted))
    busy = request(booted, None, "/metrics", "GET")["body"]
    real_types, my_types = recorded.metric_types(idle_real), recorded.metric_types(idle)
    assert {n: my_types.get(n) for n in READ_METRICS} == {n: real_types[n] for n in READ_METRICS}
    for before, after, who in ((idle_real, busy_real, "recorded"), (idle, busy, "stand-in")):
        moved = {n: recorded.metric_sum(after, n) > recorded.metric_sum(before, n) for n in MOVING}
        assert all(moved.values()), f"{who}: {moved}"
        assert recorded.metric_sum(before, "vllm:num_requests_running") == 0, who
