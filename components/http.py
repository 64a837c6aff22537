"""The program's one HTTP client: a request bounded by a deadline over connect and read, and SSE framing.

`requests` (the design card's client) with the body streamed, and every socket wait re-armed with the time
left before the deadline: a server that trickles bytes cannot stretch a request past it (requests' own
timeout bounds each read, not the request). No proxies from the environment: the endpoints are the nodes'
own ports. Streamed events carry their arrival time, which the decode-speed measurement needs.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import requests

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


def _causes(error: BaseException) -> Iterator[BaseException]:
    """The error and what it wraps (requests wraps urllib3's errors, which wrap the socket's)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None)]
        todo += [a for a in e.args if isinstance(a, BaseException)]


def _translate(error: requests.RequestException) -> Exception:
    """A refused or reset connection and a timeout as their own kinds; anything else stays an OSError
    (requests' errors are OSErrors)."""
    for cause in _causes(error):
        if isinstance(cause, ConnectionRefusedError | ConnectionResetError | BrokenPipeError):
            return ConnectionRefusedOrReset(type(cause).__name__)
    for cause in _causes(error):
        if isinstance(cause, TimeoutError | socket.timeout | requests.Timeout):
            return DeadlineExceeded()
    return error


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

    Raises ConnectionRefusedOrReset, DeadlineExceeded, or an OSError (`requests.RequestException`: not HTTP,
    no route, a bad name, ...). The body is cut at MAX_BODY_BYTES.
    """
    remaining = deadline - clock()
    if remaining <= 0:
        raise DeadlineExceeded()
    with requests.Session() as session:
        session.trust_env = False  # no HTTP(S)_PROXY, no .netrc: the endpoints are the nodes' own ports
        try:
            response = session.request(
                method,
                url,
                data=body,
                # The body is read raw (read1, below), never decoded: ask for it uncompressed (Prometheus'
                # API gzips for requests' default `Accept-Encoding: gzip, deflate`).
                headers={"Accept-Encoding": "identity", **(headers or {})},
                stream=True,
                timeout=(remaining, remaining),
                allow_redirects=False,
            )
        except requests.RequestException as error:
            raise _translate(error) from error
        with response:
            connection = getattr(response.raw, "connection", None)
            sock = getattr(connection, "sock", None)  # the socket every later read waits on

            def arm() -> None:
                left = deadline - clock()
                if left <= 0:
                    raise DeadlineExceeded()
                if sock is not None:
                    sock.settimeout(left)

            reply_headers = {key.lower(): value for key, value in response.headers.items()}
            # What arrived, as it arrives (read1: no waiting for a full buffer), so a trickle cannot stall us.
            chunks = iter(lambda: response.raw.read1(65536), b"")
            try:
                if stream and response.status_code == 200:
                    return HttpReply(response.status_code, reply_headers, b"", _events(chunks, arm, clock))
                body_chunks: list[bytes] = []
                size = 0
                while size < MAX_BODY_BYTES:
                    arm()
                    chunk = next(chunks, b"")
                    if not chunk:
                        break
                    body_chunks.append(chunk)
                    size += len(chunk)
                return HttpReply(response.status_code, reply_headers, b"".join(body_chunks))
            except requests.RequestException as error:
                raise _translate(error) from error


def _events(chunks: Iterator[bytes], arm: Callable[[], None], clock: Clock) -> tuple[tuple[float, str], ...]:
    """SSE payloads from a streamed body, each with the time its last byte arrived; stops at `[DONE]`."""
    events: list[tuple[float, str]] = []
    decoder = SseDecoder()
    pending = b""
    while True:
        arm()
        chunk = next(chunks, b"")
        if not chunk:
            break
        pending += chunk
        if len(pending) > MAX_LINE_BYTES and b"\n" not in pending:
            pending = pending[-MAX_LINE_BYTES:]
        *lines, pending = pending.split(b"\n")
        now = clock()
        for line in lines:
            data = decoder.feed_line(line.decode("utf-8", errors="replace"))
            if data is not None:
                events.append((now, data))
                if data.strip() == "[DONE]":
                    return tuple(events)
    if pending:
        decoder.feed_line(pending.decode("utf-8", errors="replace"))
    if (last := decoder.flush()) is not None:
        events.append((clock(), last))
    return tuple(events)


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
