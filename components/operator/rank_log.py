"""A rank's log as a recording: one JSON line per printed line, `{"t": seconds since the group's start, "text"}`.

The one format of `sim/record.py` (real vLLM recorded on the simulated cluster, the fixtures the stand-in is held
to) and of `dsv41-exl3 report` (a rank's log on real Sparks): a GB10 recording drops into the conformance suite as
it is (docs/development.md). Pure logic: the caller runs `docker logs --timestamps`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z) ?")


def docker_time(stamp: str) -> float:
    """Epoch seconds of docker's RFC 3339 nanosecond time (`2026-12-07T20:16:31.123456789Z`)."""
    return datetime.fromisoformat(stamp[:26].rstrip("Z") + "+00:00").timestamp()


def merged_lines(text: str) -> list[tuple[float, str]]:
    """`docker logs --timestamps` of both streams, in one list ordered by docker's timestamps: (epoch, line).

    Lines split on newlines only: a progress bar's carriage returns stay inside its line, as docker keeps it."""
    out: list[tuple[float, str]] = []
    for line in text.split("\n"):
        m = _STAMP.match(line)
        if m:
            out.append((docker_time(m.group(1)), line[m.end() :]))
    return sorted(out, key=lambda p: p[0])


def as_jsonl(lines: Sequence[tuple[float, str]], origin: float) -> str:
    return "".join(json.dumps({"t": round(t - origin, 3), "text": text}) + "\n" for t, text in lines)


def argv_record(inspected: dict[str, object]) -> dict[str, object]:
    """What a recording keeps of `docker inspect`: the entrypoint, the command, the environment's names only."""
    config = inspected.get("Config")
    config = config if isinstance(config, dict) else {}
    env = config.get("Env") or []
    return {
        "entrypoint": config.get("Entrypoint"),
        "cmd": config.get("Cmd"),
        "envNames": sorted(str(e).partition("=")[0] for e in env if isinstance(e, str)),
    }
