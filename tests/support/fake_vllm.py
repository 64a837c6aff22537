"""A loopback stand-in for vLLM's OpenAI server: real HTTP on 127.0.0.1, scripted answers.

Each test scripts what `/v1/chat/completions` answers (a body, an SSE stream with timed events,
or silence) and what `/health` and `/v1/models` say; the server records every request so tests
can assert what was (and was not) sent.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

NAN_STREAM_ERROR = "Out of range float values are not JSON compliant"
# What real vLLM 0.32 answered every request after a rank of its group was killed (HTTP 500; streamed: this in a
# data event of an HTTP 200 stream, then [DONE]), as recorded (shared/notes/vllm-real.md).
ENGINE_DEAD_BODY = (
    b'{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the root '
    b'cause.","type":"InternalServerError","param":null,"code":500}}'
)


@dataclass(frozen=True)
class Reply:
    """What one completion request gets.

    `events`: SSE data payloads, each sent after its delay (seconds). `hang_s`: wait this long
    before answering at all (the server is released early when the test stops it).
    """

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    events: Sequence[tuple[float, str]] | None = None
    hang_s: float = 0.0


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


Script = Callable[[dict[str, Any]], Reply]


@dataclass
class FakeVllm:
    completion: Reply | Script
    health_status: int = 200
    models: Sequence[str] = ("fake-model",)
    port: int = 0
    host: str = "127.0.0.1"
    # What GET /metrics answers (called per request: a counter can advance); None: 404.
    metrics: Callable[[], str] | None = None
    requests: list[Recorded] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the server first"
        return f"http://{self.host}:{self._server.server_address[1]}/v1"

    def completion_requests(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def start(self) -> FakeVllm:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                # Send each SSE event at once, as uvicorn does, so timing tests measure the pacing.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
                pass

            def _record(self, body: Any) -> None:
                with fake._lock:
                    fake.requests.append(Recorded(self.command, self.path, dict(self.headers.items()), body))

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._record(None)
                if self.path == "/health":
                    self._send(fake.health_status, b"")
                elif self.path == "/v1/models":
                    data = [{"id": name, "object": "model"} for name in fake.models]
                    self._send(200, json.dumps({"object": "list", "data": data}).encode())
                elif self.path == "/metrics" and fake.metrics is not None:
                    self._send(200, fake.metrics().encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, b'{"detail":"Not Found"}')

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                try:
                    body: Any = json.loads(raw)
                except ValueError:
                    body = raw
                self._record(body)
                if self.path != "/v1/chat/completions":
                    self._send(404, b'{"detail":"Not Found"}')
                    return
                reply = fake.completion(body) if callable(fake.completion) else fake.completion
                if reply.hang_s and fake._stop.wait(reply.hang_s):
                    return
                if reply.events is None:
                    self._send(reply.status, reply.body, reply.content_type)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for delay, payload in reply.events:
                    if delay and fake._stop.wait(delay):
                        return
                    self.wfile.write(f"data: {payload}\n\n".encode())
                    self.wfile.flush()
                self.close_connection = True

        server = ThreadingHTTPServer((self.host, self.port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> FakeVllm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port() -> int:
    """A loopback port nobody listens on (for connection-refused cases)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- vLLM-shaped bodies ----------------------------------------------------------------------


def logprob_item(token: str, logprob: Any) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": token, "logprob": logprob, "bytes": list(token.encode())}],
    }


GOOD_TOKENS: tuple[tuple[str, float], ...] = (("Paris", -0.00012), (".", -0.3817))


def chat_body(items: list[dict[str, Any]] | None, content: str | None = "Paris.", model: str = "fake-model") -> str:
    """A non-streamed chat completion as vLLM writes it; `items=None` omits logprobs."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": content, "reasoning_content": None, "tool_calls": []},
        "logprobs": None if items is None else {"content": items},
        "finish_reason": "stop",
        "stop_reason": None,
    }
    return json.dumps(
        {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "choices": [choice],
            "usage": {"prompt_tokens": 17, "total_tokens": 19, "completion_tokens": 2},
        }
    )


def good_items() -> list[dict[str, Any]]:
    return [logprob_item(token, value) for token, value in GOOD_TOKENS]


def items_with(value: Any) -> list[dict[str, Any]]:
    """The good answer's tokens with the second logprob replaced by `value`."""
    items = good_items()
    items[1] = logprob_item(".", value)
    return items


def error_body(message: str, kind: str, code: int, param: str | None = None) -> bytes:
    """An OpenAI-style error answer as vLLM writes it."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def with_literal(body: str, literal: str) -> bytes:
    """Replace the first real logprob value with a bare literal (NaN, Infinity) as some servers write."""
    return body.replace(json.dumps(GOOD_TOKENS[0][1]), literal).encode()


def stream_events(
    items: list[dict[str, Any]], *, interval_s: float = 0.0, completion_tokens: int | None = None
) -> list[tuple[float, str]]:
    """SSE payloads of a streamed completion: role chunk, one chunk per token, usage, [DONE]."""

    def chunk(delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return json.dumps(
            {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
        )

    events = [(0.0, chunk({"role": "assistant", "content": ""}))]
    for item in items:
        events.append((interval_s, chunk({"content": item["token"]}, {"content": [item]})))
    usage = {"prompt_tokens": 17, "completion_tokens": completion_tokens or len(items), "total_tokens": 0}
    final = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": []}
    events.append((0.0, json.dumps({**final, "usage": usage})))
    events.append((0.0, "[DONE]"))
    return events


def paced_stream(tokens: int, tokens_per_second: float, *, with_usage: bool = True) -> list[tuple[float, str]]:
    """A streamed answer whose tokens arrive at a controlled rate (no logprobs, like the probe)."""
    words = [f" w{i}" for i in range(tokens)]
    events = stream_events([{"token": w} for w in words], interval_s=1.0 / tokens_per_second)
    # the probe does not ask for logprobs: strip them from the token chunks
    stripped: list[tuple[float, str]] = []
    for delay, payload in events:
        if payload != "[DONE]":
            data = json.loads(payload)
            for choice in data["choices"]:
                choice["logprobs"] = None
            if not with_usage and "usage" in data:
                continue
            payload = json.dumps(data)
        stripped.append((delay, payload))
    return stripped


# --- vLLM 0.32's shapes with a reasoning parser (entrypoints/openai/chat_completion/protocol.py) --------------
# The message and the stream deltas carry `reasoning` (0.32 has no `reasoning_content`); while the reasoning has
# not ended, `content` is null; logprobs cover every generated token, reasoning tokens included.


def reasoning_body(reasoning: list[str], answer: list[str], model: str = "fake-model") -> str:
    """A non-streamed answer exactly as vLLM 0.32 writes it: `reasoning` tokens, then `answer` tokens."""
    items = [logprob_item(token, -0.25) for token in [*reasoning, *answer]]
    message = {
        "role": "assistant",
        "content": "".join(answer) if answer else None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": "".join(reasoning) if reasoning else None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": items},
        "finish_reason": "stop" if answer else "length",
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }
    usage = {
        "prompt_tokens": 17,
        "total_tokens": 17 + len(items),
        "completion_tokens": len(items),
        "prompt_tokens_details": None,
    }
    return json.dumps(
        {
            "id": "chatcmpl-r",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "kv_transfer_params": None,
        }
    )


def reasoning_stream(reasoning: list[str], answer: list[str]) -> list[tuple[float, str]]:
    """The same answer streamed as vLLM 0.32 streams it (`model_dump_json(exclude_unset=True)` chunks)."""

    def chunk(delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return json.dumps(
            {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
        )

    events = [(0.0, chunk({"role": "assistant", "content": ""}))]
    tokens = [("reasoning", t) for t in reasoning] + [("content", t) for t in answer]
    for index, (key, token) in enumerate(tokens):
        last = index == len(tokens) - 1
        events.append(
            (
                0.0,
                chunk(
                    {key: token},
                    {"content": [logprob_item(token, -0.25)]},
                    ("stop" if answer else "length") if last else None,
                ),
            )
        )
    usage = {"prompt_tokens": 17, "completion_tokens": len(tokens), "total_tokens": 17 + len(tokens)}
    events.append(
        (
            0.0,
            json.dumps(
                {
                    "id": "chatcmpl-r",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": "m",
                    "choices": [],
                    "usage": usage,
                }
            ),
        )
    )
    events.append((0.0, "[DONE]"))
    return events
