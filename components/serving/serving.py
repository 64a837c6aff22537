"""Serving: one vLLM container per node, head and workers rendered from one spec.

Ordering encodes the hardware's rendezvous: every worker's container is created before
the head's (a headless worker blocks in init_process_group until the head comes), and
nothing here waits on health; the gates after this layer do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pulumi
import pulumi_docker as docker
from pulumi_command import remote

from components import labels, scripts
from components.config import Node, Settings
from components.serving import spec as serve_spec


@dataclass(frozen=True, kw_only=True)
class RankInputs:
    """What one node's container needs from the layers before it."""

    node: Node
    provider: docker.Provider
    image_id: pulumi.Input[str]
    gid_index: pulumi.Input[int | None]
    model_source: pulumi.Input[str]
    engram_source: pulumi.Input[str]
    mount_type: Literal["bind", "volume"]
    depends_on: list[pulumi.Resource] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ServingClusterArgs:
    settings: Settings
    stack: str
    generation: str
    ranks: list[RankInputs]  # rank order: the head first
    replace_when: pulumi.Input[str] | None
    """Every rank is replaced when this changes (LiveRanks' id: a rank found not running)."""
    head_connection: pulumi.Input[remote.ConnectionArgs]
    """The head's SSH connection: the API key file is written there."""
    state_dir: str
    """The stack's state directory on a node, under the SSH user's home (`.local/state/<prefix>`)."""
    api_key: pulumi.Input[str] | None
    """The key the head serves with, a secret; None: the endpoint is open."""


KEY_NAME = "api-key"


def _key_script(node: Node, state_dir: str, action: str) -> str:
    values = {"ACTION": action, "NODE": node.name, "STATE_DIR": state_dir, "KEY_NAME": KEY_NAME}
    return scripts.sh_command(scripts.render("serving/api_key.sh", values), timeout_s=30)


def _env(settings: Settings, node: Node, gid: int | None) -> list[str]:
    # No credential: the head's API key is a file (spec.KEY_FILE), so a preview shows each env change in clear.
    return serve_spec.env_list(serve_spec.node_env(settings, node, gid))


class ServingCluster(pulumi.ComponentResource):
    """Every rank's container."""

    container_names: dict[str, str]
    """Per node name, the container's name."""
    container_ids: pulumi.Output[list[str]]
    """Every rank's container id, head first: the gates and the verifier re-run when one changes."""
    containers: dict[str, docker.Container]
    """Per node name, the container resource."""
    generation: pulumi.Output[str]
    """The generation label every rank carries (config plus what each node resolved)."""

    def __init__(self, name: str, args: ServingClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("dsv41-exl3:serving:ServingCluster", name, None, opts)
        s = args.settings
        self.containers = {}
        self.container_names = {}
        self.key_file = self._key_file(name, args)
        # The key file command's id is new exactly when the key is (its trigger): the key itself, or a hash of it,
        # never enters a label.
        key_version = self.key_file.id if self.key_file is not None else None
        # Every rank carries one generation label: a change that would replace any rank replaces all.
        generation = pulumi.Output.all(
            *[pulumi.Output.all(r.image_id, r.gid_index, r.model_source, r.engram_source) for r in args.ranks],
            key_version,
        ).apply(lambda per_node: serve_spec.runtime_generation(args.generation, list(per_node)))
        self.generation = generation
        workers = [(rank, r) for rank, r in enumerate(args.ranks) if rank > 0]
        worker_containers = [self._container(name, args, rank, r, generation, []) for rank, r in workers]
        head = self._container(name, args, 0, args.ranks[0], generation, worker_containers)
        ordered = [head, *worker_containers]
        self.container_ids = pulumi.Output.all(*[c.id for c in ordered])
        self.register_outputs(
            {
                "containerNames": self.container_names,
                "containerIds": self.container_ids,
                "clusterGeneration": generation,
                "tensorParallelSize": s.tensor_parallel_size,
            }
        )

    def _key_file(self, name: str, args: ServingClusterArgs) -> remote.Command | None:
        """The endpoint's API key as a 0600 file on the head (stdin, never argv); None for an open endpoint."""
        if args.api_key is None:
            return None
        key = pulumi.Output.secret(args.api_key)
        head = args.settings.head
        return remote.Command(
            f"{name}-{head.name}-api-key",
            remote.CommandArgs(
                connection=args.head_connection,
                create=_key_script(head, args.state_dir, "write"),
                update=_key_script(head, args.state_dir, "write"),
                delete=_key_script(head, args.state_dir, "remove"),
                stdin=key,
                # A new key: a new command (and id), so every rank is replaced with the new file in place.
                triggers=[key],
                add_previous_output_in_env=False,
            ),
            # The old file's removal must come before the new key is written, not after.
            pulumi.ResourceOptions(parent=self, delete_before_replace=True),
        )

    def _container(
        self,
        name: str,
        args: ServingClusterArgs,
        rank: int,
        r: RankInputs,
        generation: pulumi.Output[str],
        after: list[docker.Container],
    ) -> docker.Container:
        s, node, shape = args.settings, r.node, serve_spec.DOCKER_RUN
        cname = labels.container_name(args.stack, node.name)
        caches = [
            docker.Volume(
                f"{name}-{node.name}-{cache}-cache",
                name=f"{cname}-{cache}-cache",
                labels=[docker.VolumeLabelArgs(label=labels.STACK_LABEL, value=args.stack)],
                opts=pulumi.ResourceOptions(parent=self, provider=r.provider),
            )
            for cache in serve_spec.CACHE_VOLUMES
        ]
        mounts = [
            docker.ContainerMountArgs(
                target=serve_spec.MODEL_MOUNT, source=r.model_source, type=r.mount_type, read_only=True
            ),
            docker.ContainerMountArgs(
                target=serve_spec.ENGRAM_MOUNT, source=r.engram_source, type=r.mount_type, read_only=True
            ),
            *[
                docker.ContainerMountArgs(target=path, source=vol.name, type="volume")
                for vol, path in zip(caches, serve_spec.CACHE_VOLUMES.values(), strict=True)
            ],
        ]
        envs = pulumi.Output.from_input(r.gid_index).apply(lambda gid: _env(s, node, gid))
        key_file = self.key_file if rank == 0 else None
        if key_file is not None:
            mounts.append(
                docker.ContainerMountArgs(
                    target=serve_spec.KEY_FILE,
                    source=key_file.stdout.apply(lambda out: out.strip()),
                    type="bind",
                    read_only=True,
                )
            )
        container = docker.Container(
            f"{name}-{node.name}",
            name=cname,
            image=r.image_id,
            entrypoints=serve_spec.container_entrypoint(
                s, node, key_file=serve_spec.KEY_FILE if key_file is not None else None
            ),
            command=serve_spec.rank_command(s, rank),
            envs=envs,
            gpus=node.gpus or None,
            devices=[docker.ContainerDeviceArgs(host_path=d, container_path=d) for d in node.rdma_devices],
            network_mode="host",
            ipc_mode=s.container.ipc_mode,
            shm_size=shape.shm_size_mb,
            ulimits=[
                docker.ContainerUlimitArgs(
                    name="memlock", soft=s.container.memlock_bytes, hard=s.container.memlock_bytes
                ),
                docker.ContainerUlimitArgs(name="stack", soft=shape.stack_bytes, hard=shape.stack_bytes),
            ],
            capabilities=docker.ContainerCapabilitiesArgs(adds=list(shape.capabilities)),
            mounts=mounts,
            labels=generation.apply(
                lambda g: [
                    docker.ContainerLabelArgs(label=k, value=v)
                    for k, v in labels.container_labels(args.stack, args.generation, g, rank).items()
                ]
            ),
            # A crashed rank must stay down: restarted alone it would block at rendezvous forever.
            restart="no",
            # Whether a rank runs is the gates' and LiveRanks' call, never the provider's: with must_run, older
            # upstream providers delete a container that exits at once ("container exited immediately", vLLM's
            # own error gone with it), the pinned one flips must_run in the state and on the next update starts
            # that one rank alone. Kept as it is, the rendezvous gate shows its exit code and last lines.
            must_run=False,
            stop_timeout=shape.stop_timeout_s,
            destroy_grace_seconds=shape.stop_timeout_s,
            log_opts={"max-size": "100m", "max-file": "3"},
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=r.provider,
                depends_on=[*r.depends_on, *caches, *after, *([key_file] if key_file is not None else [])],
                # Fixed names, and 128 GB of unified memory: the old rank must be gone first.
                delete_before_replace=True,
                replacement_trigger=args.replace_when,
            ),
        )
        self.containers[node.name] = container
        self.container_names[node.name] = cname
        return container
