"""The program's one HTTP client: a request bounded by a deadline over connect and read, and SSE framing.

Stdlib `http.client`, so every socket wait is re-armed with the time left before the deadline: a server
that trickles bytes cannot stretch a request past it (a per-read timeout, as `requests` has, would let
it). No proxies from the environment: the endpoints are the nodes' own ports. Streamed events carry
their arrival time, which the decode-speed measurement needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http.client import HTTPConnection, HTTPSConnection
from urllib.parse import urlsplit

Clock = Callable[[], float]

MAX_BODY_BYTES = 8 << 20
MAX_LINE_BYTES = 1 << 20


class ConnectionRefusedOrReset(Exception):
    """Connection refused or reset: the port is not serving yet and may be in a moment."""


class DeadlineExceeded(Exception):
    """No complete answer before the deadline."""


@dataclass(frozen=True)
class HttpReply:
    status: int
    headers: Mapping[str, str]
    """Header names lower-cased."""
    body: bytes
    events: tuple[tuple[float, str], ...] = ()
    """SSE data payloads with their arrival time on the request's clock (only for a streamed 200 answer)."""


def exchange(
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    deadline: float,
    clock: Clock = time.monotonic,
    stream: bool = False,
) -> HttpReply:
    """One HTTP request whose total time is bounded by `deadline` (on `clock`).

    Raises ConnectionRefusedOrReset, DeadlineExceeded, `http.client.HTTPException` (not HTTP) or OSError
    (no route, a bad name, ...). The body is cut at MAX_BODY_BYTES.
    """
    parts = urlsplit(url)
    remaining = deadline - clock()
    if remaining <= 0:
        raise DeadlineExceeded()
    connection_class = HTTPSConnection if parts.scheme == "https" else HTTPConnection
    connection = connection_class(parts.hostname or "", parts.port, timeout=remaining)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request(method, path, body=body, headers=dict(headers or {}))
        sock = connection.sock  # kept: http.client drops its reference when the server closes

        def arm() -> None:
            left = deadline - clock()
            if left <= 0:
                raise DeadlineExceeded()
            if sock is not None:
                sock.settimeout(left)

        arm()
        response = connection.getresponse()
        reply_headers = {key.lower(): value for key, value in response.getheaders()}
        if stream and response.status == 200:
            events: list[tuple[float, str]] = []
            decoder = SseDecoder()
            while True:
                arm()
                line = response.readline(MAX_LINE_BYTES)
                if not line:
                    break
                data = decoder.feed_line(line.decode("utf-8", errors="replace"))
                if data is not None:
                    events.append((clock(), data))
                    if data.strip() == "[DONE]":
                        break
            if (last := decoder.flush()) is not None:
                events.append((clock(), last))
            return HttpReply(response.status, reply_headers, b"", tuple(events))
        chunks: list[bytes] = []
        size = 0
        while size < MAX_BODY_BYTES:
            arm()
            chunk = response.read1(65536)  # read1: returns what arrived, so a trickle cannot stall us
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return HttpReply(response.status, reply_headers, b"".join(chunks))
    except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError) as error:
        raise ConnectionRefusedOrReset(type(error).__name__) from error
    except TimeoutError as error:
        raise DeadlineExceeded() from error
    finally:
        connection.close()


class SseDecoder:
    """Incremental server-sent-events parser: feed lines, get each event's data when it completes."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if line == "":
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # comments, event:, id:, retry: lines carry nothing we use

    def flush(self) -> str | None:
        """The last event when the stream ended without a blank line."""
        return self.feed_line("")


def sse_payloads(lines: Iterable[str]) -> list[str]:
    """Every event's data from a whole stream's lines."""
    decoder = SseDecoder()
    payloads = [data for line in lines if (data := decoder.feed_line(line)) is not None]
    if (last := decoder.flush()) is not None:
        payloads.append(last)
    return payloads
