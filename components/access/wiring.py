"""The access stage: the stack's key directory and, per node, its SSH connection and docker provider."""

from __future__ import annotations

from components.access.node_access import NodeAccess, NodeAccessArgs
from components.access.stack_keys import StackKeys, StackKeysArgs
from components.wiring import Wiring

Access = dict[str, NodeAccess]
"""Per node name: how every later stage reaches it (`connection`, `docker_provider`)."""


def wire_access(w: Wiring) -> Access:
    s = w.s
    stack_keys = StackKeys("stack-keys", StackKeysArgs(directory=str(w.keys_dir)), opts=w.opts())
    return {
        n.name: NodeAccess(
            f"access-{n.name}",
            NodeAccessArgs(
                node=n, ssh=s.ssh, host_key=w.pins[n.name].key.line(), stack_dir=str(w.keys_dir), stack_keys=stack_keys
            ),
            opts=w.opts(),
        )
        for n in s.nodes
    }
