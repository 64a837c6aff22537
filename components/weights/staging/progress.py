"""The progress lines on stderr: bytes, rate, ETA, streams and files, from every download's thread.

Part of the staging program (components/weights/staging/main.py), which runs on the head node.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# A progress line every PROGRESS_EVERY_S, every PROGRESS_LATER_EVERY_S after PROGRESS_LATER_AFTER_S: the lines
# are the command's stderr, which the stack's state keeps (hours of 5 s lines would be thousands).
PROGRESS_EVERY_S = 5.0
PROGRESS_LATER_AFTER_S = 600.0
PROGRESS_LATER_EVERY_S = 30.0
# The rate shown is over this window: recent enough to follow the link, long enough not to jump per chunk.
RATE_WINDOW_S = 30.0


def progress_interval(elapsed_s: float) -> float:
    """Seconds to the next progress line, `elapsed_s` into the downloads."""
    return PROGRESS_EVERY_S if elapsed_s < PROGRESS_LATER_AFTER_S else PROGRESS_LATER_EVERY_S


def _unit(n: float) -> tuple[float, str]:
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB")):
        if n >= scale:
            return float(scale), name
    return 1024.0, "KiB"


def format_rate(bytes_per_s: float) -> str:
    scale, name = _unit(bytes_per_s)
    value = bytes_per_s / scale
    return f"{value:.0f} {name}/s" if value >= 100 else f"{value:.1f} {name}/s"


def format_duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_progress(
    *,
    done_bytes: int,
    total_bytes: int,
    rate: float,
    active: int,
    streams: int,
    files_done: int,
    files_total: int,
    elapsed_s: float | None = None,
) -> str:
    """The progress line (without the `stage_weights: ` prefix). Sizes in the total's unit; the ETA from `rate`.
    `elapsed_s` given: the run's last line, with the time taken (and the average rate) instead of an ETA."""
    scale, name = _unit(total_bytes)
    pct = 100.0 * done_bytes / total_bytes if total_bytes else 100.0
    left = max(total_bytes - done_bytes, 0)
    if elapsed_s is not None:
        when = f"took {format_duration(elapsed_s)}"
    elif left == 0:
        when = "ETA 0s"
    else:
        when = f"ETA {format_duration(left / rate)}" if rate > 0 else "ETA -"
    return (
        f"progress {done_bytes / scale:.1f}/{total_bytes / scale:.1f} {name} ({pct:.1f}%), {format_rate(rate)}, "
        f"{when}, {active}/{streams} streams, {files_done}/{files_total} files"
    )


@dataclass
class Progress:
    """The run's bytes and files: those present at the start, finished, and on disk so far of the ones in flight.

    `received` (bytes the hub sent in this run) makes the rate; a file already present or hashed in place counts
    as done but not towards the rate. Every method may be called from any download's thread."""

    total_bytes: int
    total_files: int
    streams: int
    clock: Callable[[], float] = time.monotonic
    done_bytes: int = 0
    received: int = 0
    files_done: int = 0
    active: int = 0
    began: float = field(init=False)
    _samples: deque[tuple[float, int]] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.began = self.clock()
        self._samples = deque([(self.began, 0)])

    def add(self, *, done: int = 0, received: int = 0, files: int = 0, active: int = 0) -> int:
        with self._lock:
            self.done_bytes += done
            self.received += received
            self.files_done += files
            self.active += active
            return self.files_done

    def present(self, size: int) -> int:
        """A file kept as it is; returns how many files are done."""
        return self.add(done=size, files=1)

    def start(self) -> Transfer:
        self.add(active=1)
        return Transfer(self)

    def rate(self, now: float) -> float:
        """Bytes per second received over the last RATE_WINDOW_S (since the start, before that)."""
        with self._lock:
            received = self.received
        self._samples.append((now, received))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, r0 = self._samples[0]
        return (received - r0) / (now - t0) if now > t0 else 0.0

    def line(self, *, final: bool = False) -> str:
        """The progress line now; `final`: the run's last, with its time and average rate."""
        now = self.clock()
        elapsed = now - self.began
        average = self.received / elapsed if elapsed > 0 else 0.0
        rate = average if final else self.rate(now)
        with self._lock:
            return format_progress(
                done_bytes=self.done_bytes,
                total_bytes=self.total_bytes,
                rate=rate,
                active=self.active,
                streams=self.streams,
                files_done=self.files_done,
                files_total=self.total_files,
                elapsed_s=elapsed if final else None,
            )


class Transfer:
    """One file's share of the progress: the bytes of it on disk so far, until it is done or abandoned."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._counted = 0

    def kept(self, n: int) -> None:
        """`n` bytes an earlier run downloaded (not received now)."""
        self._counted += n
        self._progress.add(done=n)

    def wrote(self, n: int) -> None:
        self._counted += n
        self._progress.add(done=n, received=n)

    def restart(self) -> None:
        self._progress.add(done=-self._counted)
        self._counted = 0

    def finish(self, size: int) -> int:
        """The file is in place: it counts whole. Returns how many files are done."""
        done = self._progress.add(done=size - self._counted, files=1, active=-1)
        self._counted = size
        return done

    def abandon(self) -> None:
        self._progress.add(done=-self._counted, active=-1)
        self._counted = 0
