"""The observability layer on the simulated cluster: a supervised stand-in deployment observed by the sim's
Prometheus (Debian's binaries, `sim/image/prometheus.sh`), read only through Prometheus' HTTP API.

The session's supervised stack (conftest `supervised`, shared with test_supervisor_sim, which runs next and
ends with the layer's removal and the destroy), in order: every target up and every program metric with a
value, every dashboard panel with series, a killed worker seen and alerted on while the paused supervisor
leaves it down, then healed once resumed.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from program_support import REPO, Deployment, docker_on

from components import labels
from sim.supervisor_view import restarted, restarts, status, wait_for
from tests.observability.tools import api

pytestmark = [pytest.mark.sim, pytest.mark.engine]

OBSERVABILITY = REPO / "components" / "observability"
SCRAPE_S = 5  # sim_config's observability.scrapeSeconds (also the rules' evaluation interval)
# What one scrape may add to its interval: the exporter asks two agents, Prometheus commits the sample.
SCRAPE_MARGIN_S = 5
# The stand-in's /metrics has no request latency histograms (sim/standin/vllm_standin.py `metrics`): the
# panels on these read nothing there. Real vLLM has them (tests/support/fixtures/real-vllm/metrics).
STANDIN_LACKS = ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket")


def prometheus(d: Deployment) -> str:
    url: str = d.stack.outputs()["prometheusUrl"].value
    return url


def query(d: Deployment, expr: str) -> list[dict[str, Any]]:
    got = api(prometheus(d), "/api/v1/query", {"query": expr})
    assert got.get("status") == "success", f"{expr}: {got}"
    result: list[dict[str, Any]] = got["data"]["result"]
    return result


def wait_until(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    """check()'s first truthy value within timeout_s; fails naming `what` and check()'s last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as err:
            last = err
        if last and not isinstance(last, OSError):
            return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:g} s; last: {last!r}")


def program_metrics() -> list[str]:
    """Every family metrics.py exports, as Prometheus names it (counters with `_total`)."""
    names = []
    for node in ast.walk(ast.parse((OBSERVABILITY / "metrics.py").read_text())):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
            continue
        func = node.func.id if isinstance(node.func, ast.Name) else ""
        name = str(node.args[0].value)
        if func in ("_gauge", "GaugeMetricFamily", "CounterMetricFamily") and name.startswith("dsv41_"):
            names.append(f"{name}_total" if func == "CounterMetricFamily" else name)
    # The loop over (name, doc, value) triples: the supervisor's flags.
    for node in ast.walk(ast.parse((OBSERVABILITY / "metrics.py").read_text())):
        if isinstance(node, ast.Tuple) and node.elts and isinstance(node.elts[0], ast.Constant):
            first = node.elts[0].value
            if isinstance(first, str) and first.startswith("dsv41_") and len(node.elts) == 3:
                names.append(first)
    return sorted(set(names))


def operator(d: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` as the operator runs it beside the stack."""
    env = {**os.environ, **d.env, "PATH": f"{d.pulumi_root / 'bin'}:{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def supervisor_cli(d: Deployment, action: str) -> None:
    proc = operator(d, "components", "supervisor", action, "--stack", d.name)
    assert proc.returncode == 0, f"supervisor {action}: {proc.stdout}{proc.stderr}"


def test_every_target_is_up_and_every_program_metric_has_a_value(supervised: Deployment) -> None:
    d = supervised
    assert d.config["observability"]["scrapeSeconds"] == SCRAPE_S
    nodes = [f"node-{n['index']}" for n in d.sim["nodes"]]
    want = {("vllm", nodes[0])} | {(job, n) for job in ("dsv41", "node") for n in nodes}

    def targets() -> dict[tuple[str, str], str]:
        """(job, node) -> health: "up", or the last scrape's error."""
        active = api(prometheus(d), "/api/v1/targets")["data"]["activeTargets"]
        return {
            (t["labels"]["job"], t["labels"]["node"]): t["health"] if t["health"] == "up" else t["lastError"]
            for t in active
        }

    # Prometheus lists its targets once its first discovery ran, and each is `unknown` until its first scrape.
    try:
        wait_until("every target up", lambda: targets() == dict.fromkeys(want, "up"), 4 * SCRAPE_S + 10)
    except AssertionError:
        raise AssertionError(f"the scrape targets and their health: {targets()}; expected {sorted(want)} up") from None

    # Listeners and targets hold the addresses the program resolved, never a name left for a container to resolve
    # (on the node the head's name is 127.0.1.1: a listener there would answer the node alone).
    head = d.sim["nodes"][0]
    assert (
        d.config["nodes"][0]["host"] == head["name"]
        and prometheus(d) == f"http://{head['ip']}:{d.config['observability']['port']}"
    )
    container = f"{labels.stack_prefix('dsv41-exl3', d.name)}-prometheus"
    args = json.loads(docker_on(head["index"], "inspect", "-f", "{{json .Config.Entrypoint}}", container).stdout)
    assert f"--web.listen-address={head['ip']}:{d.config['observability']['port']}" in args, args
    assert not any(n["name"] in arg for n in d.sim["nodes"] for arg in args), args

    running = query(d, 'vllm:num_requests_running{job="vllm"}')
    assert running and running[0]["metric"]["node"] == nodes[0], f"vLLM's own metric, from the head: {running}"

    names = program_metrics()
    assert len(names) > 20 and "dsv41_rank_up" in names and "dsv41_restarts_total" in names, names

    def missing() -> list[str]:
        return [name for name in names if not query(d, name)]

    # Some families appear only once the supervisor has probed and verified (a few scrapes after the up).
    try:
        wait_until("every program metric", lambda: not missing(), 4 * SCRAPE_S, every_s=1)
    except AssertionError:
        raise AssertionError(f"program metrics without a value in Prometheus: {missing()}") from None
    for name in ("dsv41_rank_up", "dsv41_agent_up", "dsv41_mem_available_bytes"):
        assert {r["metric"]["node"] for r in query(d, name)} == set(nodes), f"{name}: one series per node"
    assert float(query(d, "dsv41_probe_healthy")[0]["value"][1]) == 1, "the verified stand-in probes healthy"
    info = query(d, "dsv41_deployment_info")[0]["metric"]
    assert info["stack"] == d.name and info["generation"] == d.stack.outputs()["clusterGeneration"].value, info


def test_every_dashboard_panel_returns_series(supervised: Deployment) -> None:
    d = supervised
    dashboard = json.loads((OBSERVABILITY / "dashboard.json").read_text())
    panels = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    exposed = set(api(prometheus(d), "/api/v1/label/__name__/values")["data"])
    lacking = [
        f"{title}: {expr}" for title, expr in panels if any(m in expr and m not in exposed for m in STANDIN_LACKS)
    ]

    def empty() -> list[str]:
        return [f"{t}: {e}" for t, e in panels if f"{t}: {e}" not in lacking and not query(d, e)]

    # A rate needs two samples of its window: a few scrapes after the deployment.
    try:
        wait_until("every panel with series", lambda: not empty(), 3 * SCRAPE_S, every_s=1)
    except AssertionError:
        raise AssertionError("panels whose query returns no series:\n" + "\n".join(empty())) from None
    assert len(lacking) <= 4, f"only the latency panels may lack their series on the stand-in: {lacking}"


def test_status_reads_the_load_from_prometheus(supervised: Deployment) -> None:
    d = supervised
    got = operator(d, "components", "status", "--stack", d.name, "--json")
    assert got.returncode == 0, got.stdout + got.stderr
    metrics = json.loads(got.stdout)["metrics"]
    assert metrics["source"] == "prometheus" and metrics["note"] is None, json.dumps(metrics)
    # A number, not 0: the supervisor's probe (every 5 s here) may be running at the scrape.
    assert metrics["error"] is None and metrics["requestsRunning"] in (0, 1), metrics


@pytest.mark.timeout(420)
def test_a_killed_worker_shows_within_a_scrape_and_fires_rank_down(supervised: Deployment) -> None:
    d = supervised
    worker = d.sim["nodes"][1]
    node = f"node-{worker['index']}"
    rank_up = f'dsv41_rank_up{{node="{node}"}}'

    def value(expr: str) -> float | None:
        got = query(d, expr)
        return float(got[0]["value"][1]) if got else None

    assert value(rank_up) == 1
    restarts_before = value('sum(dsv41_restarts_total{cause="rank_exited"})') or 0
    # Paused, the supervisor leaves the rank down long enough for the alert's `for` (rules.yml: 30 s); that it
    # did not act all along is the pause's proof (its every look saw the dead rank).
    supervisor_cli(d, "pause")
    before = status(d)
    assert before["paused"] is True
    try:
        killed = time.monotonic()
        assert docker_on(worker["index"], "kill", d.container(worker)).returncode == 0
        wait_until("the rank-down series", lambda: value(rank_up) == 0, SCRAPE_S + SCRAPE_MARGIN_S, every_s=0.2)
        seen_s = time.monotonic() - killed
        print(f"\n[observability] worker killed -> dsv41_rank_up 0 in Prometheus after {seen_s:.1f} s")

        def alert(state: str) -> dict[str, Any] | None:
            for a in api(prometheus(d), "/api/v1/alerts")["data"]["alerts"]:
                if a["labels"]["alertname"] == "Dsv41RankDown" and a["labels"].get("node") == node:
                    return a if a["state"] == state else None
            return None

        wait_until("Dsv41RankDown pending", lambda: alert("pending") or alert("firing"), 2 * SCRAPE_S + 5)
        firing = wait_until("Dsv41RankDown firing", lambda: alert("firing"), 30 + 3 * SCRAPE_S + 5)
        assert firing["labels"]["severity"] == "critical" and node in firing["annotations"]["summary"], firing
        print(f"[observability] Dsv41RankDown firing {time.monotonic() - killed:.1f} s after the kill")
        held = status(d)
        assert restarts(held) == restarts(before), "a paused supervisor must not act"
        assert "paused" in held["doing"], held["doing"]
        state = docker_on(worker["index"], "inspect", "-f", "{{.State.Running}}", d.container(worker)).stdout
        assert state.strip() == "false", "the paused supervisor left the rank down"
    finally:
        supervisor_cli(d, "resume")
    after = wait_for(d, "a restart after resume", restarted(before), 300)
    assert restarts(after)[-1]["result"] == "verified", restarts(after)[-1]
    # Resumed, the supervisor heals it and the restart is counted by its cause.
    wait_until("the rank up again", lambda: value(rank_up) == 1, 240, every_s=1)
    wait_until(
        "the restart counted",
        lambda: (value('sum(dsv41_restarts_total{cause="rank_exited"})') or 0) > restarts_before,
        4 * SCRAPE_S,
    )
