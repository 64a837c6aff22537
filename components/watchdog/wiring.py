"""The watchdog stage: per node, after its rank, the memory watchdog; a trip on one node stops every rank, so each
node's key may stop the others' containers, nothing else."""

from __future__ import annotations

import pulumi

from components.access.wiring import Access
from components.serving.serving import ServingCluster
from components.watchdog.watchdog import (
    KEY_COMPONENT,
    WATCHDOG_COMPONENT,
    MemoryWatchdog,
    MemoryWatchdogArgs,
    WatchdogKey,
    WatchdogKeyArgs,
    WatchdogPeer,
)
from components.wiring import Wiring


def wire_watchdog(w: Wiring, access: Access, serving: ServingCluster) -> None:
    s = w.s
    if not s.watchdog.enabled:
        return
    keys = {
        n.name: WatchdogKey(
            f"watchdog-key-{n.name}",
            WatchdogKeyArgs(
                node_name=n.name,
                connection=access[n.name].connection,
                container_name=serving.container_names[n.name],
                stack_prefix=w.prefix,
            ),
            opts=w.flattened(KEY_COMPONENT, f"watchdog-key-{n.name}"),
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
                stack_prefix=w.prefix,
                watchdog=s.watchdog,
                rerun_on=[serving.containers[n.name].id],
                peers=[
                    WatchdogPeer(
                        node_name=m.name, host=m.host, port=m.port, user=m.user, host_key=w.pins[m.name].key.line()
                    )
                    for m in peers
                ],
                peer_public_keys={m.name: keys[m.name].public_key for m in peers},
            ),
            opts=w.flattened(
                WATCHDOG_COMPONENT,
                f"watchdog-{n.name}",
                pulumi.ResourceOptions(depends_on=[serving.containers[n.name]]),
            ),
        )
