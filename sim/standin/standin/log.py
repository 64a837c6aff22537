"""The vLLM stand-in's output and ends: vLLM's log line format, one flushed line at a time (`Log`, `LOG`, a rank's
`worker_name`), the vLLM version it plays, the engine's death message, and how the process ends (its exit codes,
`die`, `sleep_forever`). Stdlib only, as the whole stand-in (sim/standin/README.md).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from typing import BinaryIO, NoReturn

VLLM_VERSION = "0.33.0"
EXIT_FAILURE = 1
# Real vLLM 0.32 (tests/support/fixtures/real-vllm/stopped-*): the head and a headless worker stopped by SIGTERM
# shut down and exit 0; a worker loading weights does not return to Python to run the handler, so a stop then
# ends in docker's SIGKILL (137).
EXIT_STOPPED = 0
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


# ---------------------------------------------------------------------------------------------
# Logging: vLLM's format, one flushed line at a time (docker logs reads them as they come).


class Log:
    def __init__(self, out: BinaryIO | None = None, err: BinaryIO | None = None) -> None:
        self._out = out or sys.stdout.buffer
        self._err = err or sys.stderr.buffer
        self._lock = threading.Lock()

    def raw(self, text: str, *, to_stderr: bool = False) -> None:
        stream = self._err if to_stderr else self._out
        with self._lock:
            stream.write((text + "\n").encode("utf-8", "replace"))
            stream.flush()

    def __call__(self, who: str | None, src: str, msg: str, level: str = "INFO") -> None:
        prefix = f"({who} pid={os.getpid()}) " if who else ""
        self.raw(f"{prefix}{level} {datetime.now():%m-%d %H:%M:%S} [{src}] {msg}")

    def traceback(self, frames: Sequence[str], final: str) -> None:
        """A Python traceback on stderr, as an uncaught exception leaves it."""
        lines = ["Traceback (most recent call last):", *frames, final]
        for line in lines:
            self.raw(line, to_stderr=True)


LOG = Log()


def worker_name(rank: int) -> str:
    return f"Worker_TP{rank}"


def die(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def sleep_forever() -> NoReturn:
    while True:
        time.sleep(3600)
