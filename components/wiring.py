"""What every layer's wiring stage reads: the validated settings and this update's facts, built once
(deployment.py). Each layer's folder has a `wiring.py` that takes this and the bundles of the stages before it, and
returns its own small bundle for the stages after it (the shape of pulumi-eks's cluster core)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi

from components import host_keys
from components.access.addresses import Addresses, http_url
from components.config import Loaded, Settings
from components.gates.decisions import GateBounds
from components.ssh import SshAccess


def under(root: pulumi.Resource, opts: pulumi.ResourceOptions | None = None) -> pulumi.ResourceOptions:
    """A layer under the root Deployment. Stacks deployed before it existed hung every layer off the stack:
    the alias keeps those resources (and, inherited, all their children) instead of replacing them."""
    return pulumi.ResourceOptions.merge(
        pulumi.ResourceOptions(parent=root, aliases=[pulumi.Alias(parent=pulumi.ROOT_STACK_RESOURCE)]), opts
    )


ROOT_TYPE = "dsv41-exl3:index:Deployment"


def flattened(
    root: pulumi.Resource, component_type: str, component_name: str, opts: pulumi.ResourceOptions | None = None
) -> pulumi.ResourceOptions:
    """A resource that was the only child of a component existing only for wiring, now directly under the root
    Deployment (each such component cost a registration per node at every preview). Its aliases name it under
    that component in both layouts a stack may hold: the component under the Deployment, and, before the
    Deployment existed, under the stack. Without them an upgrade would replace it."""
    stack, project = pulumi.get_stack(), pulumi.get_project()
    old_parents = (
        f"urn:pulumi:{stack}::{project}::{ROOT_TYPE}${component_type}::{component_name}",
        f"urn:pulumi:{stack}::{project}::{component_type}::{component_name}",
    )
    return pulumi.ResourceOptions.merge(
        pulumi.ResourceOptions(parent=root, aliases=[pulumi.Alias(parent=urn) for urn in old_parents]), opts
    )


@dataclass(frozen=True, kw_only=True)
class Wiring:
    loaded: Loaded
    stack: str
    root: pulumi.Resource
    addresses: Addresses
    pins: Mapping[str, host_keys.Pin]
    keys_dir: str
    prefix: str
    """Everything this stack names on a node (export file, staging/check containers, watchdog files) carries it,
    so two stacks on one head never collide. The rank containers keep their names: they were already per stack."""
    generation: str
    ssh: SshAccess
    """How the program's own processes reach the nodes (the gates, live ranks, the worker copy)."""
    bounds: GateBounds
    """The bounds every boot waits by: the update's gates and the supervisor's restarts."""
    api_key: pulumi.Output[str] | None
    """The key every request must carry (serving/api_key.py), a secret; None: the endpoint is open."""

    @property
    def s(self) -> Settings:
        return self.loaded.settings

    @property
    def head_address(self) -> str:
        return self.addresses.head.address

    @property
    def endpoint(self) -> str:
        """The OpenAI base URL the operator reaches: the head's address (`nodes[0].host` as this machine resolved
        it) and the API port."""
        return http_url(self.head_address, self.s.serve.port, "/v1")

    def opts(self, opts: pulumi.ResourceOptions | None = None) -> pulumi.ResourceOptions:
        return under(self.root, opts)

    def flattened(
        self, component_type: str, component_name: str, opts: pulumi.ResourceOptions | None = None
    ) -> pulumi.ResourceOptions:
        return flattened(self.root, component_type, component_name, opts)


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
