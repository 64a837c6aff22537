"""The one HTTP client: a deadline over connect and read, SSE events with their arrival time."""

from __future__ import annotations

import json
import time

import pytest

from components.http import ConnectionRefusedOrReset, DeadlineExceeded, exchange, sse_payloads
from tests.support.fake_vllm import FakeVllm, Reply, chat_body, free_port, good_items, stream_events

pytestmark = pytest.mark.timeout(10)


def _post(url: str, *, timeout_s: float, stream: bool = False) -> object:
    return exchange(
        "POST",
        f"{url}/chat/completions",
        body=b"{}",
        headers={"Content-Type": "application/json"},
        deadline=time.monotonic() + timeout_s,
        stream=stream,
    )


def test_sse_payloads_join_multiline_data_and_skip_comments() -> None:
    lines = [": keep-alive\n", 'data: {"a":\n', "data: 1}\n", "\n", "data:[DONE]\n"]
    assert sse_payloads(lines) == ['{"a":\n1}', "[DONE]"]


def test_a_plain_answer_has_its_status_lowercased_headers_and_body() -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as server:
        reply = exchange("GET", f"{server.url}/models", deadline=time.monotonic() + 2)
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    assert [m["id"] for m in json.loads(reply.body)["data"]] == ["fake-model"]
    assert reply.events == ()


def test_a_stream_yields_each_event_with_its_arrival_time_and_stops_at_done() -> None:
    paced = [(0.2, p) for _, p in stream_events(good_items())]
    with FakeVllm(Reply(events=paced)) as server:
        started = time.monotonic()
        reply = exchange("POST", f"{server.url}/chat/completions", body=b"{}", deadline=started + 5, stream=True)
    times = [at for at, _ in reply.events]
    assert [data for _, data in reply.events] == [p for _, p in paced]
    assert reply.events[-1][1] == "[DONE]" and reply.body == b""
    assert times == sorted(times) and times[-1] - times[0] >= 0.2 * (len(paced) - 1) * 0.8


def test_a_trickling_stream_is_cut_at_the_total_deadline_not_per_read() -> None:
    # Each event arrives well within the deadline, but the whole answer would take 6 s.
    trickle = [(0.3, p) for _, p in stream_events(good_items() * 10)]
    with FakeVllm(Reply(events=trickle)) as server:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            exchange("POST", f"{server.url}/chat/completions", body=b"{}", deadline=started + 1, stream=True)
        assert time.monotonic() - started < 1.5


def test_an_answer_that_never_comes_raises_at_the_deadline() -> None:
    with FakeVllm(Reply(hang_s=5)) as server:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            _post(server.url, timeout_s=0.5)
        assert time.monotonic() - started < 1.0


def test_a_spent_deadline_sends_nothing() -> None:
    with FakeVllm(Reply()) as server:
        with pytest.raises(DeadlineExceeded):
            _post(server.url, timeout_s=0)
        assert server.requests == []


def test_a_refused_connection_is_told_apart() -> None:
    with pytest.raises(ConnectionRefusedOrReset, match="ConnectionRefusedError"):
        _post(f"http://127.0.0.1:{free_port()}/v1", timeout_s=2)


def test_a_chunked_stream_as_uvicorn_sends_it_yields_each_event_as_it_arrives() -> None:
    """vLLM's server (uvicorn) streams with Transfer-Encoding: chunked; each event must be seen when it arrives,
    not when the response ends."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    payloads = ['{"n": 1}', '{"n": 2}', "[DONE]"]

    class Chunked(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for payload in payloads:
                time.sleep(0.3)
                data = f"data: {payload}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Chunked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        reply = exchange(
            "POST",
            f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions",
            body=b"{}",
            deadline=started + 5,
            stream=True,
        )
    finally:
        server.shutdown()
    assert [data for _, data in reply.events] == payloads
    gaps = [b - a for (a, _), (b, _) in zip(reply.events, reply.events[1:], strict=False)]
    assert all(g > 0.2 for g in gaps), f"events seen together, not as they arrived: {gaps}"


def test_a_server_that_compresses_what_the_client_accepts_answers_in_plain_text() -> None:
    """The body is read raw, never decoded: a server that gzips when allowed (Prometheus' API does for requests'
    default `Accept-Encoding: gzip, deflate`) must be asked for identity, or the body is gzip bytes."""
    import gzip
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answer = b'{"status": "success", "data": {"resultType": "vector", "result": []}}'

    class Gzipping(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:  # noqa: N802
            accepted = self.headers.get("Accept-Encoding", "")
            body = gzip.compress(answer) if "gzip" in accepted else answer
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if body is not answer:
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gzipping)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/api/v1/query?query=up"
        reply = exchange("GET", url, deadline=time.monotonic() + 5)
    finally:
        server.shutdown()
    assert reply.body == answer
