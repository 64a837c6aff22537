"""The program's own Prometheus metrics, from what the supervisor's agents report: pure logic.

It runs inside the exporter's container (a container of the serving image: every vLLM image has
`prometheus_client`, a dependency of vLLM), so it imports the stdlib and prometheus_client only.

Inputs, each as the agents answer them (components/supervisor/agent.py):
  - `GET /rank` of this node's agent: the rank container's state, its generation label, MemAvailable;
  - `GET /status` of the leading agent (the head's exporter only): the supervisor's store (last probe, last
    verification, restarts, given up, paused);
  - this node's lines of the stack's watchdog log (`STOP:` lines are trips).

Names follow Prometheus' conventions: `dsv41_` prefix, the unit in the name, `_total` for counters, `_info`
for a constant 1 carrying labels.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from components.contract import Contract

GIB = 1 << 30
PROBE_STATES = ("healthy", "drift", "unknown", "unverified")
# The verifier's reasons (components/verify/verdict.py Reason) that say the logprobs themselves are not real.
BAD_LOGPROB_REASONS = ("nan", "inf", "bad_logprob", "no_logprobs")
# vLLM clamps -inf to this: not a real logprob.
CLAMPED_LOGPROB = -9999.0
RESTART_CAUSES = ("oom_killed", "rank_exited", "endpoint_drift", "other")
WATCHDOG_TRIP = " STOP: "


@dataclass(frozen=True, kw_only=True)
class ExporterConfig(Contract):
    """The exporter's config file: written by `pulumi up` (observability/spec.py `exporter_config`), read by the
    exporter in its container (exporter.py). No secret: the token is a file of its own."""

    stack: str
    node: str
    leader: bool
    generation: str
    image_id: str
    probe_seconds: float
    watchdog_floor_gib: float | None
    """None: the watchdog is off (no floor series, so no MemAvailable alert)."""
    agent_url: str
    """This node's agent; `leader_url` the leading agent's (the same on the head)."""
    leader_url: str
    watchdog_log: str
    """The host watchdog's log as mounted in the container; empty: the watchdog is off."""
    token_file: str
    listen_host: str
    listen_port: int


def restart_cause(cause: str) -> str:
    """One of RESTART_CAUSES for the supervisor's free-text cause (policy.py's words): a bounded label."""
    if "OOM-killed" in cause:
        return "oom_killed"
    if re.search(r"\bexited with code\b", cause):
        return "rank_exited"
    if cause.startswith("the endpoint"):
        return "endpoint_drift"
    return "other"


@dataclass
class RestartCounter:
    """Restarts by cause as a counter that only goes up while the exporter lives.

    The supervisor keeps its last 50 restarts only: counting the list would stand still (or fall) once it is
    full. Each restart is known by its start time; one seen once is counted once."""

    seen: set[float] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESTART_CAUSES, 0))

    def observe(self, restarts: Iterable[Mapping[str, Any]]) -> dict[str, int]:
        for item in restarts:
            at = item.get("at")
            if not isinstance(at, int | float) or at in self.seen:
                continue
            self.seen.add(float(at))
            cause = restart_cause(str(item.get("cause") or ""))
            self.counts[cause] += 1
        return dict(self.counts)


def watchdog_trips(log_text: str, node: str) -> int:
    """This node's trips in the stack's watchdog log (nodes that share a home share the file: each line names its
    node)."""
    tag = f" node={node} "
    return sum(1 for line in log_text.splitlines() if tag in line and WATCHDOG_TRIP in line)


def real_logprob(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value != CLAMPED_LOGPROB
        and value <= 0
    )


def probe_reason(seen: str) -> str:
    """The verifier's reason at the head of a drift probe's text (`nan: ...`), else ''."""
    head = seen.split(":", 1)[0].strip()
    return head if re.fullmatch(r"[a-z_]+", head) else ""


@dataclass(frozen=True, kw_only=True)
class Observed:
    """One scrape's inputs. `rank` None: the agent did not answer; `status` None: not the leader, or the leading
    agent did not answer."""

    now: float
    rank: Mapping[str, Any] | None
    status: Mapping[str, Any] | None = None
    watchdog_log: str | None = None
    """The stack's watchdog log, None when there is none (the watchdog is off, or never ran here)."""


def _gauge(name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def families(cfg: ExporterConfig, seen: Observed, restarts: RestartCounter) -> list[Metric]:
    """Every metric family of one scrape."""
    node = cfg.node
    out: list[Metric] = []

    info = _gauge(
        "dsv41_deployment_info",
        "The deployment as `pulumi up` left it (constant 1).",
        ["stack", "node", "generation", "image_id"],
    )
    info.add_metric([cfg.stack, node, cfg.generation, cfg.image_id], 1)
    out.append(info)

    agent = _gauge("dsv41_agent_up", "1 when this node's supervisor agent answered.", ["node"])
    agent.add_metric([node], 1 if seen.rank is not None else 0)
    out.append(agent)

    rank = seen.rank
    if rank is not None:
        up = _gauge("dsv41_rank_up", "1 when this node's rank container runs.", ["node"])
        up.add_metric([node], 1 if rank.get("running") else 0)
        exists = _gauge("dsv41_rank_exists", "1 when this node's rank container exists.", ["node"])
        exists.add_metric([node], 1 if rank.get("exists") else 0)
        oom = _gauge("dsv41_rank_oom_killed", "1 when this node's rank container was OOM-killed.", ["node"])
        oom.add_metric([node], 1 if rank.get("oom_killed") else 0)
        out += [up, exists, oom]
        if rank.get("exists"):
            live = _gauge(
                "dsv41_rank_info", "The rank container's generation label (constant 1).", ["node", "generation"]
            )
            live.add_metric([node, str(rank.get("generation") or "")], 1)
            out.append(live)
        mem = rank.get("mem_available_gib")
        if isinstance(mem, int | float):
            m = _gauge("dsv41_mem_available_bytes", "MemAvailable on this node, as the watchdog reads it.", ["node"])
            m.add_metric([node], float(mem) * GIB)
            out.append(m)

    if cfg.watchdog_floor_gib is not None:
        floor = _gauge("dsv41_watchdog_floor_bytes", "The watchdog's MemAvailable floor on this node.", ["node"])
        floor.add_metric([node], cfg.watchdog_floor_gib * GIB)
        out.append(floor)
        trips = CounterMetricFamily(
            "dsv41_watchdog_trips", "Times this node's memory watchdog stopped the ranks (its log).", labels=["node"]
        )
        trips.add_metric([node], watchdog_trips(seen.watchdog_log or "", node))
        out.append(trips)

    if cfg.leader:
        out += _supervisor_families(cfg, seen, restarts)
    return out


def _supervisor_families(cfg: ExporterConfig, seen: Observed, restarts: RestartCounter) -> list[Metric]:
    status = seen.status
    up = _gauge("dsv41_supervisor_up", "1 when the leading supervisor agent answered /status.")
    up.add_metric([], 0 if status is None else 1)
    interval = _gauge("dsv41_probe_interval_seconds", "supervisor.probeSeconds: the probe's period.")
    interval.add_metric([], cfg.probe_seconds)
    out: list[Metric] = [up, interval]
    if status is None:
        return out

    for name, doc, value in (
        (
            "dsv41_supervisor_given_up",
            "1 when the supervisor spent its restart budget and gave up.",
            status.get("given_up"),
        ),
        ("dsv41_supervisor_paused", "1 when the operator paused the supervisor.", status.get("paused")),
        ("dsv41_update_lock_held", "1 when an update holds the supervisor's lock.", status.get("lock_holder")),
    ):
        g = _gauge(name, doc)
        g.add_metric([], 1 if value else 0)
        out.append(g)

    # Armed for what the head runs now (its rank's label, else the supervisor's own look): 0 means a dead rank
    # would be left to `pulumi up` (issue 43).
    running = str((seen.rank or {}).get("generation") or status.get("running_generation") or "")
    armed = _gauge(
        "dsv41_supervisor_armed", "0 when the head runs a generation the supervisor is not armed for (else 1)."
    )
    armed.add_metric([], 0 if running and running != str(status.get("armed_generation") or "") else 1)
    out.append(armed)

    probe = status.get("last_probe") or {}
    state = str(probe.get("state") or "")
    if probe.get("at") is not None:
        at = float(probe["at"])
        states = _gauge("dsv41_probe_state", "The supervisor's last probe verdict (1 for the current one).", ["state"])
        for s in PROBE_STATES:
            states.add_metric([s], 1 if s == state else 0)
        healthy = _gauge("dsv41_probe_healthy", "1 when the last probe found real logprobs.")
        healthy.add_metric([], 1 if state == "healthy" else 0)
        when = _gauge("dsv41_probe_last_timestamp_seconds", "When the last probe ran (Unix time).")
        when.add_metric([], at)
        age = _gauge("dsv41_probe_age_seconds", "Seconds since the last probe.")
        age.add_metric([], max(0.0, seen.now - at))
        reason = probe_reason(str(probe.get("seen") or "")) if state == "drift" else ""
        bad = _gauge(
            "dsv41_probe_bad_logprobs",
            "1 when the last probe's answer had NaN, infinite, clamped or no logprobs.",
            ["reason"],
        )
        bad.add_metric([reason if reason in BAD_LOGPROB_REASONS else ""], 1 if reason in BAD_LOGPROB_REASONS else 0)
        out += [states, healthy, when, age, bad]

    verified = status.get("last_verified") or {}
    if verified.get("at") is not None:
        at = float(verified["at"])
        values = [
            pair[1] for pair in verified.get("logprobs") or [] if isinstance(pair, list | tuple) and len(pair) == 2
        ]
        when = _gauge(
            "dsv41_last_verified_timestamp_seconds", "When the supervisor last verified the endpoint (Unix time)."
        )
        when.add_metric([], at)
        real = _gauge("dsv41_last_verified_logprobs_real", "1 when every logprob of the last verification is real.")
        real.add_metric([], 1 if values and all(real_logprob(v) for v in values) else 0)
        out += [when, real]
        if values and all(real_logprob(v) for v in values):
            first = _gauge("dsv41_last_verified_logprob", "The last verification's first token's logprob.")
            first.add_metric([], float(values[0]))
            low = _gauge("dsv41_last_verified_min_logprob", "The last verification's lowest token logprob.")
            low.add_metric([], float(min(values)))
            out += [first, low]

    counts = restarts.observe(status.get("restarts") or [])
    total = CounterMetricFamily("dsv41_restarts", "Group restarts by the supervisor, by cause.", labels=["cause"])
    for cause in RESTART_CAUSES:
        total.add_metric([cause], counts[cause])
    out.append(total)
    return out
