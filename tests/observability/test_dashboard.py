"""The Grafana dashboard: importable JSON whose every query a real Prometheus accepts."""

from __future__ import annotations

import json
from pathlib import Path

from tests.observability.tools import OBSERVABILITY, api, prometheus

DASHBOARD = OBSERVABILITY / "dashboard.json"


def queries() -> list[tuple[str, str]]:
    data = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in data["panels"] for t in p["targets"]]


def test_the_dashboard_is_importable_json_with_a_prometheus_datasource_variable() -> None:
    data = json.loads(DASHBOARD.read_text())
    assert data["uid"] and data["title"] and data["panels"]
    assert [v["name"] for v in data["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for p in data["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    text = " ".join(e for _, e in queries())
    for metric in (
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "dsv41_mem_available_bytes",
        "dsv41_rank_up",
        "dsv41_restarts_total",
    ):
        assert metric in text, f"no panel reads {metric}"


def test_prometheus_accepts_every_panels_query(tmp_path: Path) -> None:
    with prometheus(tmp_path) as base:
        for title, expr in queries():
            got = api(base, "/api/v1/query", {"query": expr})
            assert got.get("status") == "success", f"panel {title!r}: {expr}: {got.get('error')}"
            bad = api(base, "/api/v1/query", {"query": "sum(rate(x[1m]"})
        assert bad.get("status") == "error", "a broken query is refused (the test can fail)"
