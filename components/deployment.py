"""The whole deployment: every layer, wired in the order the hardware requires.

Per node: access -> (preflight, image) -> weights visible -> container; every worker's
container before the head's; then the rendezvous gate, the ready gate and the verifier; then, on a deployment that
verified, the supervisor and the observability layer. Each stage is its layer's `wiring.py`; this file only
resolves and pins the nodes, builds the shared context (components/wiring.py) and calls the stages in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pulumi

from components import host_keys, labels
from components.access import addresses as node_addresses
from components.access.addresses import AddressError, Addresses, Resolver
from components.access.wiring import wire_access
from components.config import Loaded, Settings
from components.gates.wiring import wire_live_ranks
from components.image.wiring import verified_image_ids, wire_images
from components.observability.wiring import wire_observability
from components.preflight.wiring import wire_preflight
from components.serving import spec as serve_spec
from components.serving.api_key import endpoint_key
from components.serving.wiring import wire_serving
from components.ssh import KeyDirError, stack_dir
from components.supervisor.supervisor import leader_url
from components.supervisor.wiring import hold_update_lock, wire_supervisor
from components.verify.wiring import wire_verification
from components.watchdog.wiring import wire_watchdog
from components.weights.wiring import wire_weights
from components.wiring import ROOT_TYPE, Wiring, gate_bounds, ssh_access


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
        super().__init__(ROOT_TYPE, name, None, opts)
        self.outputs = _wire(loaded, stack, addresses=addresses, pins=pins, keys_dir=keys_dir, root=self)
        self.register_outputs(self.outputs)


def deploy(loaded: Loaded, stack: str, *, resolver: Resolver | None = None) -> dict[str, Any]:
    """Build every layer under one Deployment; return the stack outputs."""
    return Deployment("deployment", loaded, stack, resolver=resolver).outputs


def _wire(
    loaded: Loaded,
    stack: str,
    *,
    addresses: Addresses,
    pins: Mapping[str, host_keys.Pin],
    keys_dir: str,
    root: pulumi.Resource,
) -> dict[str, Any]:
    """Build every layer under `root`, in the recipe's order; return the stack outputs. Each stage lives in its
    layer's `wiring.py` and hands the next the bundle it returns."""
    s = loaded.settings
    for warning in loaded.warnings:
        pulumi.log.warn(warning)
    w = Wiring(
        loaded=loaded,
        stack=stack,
        root=root,
        addresses=addresses,
        pins=pins,
        keys_dir=keys_dir,
        prefix=labels.stack_prefix(pulumi.get_project(), stack),
        generation=serve_spec.cluster_generation(s),
        ssh=ssh_access(s),
        bounds=gate_bounds(s),
        # Never open by default: an unset `serve.apiKey` is the stack's generated key.
        api_key=endpoint_key(s, root),
    )
    token = hold_update_lock(w, engine_alive)
    access = wire_access(w)
    images = wire_images(w, access)
    preflights = wire_preflight(w, access, images)
    weights = wire_weights(w, access, images, preflights)
    image_ids = verified_image_ids(w, images)
    live = wire_live_ranks(w, leader_url(s, w.head_address), token)
    serving = wire_serving(
        w, access=access, images=images, image_ids=image_ids, preflights=preflights, weights=weights, live=live
    )
    wire_watchdog(w, access, serving)
    verifier = wire_verification(w, serving)
    outputs: dict[str, Any] = {
        "endpoint": w.endpoint,
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
    if w.api_key is not None:
        outputs["apiKey"] = w.api_key
    if s.gates.min_decode_tokens_per_second is not None:
        outputs["decodeTokensPerSecond"] = verifier.decode_tokens_per_second
    if token is not None:
        # Day two, once the update verified: the supervisor and, beside it, the observability layer.
        supervisor = wire_supervisor(
            w, token=token, access=access, image_ids=image_ids, serving=serving, verifier=verifier
        )
        outputs["supervisor"] = {"url": supervisor.url, "token": pulumi.Output.secret(token)}
        if s.observing:
            observed = wire_observability(
                w, token=token, access=access, image_ids=image_ids, serving=serving, verifier=verifier
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
