"""What a deployed stack is doing right now, read only:

    dsv41-exl3 status [--stack NAME] [--json] [--interval SECONDS]

From the stack's outputs: the endpoint, model, cluster generation and last verification. From each node, one
ssh: its rank container's state (`docker inspect`), MemAvailable and the last line of this stack's watchdog log.
The load (requests running and waiting, KV cache use, generation and prompt tokens per second) comes from the
stack's Prometheus when it has a `prometheusUrl` output: instant queries on its HTTP API for the series it scrapes
from vLLM (job="vllm", the dashboard's expressions), the rates over max(1m, 4 scrape intervals), no waiting. Without
that output, or when Prometheus cannot be read or has no vLLM series (a note says why), they come from the head's
vLLM `/metrics`: two samples `--interval` seconds apart. The report names its `source`. From the supervisor (when
deployed): its own status.

Exit 0: every rank is running and the metrics were read; 1: something is down; 2: a usage error (unknown stack
or node, bad argument). The API key, the supervisor's token and the SSH key are never printed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from components import labels
from components.config import OPEN_ENDPOINT
from components.http import ConnectionRefusedOrReset, DeadlineExceeded, exchange
from components.operator.exits import Exit
from components.operator.stack_view import (
    PROJECT,
    OperatorError,
    OperatorParser,
    StackView,
    container_of,
    read_stack,
    secrets_of,
    ssh_target,
)
from components.operator.supervisor import format_status
from components.redaction import redact
from components.ssh import ssh_argv

SSH_TIMEOUT_S = 30
HTTP_TIMEOUT_S = 10
DEFAULT_INTERVAL_S = 5.0
FROM_PROMETHEUS = "prometheus"
FROM_VLLM = "vllm /metrics"
NO_WATCHDOG_LOG = "no watchdog log"
_END = "end"
_SECTION = re.compile(r"^==([a-z]+)==$")
# A sample line: name, optional {labels} (quoted values may hold spaces, braces, escaped quotes), value.
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')

Run = Callable[[list[str]], subprocess.CompletedProcess[str]]
Fetch = Callable[[str, Mapping[str, str], float], tuple[int, str]]
"""GET `url` with `headers` within `timeout` seconds: (HTTP status, body). Raises OSError and components.http's."""


@dataclass(frozen=True)
class ContainerState:
    """The fields of `docker inspect --format '{{json .State}}'` an operator acts on."""

    status: str
    running: bool
    exit_code: int
    oom_killed: bool
    started_at: str
    finished_at: str


@dataclass(frozen=True)
class NodeReport:
    """One node as its ssh call saw it; `unreachable` set means nothing else was read."""

    state: ContainerState | None = None
    state_error: str | None = None
    """Why there is no state: `no such container`, or the first line docker printed."""
    mem_available_gib: float | None = None
    watchdog: str = NO_WATCHDOG_LOG
    unreachable: str | None = None

    @property
    def running(self) -> bool:
        return self.unreachable is None and self.state is not None and self.state.running


@dataclass(frozen=True)
class NodeStatus:
    name: str
    container: str
    report: NodeReport


@dataclass(frozen=True)
class MetricsReport:
    """vLLM's load, from Prometheus or two /metrics samples (`source`); `error` set means it could not be read."""

    error: str | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage_percent: float | None = None
    generation_tokens_per_second: float | None = None
    prompt_tokens_per_second: float | None = None
    elapsed_seconds: float | None = None
    """The time the rates are over: between the two samples, or Prometheus' rate() window."""
    source: str = FROM_VLLM
    note: str | None = None
    """Why Prometheus, though deployed, was not the source."""


@dataclass(frozen=True)
class SupervisorReport:
    url: str | None = None
    status: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class StatusReport:
    stack: str
    endpoint: str | None
    model: str | None
    cluster_generation: str | None
    verification: dict[str, Any] | None
    nodes: list[NodeStatus]
    metrics: MetricsReport
    supervisor: SupervisorReport

    @property
    def healthy(self) -> bool:
        return all(n.report.running for n in self.nodes) and self.metrics.error is None


# --- a node: one script, one ssh, sections parsed --------------------------------------------------------------


def watchdog_log(stack: str) -> str:
    """This stack's watchdog log on a node, relative to the SSH user's home (components/watchdog/watchdog.py)."""
    return f".local/state/{labels.stack_prefix(PROJECT, stack)}/watchdog.log"


def node_script(container: str, log: str) -> str:
    """Prints `==state==`, `==meminfo==`, `==watchdog==` sections and `==end==`: the parser's only input.

    Every command's errors go into its section (2>&1) and none stops the script, so a missing container still
    reports memory and the watchdog; a report without `==end==` did not run through."""
    log_path = '"$HOME"/' + shlex.quote(log)
    return "\n".join(
        [
            "echo '==state=='",
            "docker inspect --format '{{json .State}}' " + shlex.quote(container) + " 2>&1",
            "echo '==meminfo=='",
            "grep '^MemAvailable:' /proc/meminfo 2>&1",
            "echo '==watchdog=='",
            f"if [ -f {log_path} ]; then tail -n 1 {log_path} 2>&1; else echo '{NO_WATCHDOG_LOG}'; fi",
            f"echo '=={_END}=='",
        ]
    )


def _sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        marker = _SECTION.match(line.strip())
        if marker:
            current = sections.setdefault(marker.group(1), [])
        elif current is not None:
            current.append(line.rstrip())
    return sections


def _int(value: object) -> int:
    """docker's integer, or -1 for anything else a hostile or broken node prints."""
    if isinstance(value, bool):
        return -1
    if isinstance(value, int):
        return value
    if value is None:
        return 0
    try:
        return int(str(value))
    except ValueError:
        return -1


def _state(lines: list[str]) -> tuple[ContainerState | None, str | None]:
    for line in lines:
        if line.lstrip().startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                break
            if not isinstance(data, dict):
                break  # a node answers what it likes: anything but docker's object is "not read"
            return (
                ContainerState(
                    status=str(data.get("Status", "")),
                    running=bool(data.get("Running")),
                    exit_code=_int(data.get("ExitCode")),
                    oom_killed=bool(data.get("OOMKilled")),
                    started_at=str(data.get("StartedAt", "")),
                    finished_at=str(data.get("FinishedAt", "")),
                ),
                None,
            )
    said = next((line.strip() for line in lines if line.strip()), "docker inspect printed nothing")
    if "no such object" in said.lower() or "no such container" in said.lower():
        return None, "no such container"
    return None, said


def parse_node_report(text: str) -> NodeReport:
    """A node's report from the output of `node_script`. Output that did not run through is `unreachable`."""
    sections = _sections(text)
    if _END not in sections:
        return NodeReport(unreachable="the node's report was cut short")
    state, state_error = _state(sections.get("state", []))
    mem = None
    for line in sections.get("meminfo", []):
        found = re.match(r"^MemAvailable:\s+(\d+)\s*kB", line)
        if found:
            mem = int(found.group(1)) / (1 << 20)
    watchdog = [line for line in sections.get("watchdog", []) if line.strip()]
    return NodeReport(
        state=state,
        state_error=state_error,
        mem_available_gib=mem,
        watchdog=watchdog[-1].strip() if watchdog else "watchdog log is empty",
    )


def run_ssh(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=SSH_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
    )


def node_report(run: Run, argv: list[str]) -> NodeReport:
    """Run one node's script; an ssh that fails (exit 255, a timeout, no ssh) is `unreachable: <why>`."""
    try:
        done = run(argv)
    except subprocess.TimeoutExpired:
        return NodeReport(unreachable=f"no answer within {SSH_TIMEOUT_S} s")
    except OSError as error:
        return NodeReport(unreachable=f"cannot run ssh ({error.strerror or type(error).__name__})")
    if done.returncode != 0:
        said = next((line.strip() for line in (done.stderr or "").splitlines() if line.strip()), "")
        return NodeReport(unreachable=said or f"ssh exited {done.returncode}")
    return parse_node_report(done.stdout or "")


def collect_nodes(view: StackView, run: Run) -> list[NodeStatus]:
    """Every node at once (each ssh may take its whole timeout), reported in the config's order."""
    nodes = view.settings.nodes
    log = watchdog_log(view.name)
    jobs = [(n.name, container_of(view, n)) for n in nodes]
    argvs = [ssh_argv(ssh_target(view, name), node_script(container, log)) for name, container in jobs]
    with ThreadPoolExecutor(max_workers=len(argvs)) as pool:
        reports = list(pool.map(lambda argv: node_report(run, argv), argvs))
    return [NodeStatus(name, container, report) for (name, container), report in zip(jobs, reports, strict=True)]


# --- vLLM's /metrics ---------------------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each series summed over its label sets; comments and `_created` timestamps skipped."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        sample = _SAMPLE.match(line)
        if not sample or sample.group(1).endswith("_created"):
            continue
        try:
            value = float(sample.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            totals[sample.group(1)] = totals.get(sample.group(1), 0.0) + value
    return totals


def metrics_url(endpoint: str) -> str:
    """`http://HOST:PORT/v1` -> `http://HOST:PORT/metrics` (vLLM serves both on one port)."""
    parts = urlsplit(endpoint)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE = "vllm:kv_cache_usage_perc"
KV_CACHE_BEFORE_V1 = "vllm:gpu_cache_usage_perc"
GENERATED = "vllm:generation_tokens_total"
PROMPTED = "vllm:prompt_tokens_total"


def summarize_metrics(first: Mapping[str, float], second: Mapping[str, float], elapsed_s: float) -> MetricsReport:
    """Gauges from the second sample, the generation rate from the counter's growth between the two."""
    missing = [m for m in (RUNNING, WAITING, GENERATED) if m not in first or m not in second]
    if missing:
        return MetricsReport(error=f"no {', '.join(missing)} in the answer: is it vLLM's /metrics?")
    kv = second.get(KV_CACHE, second.get(KV_CACHE_BEFORE_V1))

    def rate(counter: str) -> float | None:
        if counter not in first or counter not in second:
            return None
        grown = second[counter] - first[counter]
        # A counter that went down: vLLM restarted between the samples, no rate to tell.
        return grown / elapsed_s if elapsed_s > 0 and grown >= 0 else None

    return MetricsReport(
        requests_running=second[RUNNING],
        requests_waiting=second[WAITING],
        kv_cache_usage_percent=None if kv is None else kv * 100,
        generation_tokens_per_second=rate(GENERATED),
        prompt_tokens_per_second=rate(PROMPTED),
        elapsed_seconds=elapsed_s,
    )


def _reason(error: Exception, timeout_s: float) -> str:
    if isinstance(error, ConnectionRefusedOrReset):
        return "connection refused"
    if isinstance(error, DeadlineExceeded):
        return f"no answer within {timeout_s:g} s"
    return type(error).__name__


def http_get(url: str, headers: Mapping[str, str], timeout_s: float) -> tuple[int, str]:
    reply = exchange("GET", url, headers=headers, deadline=time.monotonic() + timeout_s)
    return reply.status, reply.body.decode("utf-8", errors="replace")


def _fetch(fetch: Fetch, url: str, headers: Mapping[str, str]) -> tuple[int, str] | str:
    """(HTTP status, body), or why there is no answer: a failure is a line of the report, never a traceback."""
    try:
        return fetch(url, headers, HTTP_TIMEOUT_S)
    except (OSError, ConnectionRefusedOrReset, DeadlineExceeded, ValueError) as error:
        return _reason(error, HTTP_TIMEOUT_S)


def _get(fetch: Fetch, url: str, headers: Mapping[str, str]) -> tuple[str | None, str]:
    """(body, "") on HTTP 200, else (None, why)."""
    got = _fetch(fetch, url, headers)
    if isinstance(got, str):
        return None, got
    status, body = got
    return (body, "") if status == 200 else (None, f"HTTP {status}")


# --- Prometheus, when the stack deploys it ------------------------------------------------------------------------

# The expressions of components/observability/dashboard.json, on the job spec.py gives vLLM, each summed to one
# value as parse_metrics sums a /metrics series over its label sets.
_JOB = '{job="vllm"}'


def prometheus_window_s(scrape_s: int) -> int:
    """rate()'s range: the dashboard's 1m, widened to four scrapes so a slow scrape still has samples to rate."""
    return max(60, 4 * scrape_s)


def prometheus_queries(window_s: int) -> dict[str, str]:
    """MetricsReport field -> PromQL; the first three are essential, as RUNNING, WAITING, GENERATED are to /metrics."""
    return {
        "requests_running": f"sum({RUNNING}{_JOB})",
        "requests_waiting": f"sum({WAITING}{_JOB})",
        "generation_tokens_per_second": f"sum(rate({GENERATED}{_JOB}[{window_s}s]))",
        "kv_cache_usage_percent": f"(sum({KV_CACHE}{_JOB}) or sum({KV_CACHE_BEFORE_V1}{_JOB})) * 100",
        "prompt_tokens_per_second": f"sum(rate({PROMPTED}{_JOB}[{window_s}s]))",
    }


_ESSENTIAL = ("requests_running", "requests_waiting", "generation_tokens_per_second")


class _Unreadable(Exception):
    """Prometheus gave no usable answer; the text is why, for the report's note."""


def prometheus_query_url(base: str, expr: str) -> str:
    return f"{base.rstrip('/')}/api/v1/query?query={quote(expr, safe='')}"


def _instant(fetch: Fetch, base: str, expr: str) -> float | None:
    """One instant query's value; None for an empty (or NaN) result. No headers: Prometheus wants no API key."""
    got = _fetch(fetch, prometheus_query_url(base, expr), {})
    if isinstance(got, str):
        raise _Unreadable(got)
    status, body = got
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise _Unreadable(f"HTTP {status}, not a Prometheus API answer")
    if status != 200 or answer.get("status") != "success":
        said = answer.get("error") or answer.get("status")
        raise _Unreadable(f"HTTP {status}: {said}" if said else f"HTTP {status}")
    data = answer.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list):
        raise _Unreadable("an answer without data.result")
    try:
        values = [float(r["value"][1]) for r in result]
    except (KeyError, IndexError, TypeError, ValueError):
        raise _Unreadable("a result that is not an instant vector") from None
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) if finite else None


def prometheus_metrics(view: StackView, fetch: Fetch, base: str) -> MetricsReport:
    """The load from Prometheus, one instant query per quantity; raises _Unreadable to fall back to /metrics."""
    window_s = prometheus_window_s(view.settings.observability.scrape_seconds)
    values: dict[str, float | None] = {}
    for field, expr in prometheus_queries(window_s).items():
        values[field] = _instant(fetch, base, expr)
        # vLLM's series absent (never scraped, or stale since vLLM went down): /metrics tells what is wrong.
        if field in _ESSENTIAL and values[field] is None:
            raise _Unreadable(f"an empty result for {expr}")
    return MetricsReport(
        requests_running=values["requests_running"],
        requests_waiting=values["requests_waiting"],
        kv_cache_usage_percent=values["kv_cache_usage_percent"],
        generation_tokens_per_second=values["generation_tokens_per_second"],
        prompt_tokens_per_second=values["prompt_tokens_per_second"],
        elapsed_seconds=float(window_s),
        source=FROM_PROMETHEUS,
    )


def collect_metrics(
    view: StackView, fetch: Fetch, sleep: Callable[[float], None], clock: Callable[[], float], interval_s: float
) -> MetricsReport:
    prometheus = view.outputs.get("prometheusUrl")
    if isinstance(prometheus, str) and prometheus:
        try:
            return prometheus_metrics(view, fetch, prometheus)
        except _Unreadable as error:
            note = f"Prometheus at {prometheus} could not be read: {error}; read vLLM's /metrics instead"
            return dataclasses.replace(_direct_metrics(view, fetch, sleep, clock, interval_s), note=note)
    return _direct_metrics(view, fetch, sleep, clock, interval_s)


def _direct_metrics(
    view: StackView, fetch: Fetch, sleep: Callable[[float], None], clock: Callable[[], float], interval_s: float
) -> MetricsReport:
    endpoint = view.outputs.get("endpoint")
    if not isinstance(endpoint, str) or not endpoint:
        return MetricsReport(error="no `endpoint` output (no successful `pulumi up` yet)")
    key = view.outputs.get("apiKey")
    headers = {"Authorization": f"Bearer {key}"} if key and key != OPEN_ENDPOINT else {}
    url = metrics_url(endpoint)
    samples: list[tuple[float, dict[str, float]]] = []
    for i in range(2):
        if i:
            sleep(interval_s)
        body, why = _get(fetch, url, headers)
        if body is None:
            return MetricsReport(error=f"{why} from {url}")
        samples.append((clock(), parse_metrics(body)))
    (t0, first), (t1, second) = samples
    return summarize_metrics(first, second, t1 - t0)


# --- the supervisor ----------------------------------------------------------------------------------------------


def collect_supervisor(view: StackView, fetch: Fetch) -> SupervisorReport:
    data = view.outputs.get("supervisor")
    if not isinstance(data, dict) or not data.get("url") or not data.get("token"):
        return SupervisorReport(error="not deployed (no `supervisor` output: supervisor.enabled false, or no up yet)")
    url = str(data["url"])
    body, why = _get(fetch, f"{url}/status", {"Authorization": f"Bearer {data['token']}"})
    if body is None:
        return SupervisorReport(url=url, error=f"unreachable at {url} ({why})")
    try:
        status = json.loads(body)
    except ValueError:
        return SupervisorReport(url=url, error=f"answered something that is not JSON at {url}/status")
    if not isinstance(status, dict):
        return SupervisorReport(url=url, error=f"answered something that is not a status object at {url}/status")
    return SupervisorReport(url=url, status=status)


# --- the whole report --------------------------------------------------------------------------------------------


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def collect(
    view: StackView,
    *,
    run: Run,
    fetch: Fetch,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    interval_s: float,
) -> StatusReport:
    verification = view.outputs.get("verification")
    return StatusReport(
        stack=view.name,
        endpoint=_text(view.outputs.get("endpoint")),
        model=_text(view.outputs.get("model")),
        cluster_generation=_text(view.outputs.get("clusterGeneration")),
        verification=verification if isinstance(verification, dict) else None,
        nodes=collect_nodes(view, run),
        metrics=collect_metrics(view, fetch, sleep, clock, interval_s),
        supervisor=collect_supervisor(view, fetch),
    )


def as_json(report: StatusReport) -> dict[str, Any]:
    def camel(data: dict[str, Any]) -> dict[str, Any]:
        return {re.sub(r"_([a-z])", lambda m: m.group(1).upper(), k): v for k, v in data.items()}

    nodes = []
    for n in report.nodes:
        r = n.report
        nodes.append(
            {
                "name": n.name,
                "container": n.container,
                "running": r.running,
                "unreachable": r.unreachable,
                "state": camel(asdict(r.state)) if r.state else None,
                "stateError": r.state_error,
                "memAvailableGiB": r.mem_available_gib,
                "watchdog": None if r.unreachable else r.watchdog,
            }
        )
    return {
        "stack": report.stack,
        "healthy": report.healthy,
        "endpoint": report.endpoint,
        "model": report.model,
        "clusterGeneration": report.cluster_generation,
        "verification": report.verification,
        "nodes": nodes,
        "metrics": camel(asdict(report.metrics)),
        "supervisor": camel(asdict(report.supervisor)),
    }


def _node_line(n: NodeStatus) -> str:
    r = n.report
    if r.unreachable:
        return f"  {n.name}: unreachable: {r.unreachable}"
    if r.state is None:
        rank = f"{n.container}: {r.state_error}"
    elif r.state.running:
        rank = f"{n.container} running since {r.state.started_at}"
    else:
        oom = ", OOM killed" if r.state.oom_killed else ""
        rank = f"{n.container} {r.state.status} (exit {r.state.exit_code}{oom}) at {r.state.finished_at}"
    mem = "MemAvailable ?" if r.mem_available_gib is None else f"MemAvailable {r.mem_available_gib:.1f} GiB"
    return f"  {n.name}: {rank}; {mem}\n    watchdog: {r.watchdog}"


def _verification_line(v: dict[str, Any] | None) -> str:
    if not v:
        return "last verification: none recorded"
    logprobs = v.get("logprobs") or []
    shown = json.dumps(logprobs[:5] if isinstance(logprobs, list) else logprobs, ensure_ascii=False)
    more = f" (+{len(logprobs) - 5} more)" if isinstance(logprobs, list) and len(logprobs) > 5 else ""
    latency = v.get("latencySeconds")
    took = f" in {float(latency):.2f} s" if isinstance(latency, int | float) else ""
    return (
        f"last verification: {v.get('verifiedAt', '?')}{took}: answer "
        f"{json.dumps(v.get('answer'), ensure_ascii=False)}, logprobs {shown}{more}"
    )


def _metrics_line(m: MetricsReport) -> str:
    note = f"\n  note: {m.note}" if m.note else ""
    if m.error:
        return f"metrics: unavailable ({m.error}){note}"

    def num(x: float | None, fmt: str) -> str:
        return "?" if x is None else format(x, fmt)

    prompt = "" if m.prompt_tokens_per_second is None else f", {m.prompt_tokens_per_second:.1f} prompt tok/s"
    return (
        f"metrics: {num(m.requests_running, 'g')} running, {num(m.requests_waiting, 'g')} waiting, "
        f"KV cache {num(m.kv_cache_usage_percent, '.1f')} %, "
        f"{num(m.generation_tokens_per_second, '.1f')} generation tok/s{prompt} "
        f"over {num(m.elapsed_seconds, '.1f')} s (from {m.source}){note}"
    )


def format_report(report: StatusReport) -> str:
    lines = [
        f"stack {report.stack}: {report.endpoint or '(no endpoint output)'} serving "
        f"{json.dumps(report.model)}, cluster generation {report.cluster_generation or '?'}",
        _verification_line(report.verification),
        "nodes:",
        *(_node_line(n) for n in report.nodes),
        _metrics_line(report.metrics),
    ]
    s = report.supervisor
    lines.append(format_status(s.status) if s.status is not None else f"supervisor: {s.error}")
    lines.append("healthy" if report.healthy else "DOWN: " + _down(report))
    return "\n".join(lines)


def _down(report: StatusReport) -> str:
    parts = [n.name for n in report.nodes if not n.report.running]
    what = [f"rank not running on {', '.join(parts)}"] if parts else []
    if report.metrics.error:
        what.append("metrics unavailable")
    return "; ".join(what)


def _parser(prog: str) -> OperatorParser:
    parser = OperatorParser(
        prog=prog,
        allow_abbrev=False,
        description="Read only: the stack's endpoint, ranks, memory, watchdog, vLLM load and supervisor.",
    )
    parser.add_argument("--stack", metavar="NAME", help="default: the selected stack")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the summary")
    parser.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="SECONDS",
        help=f"between the two /metrics samples, when not read from Prometheus (default {DEFAULT_INTERVAL_S:g})",
    )
    return parser


def main(
    argv: Sequence[str] | None = None,
    read: Callable[[str | None], StackView] = read_stack,
    run: Run = run_ssh,
    fetch: Fetch = http_get,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    prog: str = "dsv41-exl3 status",
) -> int:
    try:
        options = _parser(prog).parse_args(argv)
        if not math.isfinite(options.interval) or options.interval <= 0:
            raise OperatorError(f"--interval {options.interval:g} must be a number of seconds above 0, e.g. 5")
        view = read(options.stack)
    except OperatorError as error:
        print(f"error: {error}", file=sys.stderr)
        return Exit.USAGE
    report = collect(view, run=run, fetch=fetch, sleep=sleep, clock=clock, interval_s=options.interval)
    text = json.dumps(as_json(report), indent=1, sort_keys=True) if options.json else format_report(report)
    # Nothing above prints a credential; this guards text the nodes and the supervisor sent (also JSON-escaped).
    hidden = [form for secret in secrets_of(view) for form in (secret, json.dumps(secret)[1:-1])]
    print(redact(text, hidden, mask="[secret]"))
    return Exit.OK if report.healthy else Exit.FAILED
