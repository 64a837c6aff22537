"""The vLLM stand-in's OpenAI API on the head: the routes (`/health`, `/v1/models`, `/version`, `/metrics`,
`/v1/chat/completions` plain and streamed) with vLLM's bodies, bearer auth and uvicorn's access lines, the `/metrics`
series with vLLM's names, and the engine's periodic throughput line. Stdlib only, as the whole stand-in
(sim/standin/README.md).
"""

from __future__ import annotations

import hmac
import json
import socket
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from .chat import ApiError, for_engine, json_safe, logprobs_content, parse_chat, tool_call
from .cli import ServeArgs
from .engine import ChatRequest, Engine, EngineDead
from .log import ENGINE_DEAD_MESSAGE, LOG, VLLM_VERSION

NAN_MESSAGE = "Out of range float values are not JSON compliant"


@dataclass
class Api:
    engine: Engine
    args: ServeArgs
    max_model_len: int
    api_key: str | None = field(repr=False)
    started: int = field(default_factory=lambda: int(time.time()))

    def models(self) -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.started,
                "owned_by": "vllm",
                "root": self.args.model,
                "parent": None,
                "max_model_len": self.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": self.started,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.engine.served
        ]
        return {"object": "list", "data": data}

    def metrics(self) -> str:
        """The series the program reads, with vLLM 0.32's names and types (fixtures/real-vllm/metrics)."""
        e = self.engine
        labels = f'engine="0",model_name="{e.served[0]}"'
        with e.stats_lock:
            running, steps = e.running_reported, e.steps
            out = [
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{labels}}} {float(running)}",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{labels}}} 0.0",
                # a sequence's KV blocks held while it runs: a tiny share of a GB10's cache per request
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{labels}}} {min(running * 0.001, 1.0)}",
                "# TYPE vllm:prompt_tokens_total counter",
                f"vllm:prompt_tokens_total{{{labels}}} {float(e.prompt_tokens)}",
                "# TYPE vllm:generation_tokens_total counter",
                f"vllm:generation_tokens_total{{{labels}}} {float(e.generation_tokens)}",
                "# TYPE vllm:request_success_total counter",
                f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(e.finished)}',
                # tokens per engine step: its _count counts the steps
                "# TYPE vllm:iteration_tokens_total histogram",
                f'vllm:iteration_tokens_total_bucket{{{labels},le="+Inf"}} {float(steps)}',
                f"vllm:iteration_tokens_total_count{{{labels}}} {float(steps)}",
                f"vllm:iteration_tokens_total_sum{{{labels}}} {float(e.prompt_tokens + e.generation_tokens)}",
            ]
        return "\n".join(out) + "\n"


def make_handler(api: Api) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def version_string(self) -> str:
            return "uvicorn"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each SSE event at once

        def log_message(self, format: str, *args: Any) -> None:
            pass  # uvicorn's access line is written in _access

        def _access(self, status: int) -> None:
            host, port = self.client_address[:2]
            phrase = self.responses.get(status, ("",))[0]
            LOG.raw(f'INFO:     {host}:{port} - "{self.command} {self.path} {self.request_version}" {status} {phrase}')

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self._access(status)

        def _json(self, status: int, payload: Any) -> None:
            self._send(status, json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode())

        def _route(self) -> str:
            return self.path.split("?", 1)[0]

        def _authorized(self) -> bool:
            if not api.api_key or not self._route().startswith("/v1"):
                return True
            given = self.headers.get("Authorization", "").encode()
            return hmac.compare_digest(given, f"Bearer {api.api_key}".encode())

        def _unauthorized(self) -> None:
            self._json(
                401,
                {
                    "error": {
                        "message": "Unauthorized",
                        "type": "AuthenticationError",
                        "param": None,
                        "code": 401,
                    }
                },
            )

        def do_GET(self) -> None:
            route = self._route()
            if not self._authorized():
                self._unauthorized()
            elif route in ("/health", "/ping"):
                self._send(503 if api.engine.dead else 200, b"")
            elif route == "/version":
                self._json(200, {"version": VLLM_VERSION})
            elif route == "/v1/models":
                self._json(200, api.models())
            elif route == "/metrics":
                self._send(200, api.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif route == "/v1/chat/completions":
                self._json(405, {"detail": "Method Not Allowed"})
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(min(length, 16 << 20))
            if self._route() != "/v1/chat/completions":
                self._json(
                    404 if self._route() not in ("/health", "/v1/models") else 405,
                    {"detail": "Not Found" if self._route() not in ("/health", "/v1/models") else "Method Not Allowed"},
                )
                return
            if not self._authorized():
                self._unauthorized()
                return
            try:
                try:
                    body = json.loads(raw)
                except ValueError as err:
                    raise ApiError(400, f"JSON decode error: {err}", "BadRequestError") from None
                req = parse_chat(
                    body,
                    api.engine.served,
                    api.max_model_len,
                    int(api.args.get("--max-logprobs", 20)),
                    api.args.get("--override-generation-config") or {},
                    api.args.get("--tool-call-parser"),
                    bool(api.args.get("--enable-auto-tool-choice")),
                )
            except ApiError as err:
                self._json(err.status, err.body)
                return
            if req.stream:
                self._stream(req)
            else:
                self._complete(req)

        def _complete(self, req: ChatRequest) -> None:
            try:
                tokens = list(api.engine.generate(for_engine(req)))
            except EngineDead:
                self._json(500, ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError").body)
                return
            completion = sum(1 for _ in tokens)
            calls = [tool_call(req.tool, req.prompt)] if req.tool is not None else []
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None if calls else "".join(t.text for t in tokens),
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    # vLLM 0.32 sends `tool_calls` only when there are some, and the reasoning as `reasoning`
                    **({"tool_calls": calls} if calls else {}),
                    "reasoning": None,
                },
                "logprobs": {"content": logprobs_content(tokens)} if req.logprobs else None,
                "finish_reason": "tool_calls" if calls else (tokens[-1].finish_reason if tokens else "length"),
                "stop_reason": None,
            }
            payload = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": req.model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": {
                    "prompt_tokens": req.prompt_tokens,
                    "total_tokens": req.prompt_tokens + completion,
                    "completion_tokens": completion,
                    "prompt_tokens_details": None,
                },
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
            try:
                # Starlette's JSONResponse renders with allow_nan=False: a NaN logprob becomes this 400.
                body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            except ValueError:
                self._json(400, ApiError(400, NAN_MESSAGE, "BadRequestError").body)
                return
            self._send(200, body)

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _event(self, payload: Any) -> None:
            self._chunk(
                b"data: " + json.dumps(json_safe(payload), ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
            )

        def _stream(self, req: ChatRequest) -> None:
            if api.engine.dead:  # an engine already known dead answers a stream as plain JSON (as recorded)
                self._json(500, ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError").body)
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream; charset=utf-8")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self._access(200)
            head = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": req.model,
            }
            usage: dict[str, Any] = {"usage": None} if req.include_usage else {}
            completion = 0
            # The role chunk goes out with the first step's output, as in vLLM: a step that fails first leaves
            # the error event alone in the stream (fixtures/real-vllm/killed-worker-streamed).
            pending = [
                {
                    **head,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **usage,
                }
            ]

            def emit(payload: Any) -> None:
                while pending:
                    self._event(pending.pop())
                self._event(payload)

            try:
                try:
                    if req.tool is not None:
                        completion = sum(1 for _ in api.engine.generate(for_engine(req)))
                        call = tool_call(req.tool, req.prompt)
                        emit(
                            {
                                **head,
                                "choices": [
                                    {
                                        "index": 0,
                                        "delta": {"tool_calls": [{"index": 0, **call}]},
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ],
                                **usage,
                            }
                        )
                        emit(
                            {
                                **head,
                                "choices": [
                                    {
                                        "index": 0,
                                        "delta": {},
                                        "logprobs": None,
                                        "finish_reason": "tool_calls",
                                        "stop_reason": None,
                                    }
                                ],
                                **usage,
                            }
                        )
                    for token in [] if req.tool is not None else api.engine.generate(req):
                        completion += 1
                        emit(
                            {
                                **head,
                                "choices": [
                                    {
                                        "index": 0,
                                        "delta": {"content": token.text},
                                        "logprobs": {"content": logprobs_content([token])} if req.logprobs else None,
                                        "finish_reason": token.finish_reason,
                                        # only on the last chunk, as vLLM 0.32 sends it
                                        **({"stop_reason": None} if token.finish_reason else {}),
                                    }
                                ],
                                **usage,
                            }
                        )
                except EngineDead:  # sent as vLLM does, with json.dumps' default separators
                    self._chunk(
                        b"data: "
                        + json.dumps(ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError").body).encode()
                        + b"\n\n"
                    )
                if req.include_usage:
                    self._event(
                        {
                            **head,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": req.prompt_tokens,
                                "completion_tokens": completion,
                                "total_tokens": req.prompt_tokens + completion,
                            },
                        }
                    )
                self._chunk(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True  # the client went away: vLLM aborts the request

    return Handler


def log_engine_stats(engine: Engine, interval_s: float = 10.0) -> None:
    """vLLM's periodic `Engine 000: Avg prompt throughput ...` line, while there is work."""
    last = (0, 0)
    while True:
        time.sleep(interval_s)
        with engine.stats_lock:
            now = (engine.prompt_tokens, engine.generation_tokens)
            running = engine.running
        if now != last or running:
            LOG(
                "APIServer",
                "loggers.py:123",
                f"Engine 000: Avg prompt throughput: {(now[0] - last[0]) / interval_s:.1f} tokens/s, "
                f"Avg generation throughput: {(now[1] - last[1]) / interval_s:.1f} tokens/s, "
                f"Running: {running} "
                f"reqs, Waiting: 0 reqs, GPU KV cache usage: {min(running * 0.1, 100):.1f}%, "
                "Prefix cache hit rate: 0.0%",
            )
        last = now
