"""The gates' stages: live ranks before the ranks (what runs now decides whether they are replaced), and the
rendezvous and ready gates after every rank's container."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pulumi

from components import labels
from components.config import Settings
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
from components.wiring import Wiring


def gate_ranks(s: Settings, container_names: Mapping[str, str]) -> tuple[GateRank, ...]:
    """Every rank as the gates and LiveRanks read it: the head first."""
    # A worker reads the weights from the head's fabric address (`share: nfs`, or an NFS mount of its own under
    # `bind`): those NFS bytes, its fabric rx bytes and MemAvailable are what moves while it loads in silence on
    # GB10 (the stall rule's signals). No such mount: nothing is counted.
    nfs_server = s.head.fabric_ip
    return tuple(
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
    )


def wire_live_ranks(w: Wiring, supervisor_url: str | None, supervisor_token: str | None) -> LiveRanks:
    """What runs now: a rank found not running, or an endpoint without real logprobs, on a later preview or up
    replaces every rank (issue: drift). The supervisor (when deployed) is asked first."""
    s = w.s
    return LiveRanks(
        "live-ranks",
        LiveRanksArgs(
            ranks=gate_ranks(s, {n.name: labels.container_name(w.stack, n.name) for n in s.nodes}),
            ssh=w.ssh,
            endpoint=w.endpoint,
            model=s.serve.served_model_name,
            api_key=w.api_key,
            # The supervisor's fresh healthy probe stands in for the preview's own (LiveRanks' docstring).
            supervisor_url=supervisor_url if supervisor_token else None,
            supervisor_token=pulumi.Output.secret(supervisor_token) if supervisor_token else None,
            supervisor_fresh_s=float(s.supervisor.probe_seconds) if supervisor_token else None,
        ),
        opts=w.opts(),
    )


def wire_gates(
    w: Wiring,
    *,
    container_names: Mapping[str, str],
    container_ids: pulumi.Input[Sequence[pulumi.Input[str]]],
    after: Sequence[pulumi.Resource],
) -> ReadyGate:
    """The rendezvous gate after every container, the ready gate after it; both re-run exactly when
    `container_ids` changes."""
    ranks = gate_ranks(w.s, container_names)
    rendezvous = RendezvousGate(
        "rendezvous",
        RendezvousGateArgs(
            ranks=ranks,
            ssh=w.ssh,
            bounds=w.bounds,
            poll_interval_s=POLL_INTERVAL_S,
            progress_interval_s=PROGRESS_INTERVAL_S,
            rerun_on=container_ids,
        ),
        opts=w.opts(pulumi.ResourceOptions(depends_on=list(after))),
    )
    return ReadyGate(
        "ready",
        ReadyGateArgs(
            ranks=ranks,
            ssh=w.ssh,
            bounds=w.bounds,
            api_base=w.endpoint.removesuffix("/v1"),
            model_name=w.s.serve.served_model_name,
            api_key=w.api_key,
            poll_interval_s=POLL_INTERVAL_S,
            progress_interval_s=PROGRESS_INTERVAL_S,
            models_timeout_s=MODELS_TIMEOUT_S,
            rerun_on=container_ids,
        ),
        opts=w.opts(pulumi.ResourceOptions(depends_on=[rendezvous])),
    )
