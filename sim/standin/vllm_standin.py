#!/usr/bin/env python3
"""Stand-in for the recipe image's `vllm serve` (vLLM 0.33) in the simulated cluster.

Stdlib only: the image carries Debian's python3 and nothing else. It behaves like vLLM at every
point the program touches: the CLI and its argparse errors, the log lines the gates read, a real
TCP rendezvous between the ranks, the checkpoint files read from the mounts, and the OpenAI API
the verifier judges. The "model" is tiny and deterministic: its numbers come from the weight
files' bytes, and for every token the head adds partial logits that each worker computes over
the rendezvous connection, so a dead worker hangs completions exactly as a lost rank does.

Environment knobs (see README.md): SIM_FAULT, SIM_FAULT_FILE, SIM_LOAD_SECONDS, SIM_WORKER_LOAD_SECONDS,
SIM_ENGRAM_INDEX, SIM_GRAPH_SECONDS, SIM_DECODE_TOKENS_PER_SECOND, SIM_RENDEZVOUS_TIMEOUT_S, and vLLM's own
VLLM_API_KEY, VLLM_HOST_IP, VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS.

This file is the entry point the image's `vllm` runs (`python3 /opt/standin/vllm_standin.py serve ...`); the
stand-in itself is the package `standin/` beside it (its __init__ lists the modules).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

# The package `standin/` sits beside this file: python3 puts this file's directory first on sys.path when it runs
# the file (the image's `vllm`, a checkout's sim/standin/vllm); this does the same for a load by path
# (tests/sim/test_standin.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))

if TYPE_CHECKING:  # mypy reads sim/ as one tree, where the package beside this file is sim.standin.standin
    from sim.standin.standin.cli import FLAGS, UsageError, args_line, parse_serve_args
    from sim.standin.standin.faults import exhaust_memory, memory_limit_bytes
    from sim.standin.standin.serve import main, serve
else:
    from standin.cli import FLAGS, UsageError, args_line, parse_serve_args
    from standin.faults import exhaust_memory, memory_limit_bytes
    from standin.serve import main, serve

# The entry points, and what the stand-in's tests (tests/sim/test_standin.py) reach as `standin.<name>`.
__all__ = [
    "main",
    "serve",
    "FLAGS",
    "UsageError",
    "args_line",
    "exhaust_memory",
    "memory_limit_bytes",
    "parse_serve_args",
]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
