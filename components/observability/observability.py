"""Observability: Prometheus on the head, the program's exporter and a node exporter on every node.

Per node: the exporter (a container of the serving image running exporter.py, restart `unless-stopped` like the
supervisor's agent, reading its node's agent with the supervisor's token and the stack's watchdog log) and,
with `observability.nodeExporterImage`, a node exporter. On the head: Prometheus with its config and the
committed rules uploaded into the container, memory bounded, its data in a volume that `destroy` removes unless
`observability.keepData`. Every container uses host networking and listens on an address of its node the program
decided (spec.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_docker as docker
from pulumi_command import remote

from components import scripts
from components.config import Settings
from components.image.node_image import NodeImage, NodeImageArgs
from components.observability import spec

REPO = Path(__file__).resolve().parents[2]
RULES = Path(__file__).with_name("rules.yml")
LABEL = "dsv41-exl3.observability"


@dataclass(frozen=True, kw_only=True)
class ObservedNode:
    name: str
    index: int
    connection: pulumi.Input[remote.ConnectionArgs]
    docker_provider: docker.Provider
    image_id: pulumi.Input[str]
    """The serving image (the exporter runs in it: every vLLM image has prometheus_client)."""
    agent_url: str


@dataclass(frozen=True, kw_only=True)
class ObservabilityArgs:
    settings: Settings
    stack: str
    stack_prefix: str
    token: str
    generation: pulumi.Input[str]
    api_key: pulumi.Output[str] | None
    nodes: Sequence[ObservedNode]
    head_address: str
    """The head's address (components/access/addresses.py): Prometheus listens there and scrapes vLLM there."""
    after: Sequence[pulumi.Resource]
    """The supervisor: the exporters read its agents."""


def _home_script(prefix: str) -> str:
    # The watchdog's state directory (its log) is bind-mounted into the exporter: it must exist first.
    return f'set -eu\nmkdir -p "$HOME/.local/state/{prefix}"\nprintf "%s" "$HOME"\n'


def _exporter_uploads(config: pulumi.Input[str], token: str) -> list[docker.ContainerUploadArgs]:
    files = [
        docker.ContainerUploadArgs(file=f"{spec.EXPORTER_DIR}/{name}", content=(REPO / name).read_text())
        for name in spec.EXPORTER_FILES
    ]
    files.append(docker.ContainerUploadArgs(file=f"{spec.EXPORTER_DIR}/config.json", content=config))
    files.append(
        docker.ContainerUploadArgs(
            file=f"{spec.EXPORTER_DIR}/token", content=pulumi.Output.secret(token), permissions="0600"
        )
    )
    return files


class Observability(pulumi.ComponentResource):
    prometheus_url: str
    """Prometheus on the head (`prometheusUrl`)."""
    containers: dict[str, docker.Container]
    """Every container of the layer by a stable key (`prometheus`, `exporter-<node>`, `node-exporter-<node>`)."""

    def __init__(self, name: str, args: ObservabilityArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("dsv41-exl3:observability:Observability", name, None, opts)
        s = args.settings
        o = s.observability
        prefix = args.stack_prefix
        self.containers = {}
        head = next(n for n in args.nodes if n.index == 0)
        for node in args.nodes:
            home = remote.Command(
                f"{name}-{node.name}-home",
                connection=node.connection,
                create=scripts.sh_command(_home_script(prefix), timeout_s=60, name="observability-home"),
                add_previous_output_in_env=False,
                opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after)),
            )
            config = pulumi.Output.all(args.generation, node.image_id).apply(
                functools.partial(_exporter_json, s, args.stack, node.index, node.agent_url, head.agent_url)
            )
            self.containers[f"exporter-{node.name}"] = docker.Container(
                f"{name}-exporter-{node.name}",
                name=f"{prefix}-exporter-{node.name}",
                image=node.image_id,
                entrypoints=[
                    "python3",
                    "-u",
                    "-m",
                    spec.EXPORTER_MODULE,
                    f"{spec.EXPORTER_DIR}/config.json",
                ],
                working_dir=spec.EXPORTER_DIR,
                envs=[f"PYTHONPATH={spec.EXPORTER_DIR}", "PYTHONDONTWRITEBYTECODE=1"],
                network_mode="host",
                restart="unless-stopped",
                memory=spec.EXPORTER_MEMORY_MB,
                memory_swap=spec.EXPORTER_MEMORY_MB,
                uploads=_exporter_uploads(config, args.token),
                mounts=[
                    docker.ContainerMountArgs(
                        target=spec.WATCHDOG_DIR,
                        source=home.stdout.apply(lambda h: f"{h}/.local/state/{prefix}"),
                        type="bind",
                        read_only=True,
                    )
                ],
                labels=[docker.ContainerLabelArgs(label=LABEL, value=args.stack)],
                log_opts={"max-size": "10m", "max-file": "3"},
                must_run=True,
                opts=pulumi.ResourceOptions(
                    parent=self, provider=node.docker_provider, depends_on=[home], delete_before_replace=True
                ),
            )
            if o.node_exporter_image:
                image = NodeImage(
                    f"{name}-node-exporter-image-{node.name}",
                    NodeImageArgs(
                        image=o.node_exporter_image,
                        provider=node.docker_provider,
                        pull_timeout_minutes=s.image_pull_timeout_minutes,
                    ),
                    opts=pulumi.ResourceOptions(parent=self),
                )
                fabric_ip = s.nodes[node.index].fabric_ip
                self.containers[f"node-exporter-{node.name}"] = docker.Container(
                    f"{name}-node-exporter-{node.name}",
                    name=f"{prefix}-node-exporter-{node.name}",
                    image=image.image_id,
                    entrypoints=spec.node_exporter_args(s, fabric_ip),
                    network_mode="host",
                    restart="unless-stopped",
                    memory=spec.NODE_EXPORTER_MEMORY_MB,
                    memory_swap=spec.NODE_EXPORTER_MEMORY_MB,
                    labels=[docker.ContainerLabelArgs(label=LABEL, value=args.stack)],
                    log_opts={"max-size": "10m", "max-file": "3"},
                    must_run=True,
                    opts=pulumi.ResourceOptions(parent=self, provider=node.docker_provider, delete_before_replace=True),
                )

        prom_image = NodeImage(
            f"{name}-prometheus-image",
            NodeImageArgs(
                image=o.prometheus_image,
                provider=head.docker_provider,
                pull_timeout_minutes=s.image_pull_timeout_minutes,
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        data = docker.Volume(
            f"{name}-prometheus-data",
            name=f"{prefix}-prometheus-data",
            labels=[docker.VolumeLabelArgs(label=LABEL, value=args.stack)],
            opts=pulumi.ResourceOptions(parent=self, provider=head.docker_provider, retain_on_delete=o.keep_data),
        )
        key_file = f"{spec.CONFIG_DIR}/api_key" if args.api_key is not None else None
        uploads = [
            docker.ContainerUploadArgs(
                file=f"{spec.CONFIG_DIR}/prometheus.yml",
                content=spec.prometheus_config(s, args.stack, head_address=args.head_address, api_key_file=key_file),
            ),
            docker.ContainerUploadArgs(file=f"{spec.CONFIG_DIR}/rules.yml", content=RULES.read_text()),
        ]
        if args.api_key is not None and key_file is not None:
            uploads.append(docker.ContainerUploadArgs(file=key_file, content=args.api_key, permissions="0644"))
        self.containers["prometheus"] = docker.Container(
            f"{name}-prometheus",
            name=f"{prefix}-prometheus",
            image=prom_image.image_id,
            entrypoints=spec.prometheus_args(s, args.head_address),
            envs=spec.prometheus_env(s),
            network_mode="host",
            restart="unless-stopped",
            memory=o.memory_mib,
            memory_swap=o.memory_mib,
            uploads=uploads,
            mounts=[docker.ContainerMountArgs(target=spec.DATA_DIR, source=data.name, type="volume")],
            labels=[docker.ContainerLabelArgs(label=LABEL, value=args.stack)],
            log_opts={"max-size": "10m", "max-file": "3"},
            must_run=True,
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=head.docker_provider,
                depends_on=list(self.containers.values()),
                delete_before_replace=True,
            ),
        )
        self.prometheus_url = spec.prometheus_url(s, args.head_address)
        self.register_outputs({"prometheusUrl": self.prometheus_url})


def _exporter_json(s: Settings, stack: str, index: int, agent_url: str, leader_url: str, v: list[str]) -> str:
    cfg = spec.exporter_config(
        s, stack, index, generation=v[0], image_id=v[1], agent_url=agent_url, leader_url=leader_url
    )
    return cfg.to_json()
