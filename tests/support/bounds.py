"""The gates' bounds for a test: the values it names, the rest long enough never to decide it."""

from __future__ import annotations

from components.gates.decisions import GateBounds


def bounds(**given: float) -> GateBounds:
    values = {"rendezvous_timeout_s": 120.0, "ready_timeout_s": 600.0, "stall_s": 120.0, **given}
    return GateBounds(**values)
