"""The vLLM stand-in's ranks talking over real TCP: the rendezvous on --master-addr:--master-port (node rank 0 hosts it
and waits for every worker, or times out as torch's TCP store does; a worker connects, retrying), then the model
steps as JSON lines over the same connection: the head's `WorkerLink` to each worker, and a headless worker's
`serve_steps`. Stdlib only, as the whole stand-in (sim/standin/README.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, NoReturn

from .cli import ServeArgs
from .faults import DEFAULT_FAULT_FILE, SimEnv, exhaust_memory, runtime_fault
from .log import EXIT_FAILURE, LOG, die, sleep_forever
from .model import VOCAB, partial_logits


def send_message(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tcp_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class WorkerLink:
    """The head's end of one worker's connection: step requests out, partial logits back."""

    def __init__(self, node_rank: int, sock: socket.socket, reader: BinaryIO) -> None:
        self.node_rank = node_rank
        self.sock = sock
        host, port = sock.getpeername()[:2]
        self.peer = f"[{host}]:{port}"  # as gloo names a peer
        self.reader = reader
        self.ready = threading.Event()
        self.closed = False  # the worker's end went away (its process died, the connection reset)
        self._cond = threading.Condition()
        self._results: dict[int, list[float]] = {}

    def start(self) -> None:
        threading.Thread(target=self._read, name=f"link-{self.node_rank}", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.reader:
                message = json.loads(line)
                if message.get("op") == "ready":
                    self.ready.set()
                elif message.get("op") == "result":
                    with self._cond:
                        self._results[int(message["id"])] = [float(x) for x in message["partial"]]
                        self._cond.notify_all()
        except (OSError, ValueError):
            pass
        # A worker that went away is noticed by nobody until the next step needs it, as in vLLM: an idle head
        # prints nothing and /health stays 200 (fixtures/real-vllm/killed-worker).
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def request(self, step_id: int, key: str) -> None:
        with contextlib.suppress(OSError):  # same: the missing reply is what the head notices
            send_message(self.sock, {"op": "step", "id": step_id, "key": key})

    def result(self, step_id: int, deadline: float) -> list[float] | None:
        with self._cond:
            while step_id not in self._results:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self._cond.wait(min(left, 1.0))
            return self._results.pop(step_id)


def _dist_store_timeout(env: SimEnv, joined: int, nnodes: int) -> NoReturn:
    LOG.traceback(
        [
            '  File "/usr/local/lib/python3.12/dist-packages/vllm/distributed/parallel_state.py", line 1221, '
            "in init_distributed_environment",
            "    torch.distributed.init_process_group(",
            '  File "/usr/local/lib/python3.12/dist-packages/torch/distributed/rendezvous.py", line 189, '
            "in _create_c10d_store",
            "    return TCPStore(",
        ],
        f"torch.distributed.DistStoreError: Timed out after {int(env.rendezvous_timeout_s) + 1} seconds "
        f"waiting for clients. {joined}/{nnodes} clients joined.",
    )
    die(EXIT_FAILURE)


def host_rendezvous(args: ServeArgs, env: SimEnv) -> list[WorkerLink]:
    """Node rank 0: the TCP store on master-addr:master-port; wait for every worker, then say go."""
    listener = socket.socket(_family(args.master_addr), socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((args.master_addr, args.master_port))
        listener.listen(16)
    except OSError as err:
        name = errno.errorcode.get(err.errno or 0, "UNKNOWN")
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/torch/distributed/rendezvous.py", line 189, '
                "in _create_c10d_store",
                "    return TCPStore(",
            ],
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
            f"address. port: {args.master_port}, useIPv6: {int(':' in args.master_addr)}, "
            f"code: -{err.errno}, "
            f"name: {name}, message: {err.strerror} (master address {args.master_addr})",
        )
        die(EXIT_FAILURE)
    deadline = time.monotonic() + env.rendezvous_timeout_s
    links: dict[int, WorkerLink] = {}
    while len(links) < args.nnodes - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            _dist_store_timeout(env, 1 + len(links), args.nnodes)
        listener.settimeout(min(left, 1.0))
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(max(min(deadline - time.monotonic(), 10.0), 0.1))
        reader = conn.makefile("rb")
        try:
            hello = json.loads(reader.readline() or b"{}")
        except (OSError, ValueError):
            conn.close()
            continue
        rank = hello.get("node_rank")
        problem = None
        if hello.get("op") != "hello" or not isinstance(rank, int):
            problem = "not a rank of this deployment"
        elif not 0 < rank < args.nnodes or hello.get("nnodes") != args.nnodes:
            problem = f"node rank {rank} of {hello.get('nnodes')} nodes does not fit nnodes={args.nnodes}"
        elif hello.get("world_size") != args.world_size:
            problem = f"world size {hello.get('world_size')} differs from the head's {args.world_size}"
        elif rank in links:
            problem = f"node rank {rank} already joined"
        if problem:
            LOG(
                "EngineCore_DP0",
                "parallel_state.py:1230",
                f"Rejected a rendezvous client: {problem}",
                "WARNING",
            )
            with contextlib.suppress(OSError):
                send_message(conn, {"op": "reject", "reason": problem})
            conn.close()
            continue
        conn.settimeout(None)
        links[rank] = WorkerLink(rank, conn, reader)
    listener.close()  # the group is formed: a late or stale rank gets connection refused
    for link in links.values():
        send_message(link.sock, {"op": "go"})
        link.start()
    return [links[r] for r in sorted(links)]


def join_rendezvous(args: ServeArgs, env: SimEnv) -> tuple[socket.socket, BinaryIO]:
    """A worker: connect to the master (retrying while it is not up yet), say our rank, wait for go."""
    deadline = time.monotonic() + env.rendezvous_timeout_s
    master = (args.master_addr, args.master_port)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            LOG.traceback(
                [
                    '  File "/usr/local/lib/python3.12/dist-packages/torch/distributed/rendezvous.py", '
                    "line 189, "
                    "in _create_c10d_store",
                    "    return TCPStore(",
                ],
                f"torch.distributed.DistNetworkError: The client socket has timed out after "
                f"{int(env.rendezvous_timeout_s * 1000)}ms while trying to connect to "
                f"({args.master_addr}, {args.master_port}).",
            )
            die(EXIT_FAILURE)
        sock = socket.socket(_family(args.master_addr), socket.SOCK_STREAM)
        if env.host_ip:
            try:
                sock.bind((env.host_ip, 0))  # NCCL/gloo bind to VLLM_HOST_IP: a wrong one fails here too
            except OSError as err:
                LOG.traceback(
                    [],
                    f"RuntimeError: cannot bind to VLLM_HOST_IP={env.host_ip}: {err.strerror}; "
                    "set VLLM_HOST_IP to an address of this node",
                )
                die(EXIT_FAILURE)
        sock.settimeout(min(left, 5.0))
        try:
            sock.connect(master)
            break
        except OSError:
            sock.close()
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
    sock.settimeout(None)
    send_message(
        sock,
        {"op": "hello", "node_rank": args.node_rank, "nnodes": args.nnodes, "world_size": args.world_size},
    )
    reader: BinaryIO = sock.makefile("rb")
    reply = reader.readline()
    try:
        message = json.loads(reply) if reply else {}
    except ValueError:
        message = {}
    if message.get("op") != "go":
        reason = message.get("reason") or "the master closed the connection before the group formed"
        LOG.traceback([], f"torch.distributed.DistStoreError: rendezvous with {tcp_address(*master)} failed: {reason}")
        die(EXIT_FAILURE)
    return sock, reader


def serve_steps(
    sock: socket.socket,
    reader: BinaryIO,
    weights: bytes,
    ranks: Sequence[int],
    nan: bool,
    who: str,
    fault_file: str = DEFAULT_FAULT_FILE,
) -> NoReturn:
    """A headless worker from now on: compute its share of each model step the head sends."""
    for line in reader:
        message = json.loads(line)
        if message.get("op") == "step":
            if runtime_fault(fault_file) == "oom":
                exhaust_memory(fault_file, who)
            key = str(message["key"])
            total = [0.0] * len(VOCAB)
            for rank in ranks:
                total = [a + b for a, b in zip(total, partial_logits(weights, rank, key, nan), strict=True)]
            send_message(sock, {"op": "result", "id": message["id"], "partial": total})
    # Real vLLM (fixtures/real-vllm/killed-head): a worker whose head died stays alive and prints nothing.
    sleep_forever()
