"""The observability layer under the recording mock: what runs where, bounded, wired to the supervisor."""

from __future__ import annotations

from typing import Any

import yaml

from components.config import parse
from components.deployment import deploy
from components.observability import spec
from tests.support import recording
from tests.support.graph import CONTAINER, FIXTURES, config, run

VOLUME = "docker:index/volume:Volume"


def uploads(reg: recording.Registration) -> dict[str, Any]:
    items = reg.inputs.get("uploads", [])
    if isinstance(items, dict):  # a secret on the wire: the list with the key or token in it
        items = items["value"]
    return {u["file"]: u.get("content") for u in items}


def data_volumes(rec: recording.Recorded) -> list[recording.Registration]:
    return [v for v in rec.of_type(VOLUME) if v.name == "observability-prometheus-data"]


def test_prometheus_runs_on_the_head_bounded_with_the_rules_and_the_vllm_key() -> None:
    rec = run(config())
    prom = rec.named("observability-prometheus")
    assert prom.inputs["name"] == "dsv41-exl3-dev-prometheus"
    assert prom.inputs["memory"] == 60 and prom.inputs["memorySwap"] == 60, "bounded, no swap"
    assert prom.inputs["envs"] == ["GOMEMLIMIT=48MiB"], "Go collects before the kernel's OOM kill"
    assert prom.inputs["restart"] == "unless-stopped" and prom.inputs["networkMode"] == "host"
    assert "--web.listen-address=10.0.0.1:18390" in prom.inputs["entrypoints"], "the head's SSH address"
    assert "--storage.tsdb.retention.time=168h" in prom.inputs["entrypoints"]
    files = uploads(prom)
    cfg = yaml.safe_load(files[f"{spec.CONFIG_DIR}/prometheus.yml"])
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["vllm"]["static_configs"][0]["targets"] == ["10.0.0.1:8888"]
    assert jobs["vllm"]["authorization"]["credentials_file"] == f"{spec.CONFIG_DIR}/api_key"
    assert [c["targets"][0] for c in jobs["dsv41"]["static_configs"]] == ["192.168.100.1:18392", "192.168.100.2:18392"]
    assert "Dsv41RankDown" in files[f"{spec.CONFIG_DIR}/rules.yml"]
    assert "uploads" in prom.secret_paths(), "the API key is uploaded as a secret"
    assert "::access-spark-0-docker::" in prom.provider, "on the head's docker"


def test_every_node_runs_an_exporter_on_its_fabric_address_beside_the_supervisor() -> None:
    rec = run(config())
    for i, node in enumerate(("spark-0", "spark-1")):
        exp = rec.named(f"observability-exporter-{node}")
        files = uploads(exp)
        cfg = yaml.safe_load(files[f"{spec.EXPORTER_DIR}/config.json"])
        assert cfg["listen_host"] == f"192.168.100.{i + 1}" and cfg["leader"] == (i == 0)
        assert cfg["agent_url"] == f"http://192.168.100.{i + 1}:18391"
        assert f"{spec.EXPORTER_DIR}/components/observability/metrics.py" in files
        assert "uploads" in exp.secret_paths(), "the supervisor's token is uploaded as a secret"
        assert exp.inputs["mounts"][0]["readOnly"] is True, "the watchdog's log is read only"
        supervisor = rec.named(f"supervisor-{node}")
        home = rec.named(f"observability-{node}-home")
        assert rec.depends_on(exp, home) and rec.depends_on(home, rec.named("verify")), "after the verifier"
        # Beside the agent, not after it: the exporter asks it at every scrape and says when it does not answer.
        assert not rec.depends_on(home, supervisor) and not rec.depends_on(exp, supervisor)


def test_the_data_volume_is_kept_on_destroy_only_with_keep_data() -> None:
    assert not data_volumes(run(config()))[0].retain_on_delete
    raw = config()
    raw["observability"] = {"keepData": True}
    assert data_volumes(run(raw))[0].retain_on_delete


def test_off_is_one_line_of_config_and_off_with_the_supervisor() -> None:
    for section in ({"observability": {"enabled": False}}, {"supervisor": {"enabled": False}}):
        raw = {**config(), **section}
        rec = recording.run(lambda raw=raw: deploy(parse(raw), "dev"), FIXTURES)  # type: ignore[misc]
        assert not [c for c in rec.of_type(CONTAINER) if c.name.startswith("observability-")], section
        assert not data_volumes(rec)


def test_no_node_exporter_when_its_image_is_empty() -> None:
    raw = config()
    raw["observability"] = {"nodeExporterImage": ""}
    names = [c.name for c in run(raw).of_type(CONTAINER)]
    assert not [n for n in names if "node-exporter" in n]
    assert "observability-exporter-spark-1" in names
