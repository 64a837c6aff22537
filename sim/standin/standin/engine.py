"""The vLLM stand-in's engine on the head: one model step at a time, every rank's partial logits summed (a worker gone
fails the step at once, one silent is waited for until VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS; either way the engine dies
as vLLM's does), the runtime faults read on every step, tokens paced at SIM_DECODE_TOKENS_PER_SECOND, and the
counters /metrics reports. Stdlib only, as the whole stand-in (sim/standin/README.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .checkpoint import pace
from .faults import SimEnv, exhaust_memory, runtime_fault
from .log import ENGINE_DEAD_MESSAGE, EXIT_FAILURE, LOG, die, worker_name
from .model import EOS_ID, SPECIAL_IDS, VOCAB, choose, clamp, log_softmax, partial_logits, structure
from .rendezvous import WorkerLink


class EngineDead(Exception):
    pass


@dataclass(frozen=True)
class ChatRequest:
    model: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    # The function a tool call names, when the request's tools and tool_choice ask for one.
    tool: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Token:
    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    finish_reason: str | None

    @property
    def text(self) -> str:
        return "" if self.id in SPECIAL_IDS else VOCAB[self.id]


class Engine:
    def __init__(
        self,
        weights: bytes,
        local_ranks: Sequence[int],
        links: Sequence[WorkerLink],
        env: SimEnv,
        served: Sequence[str],
    ) -> None:
        self.weights = weights
        self.local_ranks = tuple(local_ranks)
        self.links = tuple(links)
        self.env = env
        self.served = tuple(served)
        self.dead = False
        self._lock = threading.Lock()
        self._step_id = 0
        self.stats_lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.running = 0
        self.finished = 0
        # What /metrics reports as num_requests_running: like vLLM's scheduler stats, set after each completed
        # step (and lowered as requests finish), so a step that hangs leaves it where the last step left it.
        self.running_reported = 0

    def fault(self) -> str | None:
        return runtime_fault(self.env.fault_file) or self.env.fault

    def logits(self, prompt: str, generated: Sequence[int]) -> list[float]:
        key = hashlib.sha256(json.dumps([prompt, list(generated)]).encode()).hexdigest()
        fault = self.fault()
        if fault == "oom":
            exhaust_memory(self.env.fault_file, "EngineCore_DP0")
        nan = fault == "nan-logits"
        total = structure(self.weights, prompt, generated, wrong=fault == "wrong-answer")
        with self._lock:  # one model step at a time, like the engine loop
            while self.fault() == "hang":  # a hung step: the engine loop stops, the API server does not
                time.sleep(0.2)
            if self.dead:
                raise EngineDead()
            self._step_id += 1
            step_id = self._step_id
            for link in self.links:
                link.request(step_id, key)
            for rank in self.local_ranks:
                total = [a + b for a, b in zip(total, partial_logits(self.weights, rank, key, nan), strict=True)]
            deadline = time.monotonic() + self.env.execute_model_timeout_s
            for link in self.links:
                part = link.result(step_id, deadline)
                if part is None:
                    if link.closed:
                        self._peer_closed(link.node_rank)
                    else:
                        self._die(link.node_rank)
                    raise EngineDead()
                total = [a + b for a, b in zip(total, part, strict=True)]
            with self.stats_lock:
                self.steps += 1
                self.running_reported = self.running
        return total

    def _peer_closed(self, node_rank: int) -> None:
        """A step over a worker that is gone: the collective fails at once (gloo's "Connection closed by peer"),
        the engine core dies, and the API server shuts down and exits 0, as real vLLM 0.32 did
        (tests/support/fixtures/real-vllm/killed-worker). The texts are the recording's."""
        self.dead = True
        peer = self.links[[link.node_rank for link in self.links].index(node_rank)].peer
        gloo = (
            f"[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            f"{peer}. This is typically caused by a remote worker crashing. Check the logs of the remote worker "
            "before reporting an error. GLHF! \U0001f3d6\ufe0f"
        )
        LOG(worker_name(self.local_ranks[0]), "multiproc_executor.py:1063", "WorkerProc hit an exception.", "ERROR")
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/torch/distributed/distributed_c10d.py", '
                "line 3252, in all_reduce",
                "    work.wait()",
            ],
            f"RuntimeError: {gloo}",
        )
        LOG("EngineCore", "core.py:1512", "EngineCore encountered a fatal error.", "ERROR")
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/executor/multiproc_executor.py", '
                "line 444, in get_response",
                "    raise RuntimeError(",
            ],
            f"RuntimeError: Worker failed with error '{gloo}', please check the stack trace above for the root cause",
        )
        LOG("APIServer", "async_llm.py:906", "AsyncLLM output_handler failed.", "ERROR")
        LOG.traceback([], f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}")

        def shut_down() -> None:
            time.sleep(0.2)  # the failing request gets its 500 first
            pid = os.getpid()
            for text in (
                "Shutting down",
                "Waiting for application shutdown.",
                "Application shutdown complete.",
                f"Finished server process [{pid}]",
            ):
                LOG.raw(f"INFO:     {text}")
            die(0)

        threading.Thread(target=shut_down, daemon=True).start()

    def _die(self, node_rank: int) -> None:
        """vLLM's execute_model RPC timeout (a worker alive but not answering): the engine core dies and the
        API server goes with it."""
        self.dead = True
        who = "EngineCore_DP0"
        LOG(who, "core.py:860", "EngineCore encountered a fatal error.", "ERROR")
        LOG(
            who,
            "multiproc_executor.py:268",
            f"RPC call to sample_tokens timed out after "
            f"{self.env.execute_model_timeout_s:g} s (no reply from node rank {node_rank}).",
            "ERROR",
        )
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/executor/multiproc_executor.py", '
                "line 268, in collective_rpc"
            ],
            "TimeoutError: RPC call to sample_tokens timed out.",
        )
        LOG("APIServer", "async_llm.py:480", "AsyncLLM output_handler failed.", "ERROR")
        LOG.traceback([], f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}")

        def shut_down() -> None:
            time.sleep(0.5)  # let the failing request get its 500 first
            LOG("APIServer", "launcher.py:101", "Shutting down FastAPI HTTP server.")
            die(EXIT_FAILURE)

        threading.Thread(target=shut_down, daemon=True).start()

    def generate(self, req: ChatRequest) -> Iterator[Token]:
        """Tokens at SIM_DECODE_TOKENS_PER_SECOND after a short prefill, each yielded when it is due."""
        rng = random.Random(req.seed if req.seed is not None else uuid.uuid4().int)
        first_due = time.monotonic() + min(0.05 + 0.0005 * req.prompt_tokens, 1.0)
        interval = 1.0 / self.env.decode_tokens_per_second
        generated: list[int] = []
        with self.stats_lock:
            self.running += 1
            self.prompt_tokens += req.prompt_tokens
        try:
            for i in range(req.max_tokens):
                logits = self.logits(req.prompt, generated)
                logprobs = log_softmax(logits)
                chosen = choose(logits, req.temperature, req.top_p, req.top_k, rng)
                order = sorted(
                    (j for j in range(len(VOCAB)) if j != chosen),
                    key=lambda j: (-logprobs[j] if not math.isnan(logprobs[j]) else 0.0, j),
                )
                top = tuple((j, clamp(logprobs[j])) for j in [chosen, *order][: req.top_logprobs])
                finish = "stop" if chosen == EOS_ID else ("length" if i == req.max_tokens - 1 else None)
                pace(first_due + i * interval)
                with self.stats_lock:
                    self.generation_tokens += 1
                yield Token(chosen, clamp(logprobs[chosen]), top, finish)
                generated.append(chosen)
                if finish:
                    with self.stats_lock:
                        self.finished += 1
                    return
        finally:
            with self.stats_lock:
                self.running -= 1
                self.running_reported = min(self.running_reported, self.running)
