"""LiveRanks: what is running on the nodes now, compared on every preview and up.

Pulumi keeps the containers it created in its state and, without a refresh, never looks again: a rank that was
stopped by a failed update's preflight, killed by the OOM killer or the watchdog, or removed by hand stays
"created" in the state, and the next `pulumi up` reported success with the model down. This dynamic resource
looks: its `diff` (run by every preview and up) reads each rank's container state over SSH and, when any rank
is not running, asks for its own replacement. Every rank's container names this resource's id as its
`replacement_trigger`, so the whole group is replaced together (a rank restarted alone would block at the
rendezvous of a group that no longer exists), and the gates and the verifier re-run on the new containers.
`read` reports the same observation, so `pulumi refresh` shows the drift too.

A healthy deployment costs one `docker inspect` per node per preview (over the node's multiplexed SSH
connection) and changes nothing. A node that cannot be reached is reported, not treated as drift: the update's
own connections fail on it with their own message.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi.dynamic

from components.gates import GateRank, _ranks_from_prop, _secret_or_none, _source, _unwrap_secret, changed_inputs
from components.rank_watch import ContainerState, SourceError

INPUT_KEYS = ("ranks", "ssh_private_key", "ssh_agent_socket", "ssh_known_hosts_file")


@dataclass(frozen=True, kw_only=True)
class LiveRanksArgs:
    ranks: Sequence[GateRank]
    ssh_private_key: pulumi.Input[str] | None
    ssh_agent_socket: str | None
    ssh_known_hosts_file: str | None


def observe(ranks: Sequence[GateRank], state: Callable[[int], ContainerState]) -> dict[str, str]:
    """Per node, its rank container's status (`running`, `exited`, `missing`, ... or `unreachable: why`)."""
    seen: dict[str, str] = {}
    for r in ranks:
        try:
            s = state(r.rank)
            seen[r.node] = s.status if s.exit_code is None or s.running else f"{s.status} ({s.exit_code})"
        except SourceError as err:
            seen[r.node] = f"unreachable: {err}"
    return seen


def drifted(observed: Mapping[str, str]) -> list[str]:
    """The nodes whose rank is known not to run. An unreachable node is not drift: nothing is known there."""
    return sorted(n for n, status in observed.items() if status != "running" and not status.startswith("unreachable"))


class LiveRanksProvider(pulumi.dynamic.ResourceProvider):
    def _observe(self, props: Mapping[str, Any]) -> dict[str, str]:
        ranks = _ranks_from_prop(_unwrap_secret(props.get("ranks")))
        return observe(ranks, _source(props).state)

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        # Created before the containers it watches: nothing to observe yet.
        return pulumi.dynamic.CreateResult(id_=f"live-{uuid.uuid4().hex[:16]}",
                                           outs={**{k: props.get(k) for k in INPUT_KEYS}, "observed": {}})

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        observed = self._observe(news)
        down = drifted(observed)
        for node, status in sorted(observed.items()):
            if status.startswith("unreachable"):
                pulumi.log.warn(f"live ranks: node {node} {status}; cannot tell whether its rank runs")
        if down:
            pulumi.log.warn("live ranks: " + ", ".join(f"{n} is {observed[n]}" for n in down)
                            + ": every rank is replaced together and verified again")
            return pulumi.dynamic.DiffResult(changes=True, replaces=["observed"], delete_before_replace=True)
        # New ranks or SSH settings: stored in place (the containers follow their own inputs).
        return pulumi.dynamic.DiffResult(changes=bool(changed_inputs(INPUT_KEYS, olds, news)))

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.UpdateResult:
        return pulumi.dynamic.UpdateResult(outs={**{k: news.get(k) for k in INPUT_KEYS}, "observed": {}})

    def read(self, id_: str, props: dict[str, Any]) -> pulumi.dynamic.ReadResult:
        return pulumi.dynamic.ReadResult(id_=id_, outs={**props, "observed": self._observe(props)})

    def delete(self, _id: str, _props: dict[str, Any]) -> None:
        """Nothing exists outside the state."""


class LiveRanks(pulumi.dynamic.Resource, module="drift", name="LiveRanks"):
    """Replaced (and with it every rank) when a preview or up finds a rank container not running."""

    observed: pulumi.Output[dict[str, str]]
    """Per node, its rank's container status as last read (by `pulumi refresh`)."""

    def __init__(self, name: str, args: LiveRanksArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        props: dict[str, Any] = {
            "ranks": [r.to_prop() for r in args.ranks],
            "ssh_private_key": _secret_or_none(args.ssh_private_key),
            "ssh_agent_socket": args.ssh_agent_socket,
            "ssh_known_hosts_file": args.ssh_known_hosts_file,
            "observed": None,
        }
        secret = pulumi.ResourceOptions(additional_secret_outputs=["ssh_private_key"])
        super().__init__(LiveRanksProvider(), name, props, pulumi.ResourceOptions.merge(secret, opts))
