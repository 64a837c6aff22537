"""Fake stacks and nodes for the operator commands: a StackView from the test config, and what nodes answer."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from components import ssh
from components.config import parse
from components.operator.stack_view import PROJECT, StackView
from tests.support.configs import two_sparks

STACK = "opstest"
HEAD_CONTAINER = f"dsv41-exl3-{STACK}-spark-head"
WORKER_CONTAINER = f"dsv41-exl3-{STACK}-spark-worker"
# Distinctive so a test can tell they never reach the output.
SSH_KEY_BODY = "SSHKEYBODYq7Zr2xVw9"
SSH_KEY = f"-----BEGIN OPENSSH PRIVATE KEY-----\n{SSH_KEY_BODY}\n-----END OPENSSH PRIVATE KEY-----"
API_KEY = "APIKEYk3Jf8sPq1Lm"
SUPERVISOR_TOKEN = "SUPTOKENn5Hd2Wy6Rc"
SUPERVISOR_URL = "http://192.168.100.1:18391"


def outputs(**overrides: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "endpoint": "http://10.0.0.1:8888/v1",
        "model": "DeepSeek-v4.1-Flash-EXL3",
        "containers": {"spark-head": HEAD_CONTAINER, "spark-worker": WORKER_CONTAINER},
        "clusterGeneration": "gen-4f2a",
        "verification": {
            "answer": "Paris",
            "logprobs": [["Paris", -0.0123]],
            "latencySeconds": 1.25,
            "verifiedAt": "2025-06-01T10:00:00Z",
        },
        "apiKey": API_KEY,
        "supervisor": {"url": SUPERVISOR_URL, "token": SUPERVISOR_TOKEN},
    }
    out.update(overrides)
    return {k: v for k, v in out.items() if v is not None}


def view(outputs_: dict[str, Any] | None = None, **config: Any) -> StackView:
    raw = two_sparks(**{"ssh": {"privateKey": SSH_KEY}, **config})
    return StackView(
        name=STACK,
        settings=parse(raw).settings,
        outputs=outputs() if outputs_ is None else outputs_,
        stack_dir=str(ssh.stack_dir(PROJECT, STACK)),
    )


# --- what a node prints for the status script, captured from docker 27 and Linux 6.8 -------------------------

RUNNING_STATE = {
    "Status": "running",
    "Running": True,
    "Paused": False,
    "Restarting": False,
    "OOMKilled": False,
    "Dead": False,
    "Pid": 41234,
    "ExitCode": 0,
    "Error": "",
    "StartedAt": "2025-06-01T09:58:12.123456789Z",
    "FinishedAt": "0001-01-01T00:00:00Z",
}
DEAD_STATE = {
    **RUNNING_STATE,
    "Status": "exited",
    "Running": False,
    "OOMKilled": True,
    "Pid": 0,
    "ExitCode": 137,
    "FinishedAt": "2025-06-01T11:02:03.5Z",
}
WATCHDOG_LINE = "2025-06-01T09:58:20Z watchdog armed: floor 1.5 GiB, MemAvailable 4.02 GiB"


def node_text(state: str, *, mem_kb: int = 4_215_212, watchdog: str = WATCHDOG_LINE) -> str:
    return f"==state==\n{state}\n==meminfo==\nMemAvailable:    {mem_kb} kB\n==watchdog==\n{watchdog}\n==end==\n"


RUNNING_TEXT = node_text(json.dumps(RUNNING_STATE))
DEAD_TEXT = node_text(json.dumps(DEAD_STATE), mem_kb=116_391_936, watchdog="no watchdog log")
MISSING_TEXT = node_text(f"Error: No such object: {WORKER_CONTAINER}", mem_kb=120_000_000)
UNREACHABLE_STDERR = "ssh: connect to host 10.0.0.2 port 22: No route to host\r\n"


def done(stdout: str = "", stderr: str = "", returncode: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["ssh"], returncode, stdout, stderr)


class FakeNodes:
    """`run` for status: answers each node (by its SSH address) as told, and records every argv."""

    def __init__(self, **by_host: subprocess.CompletedProcess[str] | BaseException) -> None:
        self.by_host: dict[str, subprocess.CompletedProcess[str] | BaseException] = {
            "10.0.0.1": done(RUNNING_TEXT),
            "10.0.0.2": done(RUNNING_TEXT.replace(HEAD_CONTAINER, WORKER_CONTAINER)),
        }
        self.by_host.update({k.replace("_", "."): v for k, v in by_host.items()})
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        host = argv[-2].split("@", 1)[1]
        answer = self.by_host[host]
        if isinstance(answer, BaseException):
            raise answer
        return answer


# --- vLLM's /metrics, trimmed from a vLLM 0.10 head ------------------------------------------------------------


def metrics_text(*, running: float = 1.0, waiting: float = 0.0, kv: float = 0.125, generated: float = 1000.0) -> str:
    return f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="DeepSeek-v4.1-Flash-EXL3"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="DeepSeek-v4.1-Flash-EXL3"}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="DeepSeek-v4.1-Flash-EXL3"}} {kv}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="DeepSeek-v4.1-Flash-EXL3"}} {generated}
vllm:generation_tokens_created{{engine="0",model_name="DeepSeek-v4.1-Flash-EXL3"}} 1.7487e+09
vllm:generation_tokens_total_created{{engine="0",model_name="DeepSeek-v4.1-Flash-EXL3"}} 1.7487e+09
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="0.3",model_name="DeepSeek-v4.1-Flash-EXL3"}} 0.0
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="DeepSeek-v4.1-Flash-EXL3"}} 12.0
"""


SUPERVISOR_STATUS = {
    "node": "spark-head",
    "doing": "watching",
    "now": 1_748_772_000.0,
    "paused": False,
    "last_probe": {"state": "ok", "at": 1_748_771_990.0, "seen": "200 /health"},
    "last_verified": {"at": 1_748_771_000.0, "generation": "gen-4f2a", "logprobs": [["Paris", -0.01]]},
    "restarts": [],
}


class FakeHttp:
    """`fetch` for status: metrics samples in turn, the supervisor's status; records (url, headers)."""

    def __init__(
        self,
        metrics: list[tuple[int, str] | BaseException] | None = None,
        supervisor: tuple[int, str] | BaseException | None = None,
    ) -> None:
        self.metrics = list(
            metrics if metrics is not None else [(200, metrics_text()), (200, metrics_text(generated=1150.0))]
        )
        self.supervisor = supervisor if supervisor is not None else (200, json.dumps(SUPERVISOR_STATUS))
        self.calls: list[tuple[str, dict[str, str], float]] = []

    def __call__(self, url: str, headers: Any, timeout: float) -> tuple[int, str]:
        self.calls.append((url, dict(headers), timeout))
        answer = self.supervisor if url.endswith("/status") else self.metrics.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class FakeClock:
    """`sleep` and `clock` together: sleeping advances the clock, so the rate's elapsed time is exact."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now
