"""The supervisor agent's HTTP API (shipped with agent.py): bounded connections per client and in all, idle ones
dropped, every route behind the bearer token; a worker's agent acts on its own rank only, the leader's also serves
the status, pause and resume, and the update lock."""

from __future__ import annotations

import contextlib
import hmac
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from components.supervisor import policy
from components.supervisor.agent_config import AgentConfig
from components.supervisor.node_docker import Docker, rank_get, rank_state, stop_rank

if TYPE_CHECKING:
    from components.supervisor.agent import Leader


# --- the HTTP API -------------------------------------------------------------------------------------------


# Before any token is checked, a connection costs a thread in a 256 MiB container that also runs the memory
# guard: at most this many at once from one address, this many in all, and each silent for at most this long.
MAX_CONNECTIONS_PER_CLIENT = 8
MAX_CONNECTIONS = 48
READ_TIMEOUT_S = 10.0
# Linux's IP_FREEBIND (the socket module names it from Python 3.12 on): bind an address the node does not hold yet.
IP_FREEBIND = int(getattr(socket, "IP_FREEBIND", 15))


class AgentServer(ThreadingHTTPServer):
    """The agent's API server: connections counted per client address and in all at accept time, refused (503,
    nothing read) beyond either bound, so one client cannot starve the others. A second listener of the same
    agent (`sharing`) counts into the first's bounds."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        per_client: int = MAX_CONNECTIONS_PER_CLIENT,
        total: int = MAX_CONNECTIONS,
        sharing: AgentServer | None = None,
        freebind: bool = False,
    ) -> None:
        self.per_client: int = sharing.per_client if sharing else per_client
        self.total: int = sharing.total if sharing else total
        self.open: dict[str, int] = sharing.open if sharing else {}
        self.counting: threading.Lock = sharing.counting if sharing else threading.Lock()
        self.freebind = freebind
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.freebind:
            # Best effort: without it a missing address fails the bind, and docker restarts the agent.
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        super().server_bind()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        client = str(client_address[0])
        with self.counting:
            if self.open.get(client, 0) >= self.per_client or sum(self.open.values()) >= self.total:
                full = True
            else:
                full = False
                self.open[client] = self.open.get(client, 0) + 1
        if full:
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        return not full

    def _done(self, client_address: Any) -> None:
        client = str(client_address[0])
        with self.counting:
            left = self.open.get(client, 1) - 1
            if left > 0:
                self.open[client] = left
            else:
                self.open.pop(client, None)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(client_address)  # no thread started: it cannot count itself out
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(client_address)


def listen(hosts: list[str], port: int, handler: type[BaseHTTPRequestHandler]) -> list[AgentServer]:
    """One server per address, all counting into the first's bounds. The first (the fabric address) is bound as
    it must be: a failure ends the agent and docker restarts it. The others (the head's address as the operator's
    machine resolved it) may come up after docker starts this container at boot (DHCP, Tailscale): bound with
    IP_FREEBIND they answer once the address is there, and meanwhile the leader heals over the fabric instead
    of restarting until the LAN is up. The head's preflight checked that the address is the head's own."""
    first = AgentServer((hosts[0], port), handler)
    return [first, *(AgentServer((h, port), handler, sharing=first, freebind=True) for h in hosts[1:])]


def make_handler(cfg: AgentConfig, docker: Docker, token: str, leader: Leader | None) -> type:
    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # every receive and send: a connection that says nothing is dropped

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass

        def _reply(self, status: int, data: Any) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            self._reply(401, {"error": "a bearer token is required"})
            return False

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            if length > 65536:
                raise ValueError("body too large")
            data = json.loads(self.rfile.read(length) or b"{}")
            return data if isinstance(data, dict) else {}

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if not self._authorized():
                return
            if self.path.startswith("/rank"):
                try:
                    answer = rank_get(docker, cfg.container, cfg.node, self.path)
                except ValueError as error:
                    self._reply(400, {"error": str(error)})
                    return
                except OSError as error:
                    self._reply(502, {"error": str(error)})
                    return
                if answer is None:
                    self._reply(404, {"error": f"no {self.path}"})
                else:
                    self._reply(200, answer)
            elif self.path == "/status" and leader is not None:
                self._reply(
                    200,
                    {
                        **leader.store.snapshot(),
                        "lock_holder": leader.lock_holder(),
                        "node": cfg.node,
                        "now": time.time(),
                    },
                )
            else:
                self._reply(404, {"error": f"no {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            try:
                body = self._body()
                if self.path == "/rank/stop":
                    stop_rank(docker, cfg.container)
                    self._reply(200, rank_state(docker, cfg.container, cfg.node))
                elif self.path == "/rank/start":
                    docker.act(cfg.container, "start")
                    self._reply(200, rank_state(docker, cfg.container, cfg.node))
                elif leader is not None and self.path in ("/pause", "/resume"):
                    paused = self.path == "/pause"
                    # resume also clears a give-up: the operator says the cause is fixed
                    leader.store.update(
                        paused=paused, **({} if paused else {"given_up": None, "budget_since": time.time()})
                    )
                    leader.notify("paused" if paused else "resumed")
                    self._reply(200, {"paused": paused})
                elif leader is not None and self.path == "/lock":
                    holder = str(body.get("holder") or "")[:200]
                    if not holder:
                        self._reply(400, {"error": "a lock names its holder"})
                        return
                    ttl = max(1.0, min(float(body.get("ttl_s", 120)), 3600.0))
                    with leader.lease:  # one take at a time: check and set as one step
                        lock, refused_by = policy.take_lock(
                            leader.store.snapshot().get("lock"),
                            holder,
                            ttl,
                            time.time(),
                            takeover=str(body.get("takeover") or ""),
                        )
                        if lock is not None:
                            leader.store.update(lock=lock)
                    if lock is None:
                        self._reply(409, {"error": f"the lock is held by {refused_by}", "holder": refused_by})
                    else:
                        self._reply(200, lock)
                else:
                    self._reply(404, {"error": f"no {self.path}"})
            except (OSError, ValueError) as error:
                self._reply(500, {"error": str(error)})

        def do_DELETE(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            if leader is not None and self.path == "/lock":
                holder = str(self._body().get("holder") or "")
                with leader.lease:
                    mine = bool(holder) and policy.release_lock(
                        leader.store.snapshot().get("lock"), holder, time.time()
                    )
                    if mine:
                        leader.store.update(lock=None)
                if mine:
                    self._reply(200, {"released": True})
                else:
                    self._reply(409, {"error": "only the lock's holder releases it (name it)", "released": False})
            else:
                self._reply(404, {"error": f"no {self.path}"})

    return Handler
