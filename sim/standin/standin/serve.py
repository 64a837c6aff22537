"""The vLLM stand-in's `vllm serve`: the boot of one rank as vLLM logs it (the banner, the engine's config, the
rendezvous, the checkpoint, KV cache and CUDA graph lines, the API server binding its port early and listening
once ready), the head's and a worker's SIGTERM, the checks vLLM makes before it starts, and `main`: the `vllm`
command line's top level. Stdlib only, as the whole stand-in (sim/standin/README.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import BinaryIO, NoReturn

from .api import Api, log_engine_stats, make_handler
from .checkpoint import LoadFailure, load_checkpoint
from .cli import (
    EXIT_USAGE,
    FLAGS,
    PROG,
    SERVE_USAGE,
    TOP_USAGE,
    ServeArgs,
    UsageError,
    args_line,
    parse_serve_args,
)
from .engine import Engine
from .faults import SimEnv
from .log import (
    ENGINE_DEAD_MESSAGE,
    EXIT_FAILURE,
    EXIT_STOPPED,
    LOG,
    VLLM_VERSION,
    die,
    sleep_forever,
    worker_name,
)
from .rendezvous import WorkerLink, host_rendezvous, join_rendezvous, send_message, serve_steps, tcp_address

NCCL_VERSION = "2.27.3"
BANNER = (
    "",
    "       █     █     █▄   ▄█",
    " ▄▄ ▄█ █     █     █ ▀▄▀ █  version {version}",
    "  █▄█▀ █     █     █     █  model   {model}",
    "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀",
    "",
)


# ---------------------------------------------------------------------------------------------
# The serve command


# What SIGTERM does depends on who we are and what we are doing: set by serve().
_ROLE = {"headless": False, "loading": False}


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if signum != signal.SIGTERM:
        die(130)
    if _ROLE["headless"]:
        if _ROLE["loading"]:
            return  # busy in the loader: the stop ends in docker's SIGKILL
        die(EXIT_STOPPED)
    threading.Thread(target=_head_shutdown, daemon=True).start()  # not in the handler: LOG takes a lock


def _head_shutdown() -> None:
    """The head's SIGTERM, as recorded: uvicorn shuts down, the engine client dies with it, exit 0."""
    LOG("APIServer", "launcher.py:254", "[shutdown] API server: shutdown triggered")
    LOG.raw("INFO:     Shutting down")
    LOG("APIServer", "async_llm.py:906", "AsyncLLM output_handler failed.", "ERROR")
    LOG.traceback([], f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}")
    LOG.raw("INFO:     Waiting for application shutdown.")
    LOG.raw("INFO:     Application shutdown complete.")
    die(EXIT_STOPPED)


def _kv_lines(args: ServeArgs, max_model_len: int) -> tuple[str, str]:
    kv_bytes = int(args.get("--kv-cache-memory-bytes", 2_684_354_560))
    tokens = kv_bytes // 2048  # bytes per token of this model's fp8_ds_mla cache
    return (
        f"Available KV cache memory: {kv_bytes / 2**30:.2f} GiB",
        f"GPU KV cache size: {tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per "
        f"request: {tokens / max_model_len:.2f}x",
    )


def _graph_lines(args: ServeArgs, env: SimEnv, who: str) -> None:
    if args.enforce_eager:
        return
    sizes = len(args.get("--cudagraph-capture-sizes") or range(67))
    if args.node_rank == 0:  # the bar is the global first rank's alone (is_global_first_rank)
        LOG.raw(
            f"({who} pid={os.getpid()}) Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|"
            f"██████████| {sizes}/{sizes} [00:02<00:00,  3.90it/s]"
        )
    time.sleep(env.graph_seconds)
    LOG(who, "gpu_model_runner.py:3900", f"Graph capturing finished in {env.graph_seconds:g} secs, took 0.12 GiB")


def _validate(args: ServeArgs) -> str | None:
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        return f"ValueError: --node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})"
    if args.world_size < args.nnodes or args.world_size % args.nnodes:
        return (
            f"ValueError: world size {args.world_size} (tensor x pipeline parallel) must be a multiple of "
            f"--nnodes {args.nnodes}: each node runs the same number of ranks"
        )
    if args.nnodes > 1 and args.get("--distributed-executor-backend", "mp") != "mp":
        return "ValueError: the vLLM stand-in runs multi-node only with --distributed-executor-backend mp"
    if args.node_rank == 0 and args.get("--headless"):
        return "ValueError: --headless is for the worker nodes (--node-rank > 0); node rank 0 serves the API"
    template = args.get("--chat-template")
    if template and not args.is_worker:
        # vLLM's load_chat_template: a path-like value must open, or the API server does not start.
        try:
            with open(template, encoding="utf-8") as f:
                f.read()
        except OSError as err:
            if not any(c in template for c in "{}\n"):
                return (
                    f"ValueError: The supplied chat template ({template}) looks like a file path, but it "
                    f"failed to be opened. Reason: {err}"
                )
    return None


def serve(args: ServeArgs, env: SimEnv) -> NoReturn:
    start = time.monotonic()
    local_world = args.world_size // max(args.nnodes, 1)
    local_ranks = [args.node_rank * local_world + i for i in range(local_world)]
    api_key = env.api_key or args.get("--api-key")
    headless = args.is_worker
    _ROLE["headless"] = headless
    if not headless:  # the API server's line: a headless worker prints none (fixtures/real-vllm/boot)
        LOG("APIServer", "api_utils.py:286", args_line(args))
    if headless:
        LOG(
            None,
            "api_server.py:1869",
            f"Launching vLLM (v{VLLM_VERSION}) headless multiproc executor, with head "
            f"node address {args.master_addr} for torch.distributed process group.",
        )
    else:
        for text in BANNER:  # vLLM 0.32's start banner (api_utils.py), as recorded
            LOG("APIServer", "api_utils.py:347", text.format(version=VLLM_VERSION, model=args.model))
    httpd: ThreadingHTTPServer | None = None
    if not headless:
        # vLLM binds the API socket before the engine starts and listens only once it is ready:
        # until then a client gets connection refused.
        httpd = ThreadingHTTPServer(
            (args.get("--host") or "0.0.0.0", int(args.get("--port", 8000))),
            BaseHTTPRequestHandler,
            bind_and_activate=False,
        )
        httpd.daemon_threads = True
        try:
            httpd.server_bind()
        except OSError as err:
            LOG.traceback(
                [],
                f"OSError: [Errno {err.errno}] {err.strerror}: {args.get('--host') or '0.0.0.0'}:"
                f"{args.get('--port', 8000)} (--host/--port)",
            )
            die(EXIT_FAILURE)
        LOG(
            "EngineCore_DP0",
            "core.py:93",
            f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: "
            f"model={args.model!r}, quantization={args.get('--quantization')}, tensor_parallel_size="
            f"{args.get('--tensor-parallel-size', 1)}, served_model_name={args.served_model_names[0]}, "
            f"enforce_eager={args.enforce_eager}, "
            f"enable_prefix_caching={args.switch('enable-prefix-caching')}",
        )
        if args.nnodes > 1:
            LOG(
                "EngineCore",
                "multiproc_executor.py:153",
                f"DP group leader: node_rank=0, node_rank_within_dp=0, master_addr={args.master_addr}, "
                f"mq_connect_ip={args.master_addr} (local), world_size={args.world_size}, "
                f"local_world_size={local_world}",
            )
    init = f"tcp://{tcp_address(args.master_addr, args.master_port)}"
    for rank in local_ranks:
        LOG(
            worker_name(rank),
            "parallel_state.py:1208",
            f"world_size={args.world_size} rank={rank} "
            f"local_rank={rank - local_ranks[0]} distributed_init_method={init} backend=nccl",
        )
    links: list[WorkerLink] = []
    head_link: tuple[socket.socket, BinaryIO] | None = None
    if args.nnodes > 1:
        if headless:
            if env.fault == "rank-never-joins":
                sleep_forever()  # alive, never connects: the head's store times out
            head_link = join_rendezvous(args, env)
        else:
            links = host_rendezvous(args, env)
    ep = args.switch("enable-expert-parallel")
    for rank in local_ranks:
        # Printed once per process after the group formed (vLLM 0.32 wording, fixtures/real-vllm/boot).
        LOG(
            "Worker",
            "parallel_state.py:2350",
            f"rank {rank} in world size {args.world_size} is assigned as DP rank 0, PP rank 0, PCP rank 0, "
            f"TP rank {rank}, ETP rank {rank}, EP rank {rank if ep else 'N/A'}, EPLB rank N/A",
        )
        if rank == 0:  # pynccl's version line: rank 0 only (hardware only: the CPU build has no NCCL)
            LOG(worker_name(rank), "pynccl.py:103", f"vLLM is using nccl=={NCCL_VERSION}")
    who = worker_name(local_ranks[0])
    _ROLE["loading"] = True
    try:
        weights = load_checkpoint(args, env, who)
    except (OSError, LoadFailure) as err:
        final = (
            f"FileNotFoundError: {err}"
            if isinstance(err, FileNotFoundError)
            else (str(err) if isinstance(err, LoadFailure) else f"{type(err).__name__}: {err}")
        )
        LOG(who, "multiproc_executor.py:671", "WorkerProc failed to start.", "ERROR")
        LOG.traceback(
            [
                '  File "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/model_loader/'
                'weight_utils.py", line 612, in safetensors_weights_iterator',
                '    with safe_open(st_file, framework="pt") as f:',
            ],
            final,
        )
        if not headless:
            LOG("EngineCore_DP0", "core.py:708", "EngineCore failed to start.", "ERROR")
            LOG.traceback(
                [],
                "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            )
        die(EXIT_FAILURE)
    _ROLE["loading"] = False
    if env.fault == "stall-after-load":
        sleep_forever()
    max_model_len = int(args.get("--max-model-len") or _config_max_len(Path(args.model)))
    available, kv_size = _kv_lines(args, max_model_len)
    LOG(who, "gpu_worker.py:390", available)
    if head_link is not None:
        _graph_lines(args, env, who)
        send_message(head_link[0], {"op": "ready"})
        if env.fault == "worker-exit-after-load":
            LOG(who, "multiproc_executor.py:702", "WorkerProc hit an exception.", "ERROR")
            LOG.traceback(
                [
                    '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/gpu_worker.py", '
                    "line 512, in execute_model"
                ],
                "RuntimeError: CUDA error: unspecified launch failure",
            )
            die(EXIT_FAILURE)
        serve_steps(head_link[0], head_link[1], weights, local_ranks, env.fault == "nan-logits", who, env.fault_file)
    for link in links:  # profiling and KV allocation are collective: wait for every worker
        while not link.ready.wait(1.0):
            pass
    LOG("EngineCore_DP0", "kv_cache_utils.py:1087", kv_size)
    _graph_lines(args, env, who)
    LOG(
        "EngineCore_DP0",
        "core.py:250",
        f"init engine (profile, create kv cache, warmup model) took {time.monotonic() - start:.2f} s",
    )
    assert httpd is not None
    engine = Engine(weights, local_ranks, links, env, args.served_model_names)
    api = Api(engine=engine, args=args, max_model_len=max_model_len, api_key=api_key)
    httpd.RequestHandlerClass = make_handler(api)
    host, port = args.get("--host") or "0.0.0.0", int(args.get("--port", 8000))
    LOG("APIServer", "api_server.py:1935", f"Starting vLLM server on http://{tcp_address(host, port)}")
    LOG("APIServer", "launcher.py:37", "Available routes are:")
    for route, methods in (
        ("/health", "GET"),
        ("/v1/models", "GET"),
        ("/version", "GET"),
        ("/v1/chat/completions", "POST"),
        ("/metrics", "GET"),
    ):
        LOG("APIServer", "launcher.py:45", f"Route: {route}, Methods: {methods}")
    httpd.server_activate()
    pid = os.getpid()
    for text in (
        f"Started server process [{pid}]",
        "Waiting for application startup.",
        "Application startup complete.",
    ):
        LOG.raw(f"INFO:     {text}")  # uvicorn's own lines carry no vLLM prefix
    threading.Thread(target=log_engine_stats, args=(engine,), daemon=True).start()
    httpd.serve_forever(poll_interval=0.2)
    die(0)


def _config_max_len(model_dir: Path) -> int:
    try:
        return int(json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 163840))
    except (OSError, ValueError, TypeError, AttributeError):
        return 163840


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(TOP_USAGE)
        return 0 if argv else EXIT_USAGE
    if argv[0] in ("-v", "--version"):
        print(VLLM_VERSION)
        return 0
    if argv[0] != "serve":
        print(TOP_USAGE, file=sys.stderr)
        print(
            f"vllm: error: argument subparser: invalid choice: {argv[0]!r} (choose from 'chat', 'complete', "
            "'serve', 'bench', 'collect-env', 'run-batch')",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if any(a in ("-h", "--help") for a in argv[1:]):
        print(SERVE_USAGE)
        print("\nflags known to this vLLM stand-in:\n  " + "\n  ".join(sorted(FLAGS)))
        return 0
    try:
        args = parse_serve_args(argv[1:])
    except UsageError as err:
        print(SERVE_USAGE, file=sys.stderr)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        env = SimEnv.from_environ(os.environ)
    except ValueError as err:
        print(f"ERROR: {err}", file=sys.stderr)
        return EXIT_FAILURE
    problem = _validate(args)
    if problem:
        LOG.traceback([], problem)
        return EXIT_FAILURE
    # PID 1 in a container ignores SIGTERM without a handler: docker stop must end us at once.
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    serve(args, env)
