"""The observability layer on the simulated cluster: a supervised stand-in deployment observed by the sim's
Prometheus (Debian's binaries, `sim/image/prometheus.sh`), read only through Prometheus' HTTP API.

One deployment serves the module, in order: every target up and every program metric with a value, every
dashboard panel with series, a killed worker seen and alerted on, and last the layer's removal (`up` with it
off, then `destroy` with `keepData`).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from program_support import REPO, Deployment, assert_verified, docker_on, new_deployment, remove_deployment

from components import labels
from components.observability.observability import LABEL
from sim import cluster
from tests.observability.tools import api

pytestmark = [pytest.mark.sim, pytest.mark.engine]

OBSERVABILITY = REPO / "components" / "observability"
SCRAPE_S = 5  # sim_config's observability.scrapeSeconds (also the rules' evaluation interval)
# What one scrape may add to its interval: the exporter asks two agents, Prometheus commits the sample.
SCRAPE_MARGIN_S = 5
# The stand-in's /metrics has no request latency histograms (sim/standin/vllm_standin.py `metrics`): the
# panels on these read nothing there. Real vLLM has them (tests/support/fixtures/real-vllm/metrics).
STANDIN_LACKS = ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket")


def configure(config: dict[str, Any]) -> None:
    # A probe every 5 s and a quick restart: the heal after the kill test is short.
    config["supervisor"].update({"probeSeconds": 5, "backoffSeconds": 1, "maxRestarts": 3, "windowHours": 1})
    assert config["observability"]["scrapeSeconds"] == SCRAPE_S
    # Nodes given by host name, as owners give theirs (`spark-1`): on its own node each name resolves to
    # 127.0.1.1, as Ubuntu's /etc/hosts has it, and on this machine to the node's address (sim/cluster.py).
    for node in config["nodes"]:
        node["host"] = cluster.Layout.node_name(int(node["name"].removeprefix("node-")))


@pytest.fixture(scope="module")
def weights_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-observability-weights-", dir="/var/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def observed(
    sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path, weights_root: Path
) -> Iterator[Deployment]:
    d = new_deployment(
        sim,
        f"obs-{uuid.uuid4().hex[:6]}",
        program_env,
        pulumi_root,
        weights_root=weights_root,
        port=18911,
        master_port=29661,
        supervisor=True,
        observability=True,
        configure=configure,
    )
    try:
        assert_verified(d, d.up().outputs)
        yield d
    finally:
        try:
            remove_deployment(d)
        finally:
            docker_on(sim["nodes"][0]["index"], "volume", "rm", "-f", data_volume(d))


def data_volume(d: Deployment) -> str:
    return f"{labels.stack_prefix('dsv41-exl3', d.name)}-prometheus-data"


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


def layer_containers(d: Deployment) -> dict[int, list[str]]:
    """The observability containers on each node, by the layer's label."""
    out = {}
    for n in d.sim["nodes"]:
        ps = docker_on(n["index"], "ps", "-a", "--filter", f"label={LABEL}={d.name}", "--format", "{{.Names}}")
        assert ps.returncode == 0, ps.stderr
        out[n["index"]] = sorted(ps.stdout.split())
    return out


def volume_exists(d: Deployment) -> bool:
    inspected = docker_on(d.sim["nodes"][0]["index"], "volume", "inspect", data_volume(d))
    return bool(inspected.returncode == 0)


def operator(d: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` as the operator runs it beside the stack."""
    env = {**os.environ, **d.env, "PATH": f"{d.pulumi_root / 'bin'}:{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def supervisor_cli(d: Deployment, action: str) -> None:
    proc = operator(d, "components.supervisor", action, "--stack", d.name)
    assert proc.returncode == 0, f"supervisor {action}: {proc.stdout}{proc.stderr}"


def test_every_target_is_up_and_every_program_metric_has_a_value(observed: Deployment) -> None:
    d = observed
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


def test_every_dashboard_panel_returns_series(observed: Deployment) -> None:
    d = observed
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


def test_status_reads_the_load_from_prometheus(observed: Deployment) -> None:
    d = observed
    got = operator(d, "components.status", "--stack", d.name, "--json")
    assert got.returncode == 0, got.stdout + got.stderr
    metrics = json.loads(got.stdout)["metrics"]
    assert metrics["source"] == "prometheus" and metrics["note"] is None, json.dumps(metrics)
    # A number, not 0: the supervisor's probe (every 5 s here) may be running at the scrape.
    assert metrics["error"] is None and metrics["requestsRunning"] in (0, 1), metrics


@pytest.mark.timeout(420)
def test_a_killed_worker_shows_within_a_scrape_and_fires_rank_down(observed: Deployment) -> None:
    d = observed
    worker = d.sim["nodes"][1]
    node = f"node-{worker['index']}"
    rank_up = f'dsv41_rank_up{{node="{node}"}}'

    def value(expr: str) -> float | None:
        got = query(d, expr)
        return float(got[0]["value"][1]) if got else None

    assert value(rank_up) == 1
    restarts_before = value('sum(dsv41_restarts_total{cause="rank_exited"})') or 0
    # Paused, the supervisor leaves the rank down long enough for the alert's `for` (rules.yml: 30 s).
    supervisor_cli(d, "pause")
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
    finally:
        supervisor_cli(d, "resume")
    # Resumed, the supervisor heals it and the restart is counted by its cause.
    wait_until("the rank up again", lambda: value(rank_up) == 1, 240, every_s=1)
    wait_until(
        "the restart counted",
        lambda: (value('sum(dsv41_restarts_total{cause="rank_exited"})') or 0) > restarts_before,
        4 * SCRAPE_S,
    )


@pytest.mark.timeout(600)
def test_destroy_removes_the_layer_and_keeps_its_data_only_with_keep_data(observed: Deployment) -> None:
    d = observed
    nodes = [n["index"] for n in d.sim["nodes"]]
    before = layer_containers(d)
    prefix = labels.stack_prefix("dsv41-exl3", d.name)
    assert before[nodes[0]] == sorted(
        [f"{prefix}-prometheus", f"{prefix}-exporter-node-{nodes[0]}", f"{prefix}-node-exporter-node-{nodes[0]}"]
    ), before
    assert all(len(before[i]) == 2 for i in nodes[1:]), before
    assert volume_exists(d)

    # Off is one line of config: the layer goes, its data with it (no keepData); the serving stays.
    off = json.loads(json.dumps(d.config))
    off["observability"]["enabled"] = False
    d.write_config(off)
    d.up()
    assert all(not names for names in layer_containers(d).values()), layer_containers(d)
    assert not volume_exists(d), "without observability.keepData the data volume goes with the layer"
    assert "prometheusUrl" not in d.stack.outputs()
    for n in d.sim["nodes"]:
        assert docker_on(n["index"], "inspect", "-f", "{{.State.Running}}", d.container(n)).stdout.strip() == "true"

    # Back, with keepData: destroy removes every container of the layer and leaves the data volume.
    kept = json.loads(json.dumps(d.config))
    kept["observability"].update({"enabled": True, "keepData": True})
    d.write_config(kept)
    d.up()
    assert layer_containers(d) == before, "the layer is back as it was"
    d.stack.destroy(on_output=lambda _line: None, color="never")
    assert all(not names for names in layer_containers(d).values()), layer_containers(d)
    assert volume_exists(d), "observability.keepData keeps Prometheus' data volume through destroy"
