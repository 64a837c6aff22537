"""WeightStore: the checkpoint staged once on the head and made visible to every node.

Staging is one remote command on the head that is kept on destroy: destroying the stack never deletes
hundreds of GiB of weights. Workers see them through the same filesystem (`bind`), through docker volumes
that mount the head's read-only NFS export (`nfs`), or keep their own verified copy, filled from the head once
and kept (`copy`, components/weights/worker_copy.py). A per-node check proves, from that node's side, that
every staged file is there before any container is started on it.

Every rank, in every share mode, mounts `model/` at /model and the slim Engram directory `engram-vllm/` (built by
staging: hardlinks of shards 47/48 and config.json, an index of the Engram embed tables only; see
manifest.ENGRAM_VLLM_DIR) at /engram-src, never `engram-src/` itself: its native index names all 48 shards of the
base model, and vLLM's loader would look for every one. A worker's share or copy holds those two directories.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import pulumi
import pulumi_docker as docker
from pulumi_command import remote

from components.scripts import sh_command
from components.ssh import SshAccess
from components.weights import manifest as wm
from components.weights.worker_copy import WorkerCopy, WorkerCopyArgs


@dataclass(frozen=True, kw_only=True)
class WeightNode:
    name: str
    connection: remote.ConnectionArgs
    """Secret SSH connection (built by NodeAccess)."""
    fabric_ip: str
    """The node's CX-7 address: the NFS export, and a copy's source, answer only the workers' ones."""
    host: str
    port: int
    user: str
    """How the deployer reaches the node over ssh (a copy's provider runs both ends)."""
    copy_root: str | None
    """share='copy', a worker: its own root for the copy (`{node}` resolved); otherwise None."""
    ready: list[pulumi.Resource]
    """What must hold on this node before its copy starts (its preflight: the disk check)."""
    docker_provider: docker.Provider | None = None
    """The node's docker provider (ssh://); needed for the NFS volumes on workers."""
    image: pulumi.Input[str] | None = None
    """Image on THIS node for the NFS check container (defaults to the staging image); pass the node's
    pulled image id so the check waits for the pull."""


@dataclass(frozen=True, kw_only=True)
class CopySettings:
    ssh: SshAccess
    """The copy's provider opens ssh to the head and the worker itself."""
    streams: int
    timeout_s: int


@dataclass(frozen=True, kw_only=True)
class WeightStoreArgs:
    head: WeightNode
    workers: list[WeightNode]
    root: str
    """Weights root on the head, e.g. '~/dsv41-exl3' (`~` expands on the node)."""
    share: Literal["nfs", "bind", "copy"]
    staging_image: pulumi.Input[str]
    """Image (ref or id) on the head with python3 + huggingface_hub: the serving image."""
    model_repo: str
    engram_repo: str
    revision: str
    hf_token: pulumi.Input[str] | None
    """Secret; reaches the head on stdin only. None: anonymous downloads."""
    hf_endpoint: str | None
    """Mirror or hub stand-in (HF_ENDPOINT). None: the hub."""
    stage_timeout_s: int
    download_streams: int
    """Files staging downloads from the hub at once (`weights.downloadStreams`)."""
    stack_prefix: str
    """This stack's names on the nodes (`labels.stack_prefix`): export file, staging and check containers."""
    # Bounds each node's visibility check (a listing of the staged files); not an operator setting.
    check_timeout_s: int = 600
    copy: CopySettings | None
    """share='copy': how the copies are made; None otherwise."""


_MODEL_VOLUME = "model"
_ENGRAM_VOLUME = "engram-src"


def _node_key(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]", "-", name)


def _volume_name(prefix: str, which: str, options: pulumi.Output[dict[str, str]]) -> pulumi.Output[str]:
    return options.apply(lambda o: wm.volume_name(prefix, which, o))


def _volume_check(
    node: str,
    image: pulumi.Input[str],
    model_volume: pulumi.Output[str],
    engram_volume: pulumi.Output[str],
    files: pulumi.Output[dict[str, int]],
    timeout_s: int,
    stack_prefix: str,
) -> pulumi.Output[str]:
    return pulumi.Output.all(image, model_volume, engram_volume, files).apply(
        lambda a: sh_command(
            wm.render_volume_check(
                node=node,
                image=a[0],
                model_volume=a[1],
                engram_volume=a[2],
                files=a[3],
                timeout_s=timeout_s,
                stack_prefix=stack_prefix,
            )
        )
    )


class WeightStore(pulumi.ComponentResource):
    """Stages the checkpoint on the head and proves each node sees it."""

    model_source: dict[str, pulumi.Output[str]]
    """Per node: what its container mounts at /model (a host path, or a docker volume name)."""
    engram_source: dict[str, pulumi.Output[str]]
    """Per node: what its container mounts at /engram-src: the slim Engram directory (a host path or a volume)."""
    mount_type: dict[str, str]
    """Per node: 'bind' (host path) or 'volume' (docker volume)."""
    visible: dict[str, pulumi.Resource]
    """Per node: the check the node's container must depend on (weights visible there)."""
    manifest: pulumi.Output[str]
    """JSON {relative path: size} of what was staged."""
    digests: pulumi.Output[dict[str, str]]
    """{relative path: sha256} of what was staged, each verified against the hub's listing where it gives one."""
    manifest_file: pulumi.Output[str | None]
    """The staging step's record on the head (JSON; per file: repo, commit, size, sha256)."""
    root: pulumi.Output[str]
    """The absolute weights root on the head."""

    def __init__(self, name: str, args: WeightStoreArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("dsv41-exl3:weights:WeightStore", name, None, opts)
        self._validate(args)
        head = args.head
        plan = wm.staging_plan(
            model_repo=args.model_repo,
            engram_repo=args.engram_repo,
            revision=args.revision,
            download_streams=args.download_streams,
        )
        program = wm.stage_program_text()
        with_token = args.hf_token is not None
        wm.render_stage_command(
            root=args.root,
            image="probe",
            plan=plan,
            hf_endpoint=args.hf_endpoint,
            with_token=with_token,
            timeout_s=args.stage_timeout_s,
            stack_prefix=args.stack_prefix,
        )  # fail at plan time

        stdin: pulumi.Input[str]
        if args.hf_token is None:
            stdin = wm.stage_stdin(None, program)
        else:
            stdin = pulumi.Output.secret(args.hf_token).apply(lambda t: wm.stage_stdin(t, program))

        staging = remote.Command(
            f"{name}-stage",
            connection=head.connection,
            create=pulumi.Output.from_input(args.staging_image).apply(
                lambda image: sh_command(
                    wm.render_stage_command(
                        root=args.root,
                        image=image,
                        plan=plan,
                        hf_endpoint=args.hf_endpoint,
                        with_token=with_token,
                        timeout_s=args.stage_timeout_s,
                        stack_prefix=args.stack_prefix,
                    )
                )
            ),
            stdin=stdin,
            # Replace (re-stage) only when WHAT is staged changes; the token is not part of that.
            triggers=[args.model_repo, args.engram_repo, args.revision, args.root],
            add_previous_output_in_env=False,
            opts=pulumi.ResourceOptions(
                parent=self,
                retain_on_delete=True,  # destroying the stack never deletes the weights
                custom_timeouts=pulumi.CustomTimeouts(
                    create=f"{args.stage_timeout_s + 600}s", update=f"{args.stage_timeout_s + 600}s"
                ),
            ),
        )
        staged = staging.stdout.apply(wm.parse_stage_output)
        self.root = staged.apply(lambda s: s.root)
        self.manifest = staged.apply(lambda s: s.manifest_json())
        self.digests = staged.apply(lambda s: s.sha256)
        self.manifest_file = staged.apply(lambda s: s.manifest_file)
        files = staged.apply(lambda s: s.files)
        model_path = self.root.apply(lambda r: f"{r}/{wm.MODEL_DIR}")
        engram_path = self.root.apply(lambda r: f"{r}/{wm.ENGRAM_VLLM_DIR}")

        self.model_source = {}
        self.engram_source = {}
        self.mount_type = {}
        self.visible = {}

        def bind_check(node: WeightNode, deps: list[pulumi.Resource]) -> remote.Command:
            return remote.Command(
                f"{name}-visible-{_node_key(node.name)}",
                connection=node.connection,
                create=pulumi.Output.all(self.root, files).apply(
                    lambda a: sh_command(
                        wm.render_bind_check(node=node.name, abs_root=a[0], files=a[1], timeout_s=args.check_timeout_s)
                    )
                ),
                add_previous_output_in_env=False,
                opts=pulumi.ResourceOptions(parent=self, depends_on=deps),
            )

        for node in [head] + (args.workers if args.share == "bind" else []):
            self.model_source[node.name] = model_path
            self.engram_source[node.name] = engram_path
            self.mount_type[node.name] = "bind"
            self.visible[node.name] = bind_check(node, [staging])

        if args.share == "nfs":
            worker_ips = [w.fabric_ip for w in args.workers]
            export = remote.Command(
                f"{name}-nfs-export",
                connection=head.connection,
                create=self.root.apply(
                    lambda r: sh_command(
                        wm.render_export_command(
                            head_name=head.name, abs_root=r, worker_ips=worker_ips, stack_prefix=args.stack_prefix
                        )
                    )
                ),
                # Withdraws this stack's entries only; the delete recorded with the last create knows them.
                delete=self.root.apply(
                    lambda r: sh_command(
                        wm.render_unexport_command(abs_root=r, worker_ips=worker_ips, stack_prefix=args.stack_prefix)
                    )
                ),
                add_previous_output_in_env=False,
                opts=pulumi.ResourceOptions(parent=self, depends_on=[staging]),
            )
            for worker in args.workers:
                key = _node_key(worker.name)
                volumes: dict[str, docker.Volume] = {}
                # Named after the mount each volume backs (/model, /engram-src), as before the slim Engram
                # directory: a changed device path makes a new volume (its name carries the options' digest).
                for which, path in ((_MODEL_VOLUME, model_path), (_ENGRAM_VOLUME, engram_path)):
                    options = path.apply(lambda p: wm.nfs_volume_options(head_ip=head.fabric_ip, device_path=p))
                    volumes[which] = docker.Volume(
                        f"{name}-{key}-{which}",
                        name=_volume_name(f"{name}-{key}", which, options),
                        driver="local",
                        driver_opts=options,
                        opts=pulumi.ResourceOptions(parent=self, provider=worker.docker_provider, depends_on=[export]),
                    )
                model_vol, engram_vol = volumes[_MODEL_VOLUME], volumes[_ENGRAM_VOLUME]
                image = worker.image if worker.image is not None else args.staging_image
                check = remote.Command(
                    f"{name}-visible-{key}",
                    connection=worker.connection,
                    create=_volume_check(
                        worker.name,
                        image,
                        model_vol.name,
                        engram_vol.name,
                        files,
                        args.check_timeout_s,
                        args.stack_prefix,
                    ),
                    add_previous_output_in_env=False,
                    opts=pulumi.ResourceOptions(parent=self, depends_on=[staging, export, model_vol, engram_vol]),
                )
                self.model_source[worker.name] = model_vol.name
                self.engram_source[worker.name] = engram_vol.name
                self.mount_type[worker.name] = "volume"
                self.visible[worker.name] = check

        if args.share == "copy":
            assert args.copy is not None  # _validate
            # A worker's copy holds what its rank reads: model/ and the slim Engram directory.
            served = files.apply(wm.served_files)
            served_sha256 = pulumi.Output.all(served, self.digests).apply(
                lambda a: {p: a[1][p] for p in a[0] if p in a[1]}
            )
            for worker in args.workers:
                assert worker.copy_root is not None
                copy = WorkerCopy(
                    f"{name}-copy-{_node_key(worker.name)}",
                    WorkerCopyArgs(
                        worker=worker.name,
                        worker_host=worker.host,
                        worker_port=worker.port,
                        worker_user=worker.user,
                        worker_fabric_ip=worker.fabric_ip,
                        head=head.name,
                        head_host=head.host,
                        head_port=head.port,
                        head_user=head.user,
                        head_fabric_ip=head.fabric_ip,
                        ssh_private_key=args.copy.ssh.private_key,
                        ssh_agent_socket=args.copy.ssh.agent_socket,
                        ssh_known_hosts_file=args.copy.ssh.known_hosts_file,
                        head_root=self.root,
                        head_image=args.staging_image,
                        worker_image=worker.image if worker.image is not None else args.staging_image,
                        copy_root=worker.copy_root,
                        files=served,
                        sha256=served_sha256,
                        streams=args.copy.streams,
                        timeout_s=args.copy.timeout_s,
                        stack_prefix=args.stack_prefix,
                    ),
                    opts=pulumi.ResourceOptions(parent=self, depends_on=[staging, *worker.ready]),
                )
                # Read-only local files: the rank loads at local disk speed, never over the network.
                # From the id (the absolute root), which a preview of a repair keeps known: the rank is untouched.
                self.model_source[worker.name] = copy.id.apply(lambda r: f"{r}/{wm.MODEL_DIR}")
                self.engram_source[worker.name] = copy.id.apply(lambda r: f"{r}/{wm.ENGRAM_VLLM_DIR}")
                self.mount_type[worker.name] = "bind"
                self.visible[worker.name] = copy

        self.register_outputs(
            {
                "root": self.root,
                "manifest": self.manifest,
                "digests": self.digests,
                "manifestFile": self.manifest_file,
                "modelSource": self.model_source,
                "engramSource": self.engram_source,
                "mountType": self.mount_type,
            }
        )

    @staticmethod
    def _validate(args: WeightStoreArgs) -> None:
        """Shape errors at plan time, before anything touches a node.

        Invariants: components/config refuses a bad root, share or fabricIp and a node listed twice; these guard
        the commands rendered from them."""
        wm.root_shell_expr(args.root)
        wm.stage_container(args.stack_prefix)
        names = [args.head.name, *(w.name for w in args.workers)]
        if len(set(names)) != len(names):
            raise ValueError(f"weight store node names must be unique, got {names}")
        if args.share not in ("nfs", "bind", "copy"):
            raise ValueError(f"share={args.share!r} is not supported; use 'nfs', 'bind' or 'copy'")
        if args.share == "copy":
            if args.copy is None:
                raise ValueError("share='copy' needs copy settings (ssh, streams, timeout)")
            for w in args.workers:
                wm.validate_ip(f"worker {w.name} fabric_ip", w.fabric_ip)
                if w.copy_root is None:
                    raise ValueError(f"worker {w.name} has no copy_root; share='copy' keeps a copy on each worker")
                wm.root_value(w.copy_root)
        if args.share == "nfs":
            wm.validate_ip(f"head {args.head.name} fabric_ip", args.head.fabric_ip)
            for w in args.workers:
                wm.validate_ip(f"worker {w.name} fabric_ip", w.fabric_ip)
                if w.docker_provider is None:
                    raise ValueError(
                        f"worker {w.name} has no docker_provider; share='nfs' mounts the weights "
                        "through a docker volume on that worker"
                    )
