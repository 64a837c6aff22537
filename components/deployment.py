"""The whole deployment: every layer, wired in the order the hardware requires.

Per node: access -> (preflight, image) -> weights visible -> container; every worker's
container before the head's; then the rendezvous gate, the ready gate and the verifier.
Only wiring lives here; each layer's logic is in its own module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pulumi

from components import host_keys, labels
from components.access import addresses as node_addresses
from components.access.addresses import AddressError, Addresses, Resolver, http_url
from components.access.node_access import NodeAccess, NodeAccessArgs
from components.access.stack_keys import StackKeys, StackKeysArgs
from components.config import Loaded, Node, Settings
from components.gates.decisions import GateBounds
from components.gates.gates import (
    MODELS_TIMEOUT_S,
    POLL_INTERVAL_S,
    PROGRESS_INTERVAL_S,
    GateRank,
    ReadyGate,
    ReadyGateArgs,
    RendezvousGate,
    RendezvousGateArgs,
)
from components.gates.live_ranks import LiveRanks, LiveRanksArgs
from components.image.image_check import checked_image_ids
from components.image.node_image import NodeImage, NodeImageArgs
from components.observability.observability import Observability, ObservabilityArgs, ObservedNode
from components.preflight.preflight import Preflight, PreflightArgs, PreflightCheck
from components.preflight.spec import OwnAddress, PreflightSpec, container_shape
from components.rollback.history import rollback_command
from components.serving import spec as serve_spec
from components.serving.api_key import with_endpoint_key
from components.serving.serving import RankInputs, ServingCluster, ServingClusterArgs
from components.ssh import KeyDirError, SshAccess, stack_dir
from components.supervisor.supervisor import (
    Supervisor,
    SupervisorArgs,
    SupervisorNode,
    agent_url,
    leader_url,
    supervisor_token,
)
from components.supervisor.update_lock import LockHeld, UpdateLock, holder_name
from components.verify.verifier import Verifier, VerifierArgs
from components.watchdog.watchdog import MemoryWatchdog, MemoryWatchdogArgs, WatchdogKey, WatchdogKeyArgs, WatchdogPeer
from components.weights.weight_store import CopySettings, WeightNode, WeightStore, WeightStoreArgs


def _node_spec_hash(loaded: Loaded, generation: str, name: str) -> str:
    node = next(n for n in loaded.settings.nodes if n.name == name)
    return hashlib.sha256(json.dumps([generation, node.model_dump(mode="json")]).encode()).hexdigest()[:16]


class Deployment(pulumi.ComponentResource):
    """The whole deployment as one resource: `pulumi stack` shows every layer under it."""

    outputs: dict[str, Any]
    """The stack outputs (endpoint, model, containers, generation, verification)."""

    def __init__(
        self,
        name: str,
        loaded: Loaded,
        stack: str,
        opts: pulumi.ResourceOptions | None = None,
        *,
        resolver: Resolver | None = None,
    ) -> None:
        # The nodes' addresses, then their host keys: a refusal ends the run before anything, this component
        # included, registers. `resolver`: the operator's getaddrinfo unless a test gives its own.
        addresses = resolve_nodes(loaded.settings, resolver)
        pins, keys_dir = pin_nodes(loaded.settings, stack)
        # Never open by default: an unset `serve.apiKey` becomes the stack's generated key.
        loaded = loaded.model_copy(update={"settings": with_endpoint_key(loaded.settings, stack, keys_dir)})
        super().__init__("dsv41-exl3:index:Deployment", name, None, opts)
        self.outputs = _wire(loaded, stack, addresses=addresses, pins=pins, keys_dir=keys_dir, root=self)
        self.register_outputs(self.outputs)


def deploy(loaded: Loaded, stack: str, *, resolver: Resolver | None = None) -> dict[str, Any]:
    """Build every layer under one Deployment; return the stack outputs."""
    return Deployment("deployment", loaded, stack, resolver=resolver).outputs


def under(root: pulumi.Resource, opts: pulumi.ResourceOptions | None = None) -> pulumi.ResourceOptions:
    """A layer under the root Deployment. Stacks deployed before it existed hung every layer off the stack:
    the alias keeps those resources (and, inherited, all their children) instead of replacing them."""
    return pulumi.ResourceOptions.merge(
        pulumi.ResourceOptions(parent=root, aliases=[pulumi.Alias(parent=pulumi.ROOT_STACK_RESOURCE)]), opts
    )


def _wire(
    loaded: Loaded,
    stack: str,
    *,
    addresses: Addresses,
    pins: Mapping[str, host_keys.Pin],
    keys_dir: str,
    root: pulumi.Resource,
) -> dict[str, Any]:
    """Build every layer under `root`; return the stack outputs."""
    s = loaded.settings
    head_address = addresses.head.address
    for warning in loaded.warnings:
        pulumi.log.warn(warning)
    if s.supervisor.enabled:
        token = supervisor_token(s, stack, keys_dir)
        # The supervisor (once it exists) leaves every rank to this update until the program ends.
        lock = UpdateLock(
            leader_url(s, head_address),
            token,
            holder_name(stack, pulumi.runtime.is_dry_run()),
            log=pulumi.log.warn,
            engine_alive=engine_alive,
        )
        if pulumi.runtime.is_dry_run():
            lock.report(pulumi.log.info)  # a preview changes nothing on the nodes: it takes no lock
        else:
            try:
                lock.start(report=pulumi.log.info)
            except LockHeld as held:
                raise pulumi.RunError(str(held)) from None
    # Everything this stack names on a node (export file, staging/check containers, watchdog files) carries
    # it, so two stacks on one head never collide. The rank containers keep their names (renaming would
    # replace running ranks): they were already per stack.
    prefix = labels.stack_prefix(pulumi.get_project(), stack)
    generation = serve_spec.cluster_generation(s)
    # Built once: how the program's own processes reach the nodes, and the bounds every boot waits by.
    ssh = ssh_access(s)
    bounds = gate_bounds(s)
    stack_keys = StackKeys("stack-keys", StackKeysArgs(directory=str(keys_dir)), opts=under(root))
    access = {
        n.name: NodeAccess(
            f"access-{n.name}",
            NodeAccessArgs(
                node=n, ssh=s.ssh, host_key=pins[n.name].key.line(), stack_dir=str(keys_dir), stack_keys=stack_keys
            ),
            opts=under(root),
        )
        for n in s.nodes
    }
    images = {
        n.name: NodeImage(
            f"image-{n.name}",
            NodeImageArgs(
                image=s.image,
                provider=access[n.name].docker_provider,
                pull_timeout_minutes=s.image_pull_timeout_minutes,
            ),
            opts=under(root),
        )
        for n in s.nodes
    }
    copy_mode = s.weights.share == "copy"

    def preflight_args(n: Node, stop_after: Sequence[pulumi.Resource]) -> PreflightArgs:
        own = addresses.of(n.name)
        return PreflightArgs(
            spec=PreflightSpec(
                node_name=n.name,
                fabric_ip=n.fabric_ip,
                fabric_interface=n.fabric_interface,
                ib_hcas=tuple(n.ib_hcas),
                gid_index=n.gid_index,
                check_rdma=bool(n.rdma_devices and n.ib_hcas),
                # The head's includes the observability layer's bounds; each rank's start checks the same figure.
                min_mem_available_gib=s.min_mem_available_gib_of(n),
                # The head stages the weights; in copy mode each worker keeps its own copy: its disk is checked too.
                weights_root=s.weights.root if n is s.head else (s.copy_root_of(n) if copy_mode else None),
                min_free_disk_gib=s.preflight.min_free_disk_gib if n is s.head or copy_mode else None,
                # The workers' root-squashed NFS mount must traverse every directory down to the export.
                check_export_path=n is s.head and s.weights.share == "nfs",
                stack_label=stack,
                generation=generation,
                container_shape=container_shape(s.container.ipc_mode, s.container.memlock_bytes),
                # The head's listeners bind its address: it must be one of the head's own. A worker's is SSH's only.
                own_address=OwnAddress(key=own.key, host=own.host, address=own.address) if n is s.head else None,
            ),
            connection=access[n.name].connection,
            # Re-run exactly when this node's container will be created or replaced.
            rerun_on=[generation, _node_spec_hash(loaded, generation, n.name)],
            stop_after=stop_after,
        )

    # The check phase everywhere first (the old ranks keep serving); the stop phase once every node passed it and
    # holds the image, so an image change serves on while 22.5 GiB download on each node.
    checks = {n.name: PreflightCheck(f"precheck-{n.name}", preflight_args(n, ()), opts=under(root)) for n in s.nodes}
    stop_after = [*checks.values(), *images.values()]
    preflights = {
        n.name: Preflight(f"preflight-{n.name}", preflight_args(n, stop_after), opts=under(root)) for n in s.nodes
    }

    def weight_node(name: str) -> WeightNode:
        node = next(n for n in s.nodes if n.name == name)
        return WeightNode(
            name=name,
            connection=access[name].connection,
            fabric_ip=node.fabric_ip,
            host=node.host,
            port=node.port,
            user=node.user,
            copy_root=s.copy_root_of(node) if copy_mode and node is not s.head else None,
            ready=[preflights[name]],
            docker_provider=access[name].docker_provider,
            image=images[name].image_id,
        )

    weights = WeightStore(
        "weights",
        WeightStoreArgs(
            head=weight_node(s.head.name),
            workers=[weight_node(w.name) for w in s.workers],
            root=s.weights.root,
            share=s.weights.share,
            staging_image=images[s.head.name].image_id,
            model_repo=s.weights.model_repo,
            engram_repo=s.weights.engram_repo,
            revision=s.weights.revision,
            hf_token=pulumi.Output.secret(s.weights.hf_token.get_secret_value()) if s.weights.hf_token else None,
            hf_endpoint=s.weights.hf_endpoint,
            stage_timeout_s=s.weights.stage_timeout_minutes * 60,
            download_streams=s.weights.download_streams,
            stack_prefix=prefix,
            copy=CopySettings(
                ssh=ssh,
                streams=s.weights.copy_streams,
                timeout_s=s.weights.stage_timeout_minutes * 60,
            )
            if copy_mode
            else None,
        ),
        opts=under(root, pulumi.ResourceOptions(depends_on=[preflights[s.head.name]])),
    )

    # Every rank must run the same build of the mutable tag: compared after the pulls, before any container.
    image_ids = checked_image_ids(
        s.image,
        {n.name: images[n.name].image_id for n in s.nodes},
        {n.name: images[n.name].repo_digest for n in s.nodes},
    )
    # What runs now: a rank found not running, or an endpoint without real logprobs, on a later preview or up
    # replaces every rank (issue: drift).
    live = LiveRanks(
        "live-ranks",
        LiveRanksArgs(
            ranks=gate_ranks(s, {n.name: labels.container_name(stack, n.name) for n in s.nodes}),
            ssh=ssh,
            endpoint=endpoint_of(s, head_address),
            model=s.serve.served_model_name,
            api_key=_api_key(s),
            # The supervisor's fresh healthy probe stands in for the preview's own (LiveRanks' docstring).
            supervisor_url=leader_url(s, head_address) if s.supervisor.enabled else None,
            supervisor_token=pulumi.Output.secret(token) if s.supervisor.enabled else None,
            supervisor_probe_s=float(s.supervisor.probe_seconds) if s.supervisor.enabled else None,
        ),
        opts=under(root),
    )
    serving = ServingCluster(
        "serving",
        ServingClusterArgs(
            settings=s,
            stack=stack,
            replace_when=live.id,
            generation=generation,
            ranks=[
                RankInputs(
                    node=n,
                    provider=access[n.name].docker_provider,
                    image_id=image_ids[n.name],
                    gid_index=preflights[n.name].gid_index,
                    model_source=weights.model_source[n.name],
                    engram_source=weights.engram_source[n.name],
                    mount_type="bind" if weights.mount_type[n.name] == "bind" else "volume",
                    depends_on=[preflights[n.name], weights.visible[n.name], images[n.name]],
                )
                for n in s.nodes
            ],
        ),
        opts=under(root),
    )

    if s.watchdog.enabled:
        # A trip on one node stops every rank: each node's key may stop the others' containers, nothing else.
        keys = {
            n.name: WatchdogKey(
                f"watchdog-key-{n.name}",
                WatchdogKeyArgs(
                    node_name=n.name,
                    connection=access[n.name].connection,
                    container_name=serving.container_names[n.name],
                    stack_prefix=prefix,
                ),
                opts=under(root),
            )
            for n in s.nodes
        }
        for n in s.nodes:
            peers = [m for m in s.nodes if m is not n]
            MemoryWatchdog(
                f"watchdog-{n.name}",
                MemoryWatchdogArgs(
                    node_name=n.name,
                    connection=access[n.name].connection,
                    container_name=serving.container_names[n.name],
                    stack_prefix=prefix,
                    watchdog=s.watchdog,
                    rerun_on=[serving.containers[n.name].id],
                    peers=[
                        WatchdogPeer(
                            node_name=m.name, host=m.host, port=m.port, user=m.user, host_key=pins[m.name].key.line()
                        )
                        for m in peers
                    ],
                    peer_public_keys={m.name: keys[m.name].public_key for m in peers},
                ),
                opts=under(root, pulumi.ResourceOptions(depends_on=[serving.containers[n.name]])),
            )

    verifier = verify_after(
        s,
        ssh=ssh,
        bounds=bounds,
        container_names=serving.container_names,
        container_ids=serving.container_ids,
        after=list(serving.containers.values()),
        root=root,
        stack=stack,
        head_address=head_address,
    )
    outputs: dict[str, Any] = {
        "endpoint": endpoint_of(s, head_address),
        "model": s.serve.served_model_name,
        "containers": serving.container_names,
        "clusterGeneration": serving.generation,
        "verification": {
            "answer": verifier.answer,
            "logprobs": verifier.logprobs,
            "latencySeconds": verifier.latency_s,
            "verifiedAt": verifier.verified_at,
        },
        # Resolves only once the verifier passed: a failed update leaves the last verified one in the outputs.
        "lastVerified": pulumi.Output.all(verifier.verified_at, serving.generation, image_ids).apply(
            lambda v: {"verifiedAt": v[0], "generation": v[1], "imageIds": v[2]}
        ),
    }
    api_key = _api_key(s)
    if api_key is not None:
        outputs["apiKey"] = api_key
    if s.gates.min_decode_tokens_per_second is not None:
        outputs["decodeTokensPerSecond"] = verifier.decode_tokens_per_second
    if s.supervisor.enabled:
        supervisor = Supervisor(
            "supervisor",
            SupervisorArgs(
                settings=s,
                stack=stack,
                stack_prefix=prefix,
                token=token,
                endpoint=endpoint_of(s, head_address),
                head_address=head_address,
                generation=serving.generation,
                bounds=bounds,
                nodes=[
                    SupervisorNode(
                        name=n.name,
                        index=i,
                        connection=access[n.name].connection,
                        docker_provider=access[n.name].docker_provider,
                        image_id=image_ids[n.name],
                    )
                    for i, n in enumerate(s.nodes)
                ],
                after=[verifier],
            ),
            opts=under(root),
        )
        outputs["supervisor"] = {"url": supervisor.url, "token": pulumi.Output.secret(token)}
        if s.observing:
            observed = Observability(
                "observability",
                ObservabilityArgs(
                    settings=s,
                    stack=stack,
                    stack_prefix=prefix,
                    token=token,
                    generation=serving.generation,
                    api_key=_api_key(s),
                    nodes=[
                        ObservedNode(
                            name=n.name,
                            index=i,
                            connection=access[n.name].connection,
                            docker_provider=access[n.name].docker_provider,
                            image_id=image_ids[n.name],
                            agent_url=agent_url(s, i),
                        )
                        for i, n in enumerate(s.nodes)
                    ],
                    head_address=head_address,
                    # Beside the supervisor, not after its agents: the exporter asks its agent at every scrape
                    # (dsv41_agent_up 0 until it answers, alerting after 2 m), so the layer's chain does not
                    # lengthen every up's (measured: 0.8 s of a no-op up's 5 s ran after the verifier).
                    after=[verifier],
                ),
                opts=under(root),
            )
            outputs["prometheusUrl"] = observed.prometheus_url
    elif s.observability.enabled:
        pulumi.log.warn("observability.enabled: true does nothing without the supervisor (supervisor.enabled: false)")
    return outputs


def engine_alive() -> bool:
    """Whether the Pulumi engine that runs this program still answers (a cheap RPC); False only when it is gone."""
    from pulumi.runtime.proto import engine_pb2

    engine = pulumi.runtime.settings.get_engine()
    if engine is None:
        return True
    try:
        engine.GetRootResource(engine_pb2.GetRootResourceRequest(), timeout=10)
    except Exception as error:  # grpc.RpcError: only UNAVAILABLE (nothing listens) says the engine is gone
        code = getattr(error, "code", None)
        return not (callable(code) and getattr(code(), "name", "") == "UNAVAILABLE")
    return True


def resolve_nodes(s: Settings, resolver: Resolver | None = None) -> Addresses:
    """Every node's address, resolved on this machine once per run (components/access/addresses.py); a name
    that does not resolve or resolves only to loopback ends the run with every such key, value and fix."""
    try:
        return node_addresses.resolve(s.nodes, resolver)
    except AddressError as err:
        raise pulumi.RunError(str(err)) from None


def pin_nodes(s: Settings, stack: str) -> tuple[dict[str, host_keys.Pin], str]:
    """Every node's host key (recorded on first use) and the stack's key directory, before any resource.

    Refusals (a changed key, an unreachable new node, a key directory that is not private) end the run
    with their message and fix, no traceback.
    """
    try:
        keys_dir = stack_dir(pulumi.get_project(), stack)
        pins = host_keys.pin_all(
            [host_keys.NodeAddress(node=n.name, host=n.host, port=n.port) for n in s.nodes], s.ssh.known_hosts_file
        )
    except (host_keys.HostKeyError, KeyDirError) as err:
        raise pulumi.RunError(str(err)) from None
    for pin in pins.values():
        if pin.note:
            (pulumi.log.info if pin.recorded else pulumi.log.warn)(pin.note)
    return pins, str(keys_dir)


def gate_ranks(s: Settings, container_names: Mapping[str, str]) -> list[GateRank]:
    """Every rank as the gates and LiveRanks read it: the head first."""
    # A worker reads the weights from the head's fabric address (`share: nfs`, or an NFS mount of its own under
    # `bind`): those NFS bytes, its fabric rx bytes and MemAvailable are what moves while it loads in silence on
    # GB10 (the stall rule's signals). No such mount: nothing is counted.
    nfs_server = s.head.fabric_ip
    return [
        GateRank(
            rank=i,
            node=n.name,
            host=n.host,
            port=n.port,
            user=n.user,
            container=container_names[n.name],
            fabric_interface=n.fabric_interface,
            nfs_server=nfs_server if i else "",
        )
        for i, n in enumerate(s.nodes)
    ]


def ssh_access(s: Settings) -> SshAccess:
    """The stack's `ssh` section as the program's own ssh runs it (the key a secret)."""
    key = pulumi.Output.secret(s.ssh.private_key.get_secret_value()) if s.ssh.private_key else None
    return SshAccess(private_key=key, agent_socket=s.ssh.agent_socket, known_hosts_file=s.ssh.known_hosts_file)


def gate_bounds(s: Settings) -> GateBounds:
    """`gates.*` as the gates and the supervisor's restarts wait by: the one mapping from config."""
    g = s.gates
    return GateBounds(
        rendezvous_timeout_s=g.rendezvous_timeout_seconds,
        ready_timeout_s=g.ready_timeout_seconds,
        stall_s=g.stall_seconds,
    )


def _api_key(s: Settings) -> pulumi.Output[str] | None:
    return pulumi.Output.secret(s.serve.api_key.get_secret_value()) if s.serve.api_key else None


def endpoint_of(s: Settings, head_address: str) -> str:
    """The OpenAI base URL the operator reaches: the head's address (`nodes[0].host` as this machine resolved
    it) and the API port."""
    return http_url(head_address, s.serve.port, "/v1")


def verify_after(
    s: Settings,
    *,
    ssh: SshAccess,
    bounds: GateBounds,
    container_names: Mapping[str, str],
    container_ids: pulumi.Input[Sequence[pulumi.Input[str]]],
    after: Sequence[pulumi.Resource],
    root: pulumi.Resource,
    stack: str,
    head_address: str,
) -> Verifier:
    """The rendezvous gate after every container, the ready gate after it, the verifier last.

    All three re-run exactly when `container_ids` changes.
    """
    api_key = _api_key(s)
    endpoint = endpoint_of(s, head_address)
    api_base = endpoint.removesuffix("/v1")
    ranks = tuple(gate_ranks(s, container_names))
    rendezvous = RendezvousGate(
        "rendezvous",
        RendezvousGateArgs(
            ranks=ranks,
            ssh=ssh,
            bounds=bounds,
            poll_interval_s=POLL_INTERVAL_S,
            progress_interval_s=PROGRESS_INTERVAL_S,
            rerun_on=container_ids,
        ),
        opts=under(root, pulumi.ResourceOptions(depends_on=list(after))),
    )
    ready = ReadyGate(
        "ready",
        ReadyGateArgs(
            ranks=ranks,
            ssh=ssh,
            bounds=bounds,
            api_base=api_base,
            model_name=s.serve.served_model_name,
            api_key=api_key,
            poll_interval_s=POLL_INTERVAL_S,
            progress_interval_s=PROGRESS_INTERVAL_S,
            models_timeout_s=MODELS_TIMEOUT_S,
            rerun_on=container_ids,
        ),
        opts=under(root, pulumi.ResourceOptions(depends_on=[rendezvous])),
    )
    verifier = Verifier(
        "verify",
        VerifierArgs(
            endpoint=endpoint,
            model=s.serve.served_model_name,
            rerun_on=container_ids,
            api_key=api_key,
            timeout_s=min(120.0, float(s.gates.verify_timeout_seconds)),
            retry_window_s=float(s.gates.verify_timeout_seconds),
            # The first request after a boot can spend minutes in JIT: warm up within the window, then judge.
            warmup_timeout_s=float(s.gates.verify_timeout_seconds),
            min_decode_tokens_per_second=s.gates.min_decode_tokens_per_second,
            expected_answer=s.gates.expected_answer,
            rollback_command=rollback_command(stack),
        ),
        opts=under(root, pulumi.ResourceOptions(depends_on=[ready])),
    )
    return verifier
