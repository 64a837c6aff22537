"""What the observability layer runs, as plain values: Prometheus' config and flags, the exporter's config.

Pure logic, no resources (observability.py makes them). Every address is an IP the program decided, never a name
left for a container to resolve: Prometheus runs on the head with host networking, listens on the head's address
(`nodes[0].host` as the operator's machine resolved it, checked on the head by its preflight:
components/access/addresses.py) and scrapes vLLM at that address too (the endpoint's), each node's exporter and
node exporter at the node's fabric address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from components import capacity
from components.access.addresses import host_port, http_url
from components.config import Settings
from components.observability.metrics import ExporterConfig
from components.shipped import module_files

CONFIG_DIR = "/etc/dsv41-prometheus"
DATA_DIR = "/prometheus"
EXPORTER_DIR = "/opt/dsv41-exporter"
WATCHDOG_DIR = "/var/lib/dsv41-watchdog"
# The files the exporter's container runs, uploaded into it: the exporter and what it imports (stdlib and
# prometheus_client only besides), derived from its imports.
EXPORTER_MODULE = "components.observability.exporter"
EXPORTER_FILES = module_files(EXPORTER_MODULE)
# Their memory bounds are paid from the head's prefill margin: the capacity arithmetic holds them.
EXPORTER_MEMORY_MB = capacity.EXPORTER_MEMORY_MIB
NODE_EXPORTER_MEMORY_MB = capacity.NODE_EXPORTER_MEMORY_MIB
# node_exporter's collectors: what the dashboard and a GB10 owner read; the rest only costs series.
NODE_COLLECTORS = ("meminfo", "cpu", "loadavg", "filesystem", "netdev", "diskstats", "pressure", "time")


@dataclass(frozen=True, kw_only=True)
class Target:
    job: str
    address: str
    node: str


def targets(s: Settings, head_address: str) -> list[Target]:
    """Every scrape target: vLLM on the head, then per node the exporter and (with an image) the node exporter."""
    o = s.observability
    out = [Target(job="vllm", address=host_port(head_address, s.serve.port), node=s.head.name)]
    out += [Target(job="dsv41", address=host_port(n.fabric_ip, o.exporter_port), node=n.name) for n in s.nodes]
    if o.node_exporter_image:
        out += [Target(job="node", address=host_port(n.fabric_ip, o.node_exporter_port), node=n.name) for n in s.nodes]
    return out


def prometheus_config(s: Settings, stack: str, *, head_address: str, api_key_file: str | None) -> str:
    """prometheus.yml: the scrape jobs, each target labelled with its node, and the committed rules."""
    o = s.observability
    interval = f"{o.scrape_seconds}s"
    jobs: dict[str, list[Target]] = {}
    for t in targets(s, head_address):
        jobs.setdefault(t.job, []).append(t)
    scrape: list[dict[str, Any]] = []
    for job, ts in jobs.items():
        cfg: dict[str, Any] = {
            "job_name": job,
            "static_configs": [{"targets": [t.address], "labels": {"node": t.node}} for t in ts],
        }
        if job == "vllm" and api_key_file:
            # Sent wherever a key is configured: a /metrics that does not ask for it ignores it.
            cfg["authorization"] = {"type": "Bearer", "credentials_file": api_key_file}
        scrape.append(cfg)
    data = {
        "global": {
            "scrape_interval": interval,
            "evaluation_interval": interval,
            "scrape_timeout": f"{min(10, o.scrape_seconds)}s",
            "external_labels": {"stack": stack},
        },
        "rule_files": [f"{CONFIG_DIR}/rules.yml"],
        "scrape_configs": scrape,
    }
    return yaml.safe_dump(data, sort_keys=False)


def listen_address(s: Settings, head_address: str) -> str:
    """Prometheus' listen address: the head's address, where the operator reaches it (`prometheusUrl`)."""
    return host_port(head_address, s.observability.port)


def prometheus_url(s: Settings, head_address: str) -> str:
    return http_url(head_address, s.observability.port)


def prometheus_args(s: Settings, head_address: str) -> list[str]:
    o = s.observability
    return [
        "prometheus",
        f"--config.file={CONFIG_DIR}/prometheus.yml",
        f"--storage.tsdb.path={DATA_DIR}",
        f"--storage.tsdb.retention.time={o.retention_hours}h",
        f"--storage.tsdb.retention.size={o.retention_mib}MB",
        f"--web.listen-address={listen_address(s, head_address)}",
    ]


def prometheus_env(s: Settings) -> list[str]:
    """Go's soft memory limit at 80% of the container's: the collector works harder before the kernel's OOM kill."""
    return [f"GOMEMLIMIT={s.observability.memory_mib * 4 // 5}MiB"]


def node_exporter_args(s: Settings, fabric_ip: str) -> list[str]:
    return [
        "node_exporter",
        f"--web.listen-address={host_port(fabric_ip, s.observability.node_exporter_port)}",
        "--collector.disable-defaults",
        *(f"--collector.{c}" for c in NODE_COLLECTORS),
    ]


def exporter_config(
    s: Settings, stack: str, node_index: int, *, generation: str, image_id: str, agent_url: str, leader_url: str
) -> ExporterConfig:
    """The exporter's config.json (observability/metrics.py `ExporterConfig`)."""
    node = s.nodes[node_index]
    return ExporterConfig(
        stack=stack,
        node=node.name,
        leader=node_index == 0,
        generation=generation,
        image_id=image_id,
        probe_seconds=s.supervisor.probe_seconds,
        watchdog_floor_gib=s.watchdog.mem_available_floor_gib if s.watchdog.enabled else None,
        agent_url=agent_url,
        leader_url=leader_url,
        watchdog_log=f"{WATCHDOG_DIR}/watchdog.log" if s.watchdog.enabled else "",
        token_file=f"{EXPORTER_DIR}/token",
        listen_host=node.fabric_ip,
        listen_port=s.observability.exporter_port,
    )
