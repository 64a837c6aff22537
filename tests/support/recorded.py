"""Real vLLM as `make record-real` recorded it (tests/support/fixtures/real-vllm), read for the tests.

A log line's message is what follows vLLM's prefix (`(APIServer pid=1) INFO 12-02 22:55:29 [entry.py:140] `)
or uvicorn's (`INFO:     `); `normalized` replaces what differs between any two runs (numbers, addresses,
paths, ids) so a stand-in line and a recorded line of the same kind compare equal as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real-vllm"

_VLLM = re.compile(
    r"^(?:\((?P<who>[\w.-]+) pid=\d+\) )?(?P<level>INFO|WARNING|ERROR|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d "
    r"\[(?P<src>[\w.]+):\d+\] (?P<msg>.*)$",
    re.DOTALL,
)
_UVICORN = re.compile(r"^(?P<level>INFO|WARNING|ERROR):     (?P<msg>.*)$", re.DOTALL)
_BARE_PREFIX = re.compile(r"^\((?P<who>[\w.-]+) pid=\d+\) (?P<msg>.*)$", re.DOTALL)

_SUBSTITUTIONS = (
    (re.compile(r"\bhttps?://\S+"), "<url>"),
    (re.compile(r"\[?\b\d{1,3}(?:\.\d{1,3}){3}\]?(?::\d+)?"), "<addr>"),
    (re.compile(r"(?:/[\w.@+-]+)+/?"), "<path>"),
    (re.compile(r"\b[0-9a-f]{8,}\b"), "<hex>"),
    (re.compile(r"\d[\d,]*(?:\.\d+)?"), "<n>"),
)


@dataclass(frozen=True)
class Line:
    t: float  # seconds since the recording's origin (the first rank's start; the fault's moment)
    text: str  # as the rank printed it

    @property
    def level(self) -> str | None:
        m = _VLLM.match(self.text) or _UVICORN.match(self.text)
        return m.group("level") if m else None

    @property
    def message(self) -> str:
        """The text after vLLM's or uvicorn's prefix (a bare `(Worker_TP0 pid=39) ` one included)."""
        for pattern in (_VLLM, _UVICORN, _BARE_PREFIX):
            m = pattern.match(self.text)
            if m:
                return m.group("msg")
        return self.text


def normalized(message: str) -> str:
    out = message.strip()
    for pattern, placeholder in _SUBSTITUTIONS:
        out = pattern.sub(placeholder, out)
    return out


def log(scenario: str, role: str) -> list[Line]:
    """A rank's recorded log: role `head` or `worker`; scenario `boot`, `killed-worker`, ..."""
    path = FIXTURES / scenario / f"{role}.log.jsonl"
    return [Line(float(d["t"]), str(d["text"])) for d in map(json.loads, path.read_text().splitlines())]


def document(*parts: str) -> Any:
    """A recorded JSON file: document("killed-worker", "sequence.json")."""
    return json.loads(FIXTURES.joinpath(*parts).read_text())


def metrics(name: str) -> str:
    return (FIXTURES / "metrics" / name).read_text()


def metric_types(text: str) -> dict[str, str]:
    """`# TYPE name kind` lines of a Prometheus exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            out[name] = kind
    return out


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of `name` (over its labels)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(maxsplit=1)[1])
    return total
