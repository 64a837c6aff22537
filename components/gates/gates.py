"""The rendezvous gate and the ready gate: Pulumi dynamic resources that block `pulumi up`.

The logic lives in `decisions.py` (fed by `stream_source.py` and `poll_source.py`); this module only turns
resource properties into its inputs and its results into outputs. It must import without side effects and create no
resources at import: Pulumi pickles the provider classes by reference and re-imports this
module in the provider process. Providers hold no sessions or clients as attributes.

Any input change (a replaced serving container above all, through `rerun_on`) re-runs the gate
as an in-place update. That is cheap on a server that is already up: each node's stream reads the
logs from the container's start, so the join and startup lines arrive at once. The gates follow the
ranks through `StreamRankSource` (one ssh session per node); `poll_interval_s` is the pace of the
polling fallback for a node that cannot stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi.dynamic

from components.contract import Contract, secret
from components.dynamic import (
    StateOnlyProvider,
    as_rows,
    as_set,
    log_progress,
    plain,
    props_of,
    read_props,
    secret_outputs,
    unwrap_secret,
)
from components.gates.decisions import (
    MODELS_PROBE_TIMEOUT_S,
    WATCH_POLL_INTERVAL_S,
    WATCH_PROGRESS_INTERVAL_S,
    GateBounds,
    ModelsEndpoint,
    ReadySettings,
    RendezvousSettings,
    wait_for_ready,
    wait_for_rendezvous,
)
from components.gates.observations import RankSpec, SystemClock
from components.gates.poll_source import SshRankSource
from components.gates.stream_source import StreamRankSource
from components.ssh import SshAccess

# Not operator settings: how often a node that cannot stream is polled (POLL_INTERVAL_S, <= 5 s so an exited
# container is noticed within 15 s even then), how often the gates report, and how long one /v1/models look
# may take. The program wires these.
POLL_INTERVAL_S = WATCH_POLL_INTERVAL_S
PROGRESS_INTERVAL_S = WATCH_PROGRESS_INTERVAL_S
MODELS_TIMEOUT_S = MODELS_PROBE_TIMEOUT_S


# The program names a rank the same way the watch does: one definition, validated on construction.
GateRank = RankSpec


def _check_ranks(ranks: Sequence[GateRank]) -> None:
    numbers = sorted(r.rank for r in ranks)
    if numbers != list(range(len(numbers))) or not numbers:
        raise ValueError(f"gate ranks {numbers} must be 0..N-1, each once (0 = the head node)")


# ---------------------------------------------------------------------------------------------
# The boundary: what the program sends and the provider reads back (components/contract.py)


@dataclass(frozen=True, kw_only=True)
class RendezvousGateArgs(Contract):
    """Inputs of RendezvousGate. `rerun_on`: the ids of every serving container. No defaults: the settings
    come from components/config, so a forgotten wire fails the type check."""

    ranks: tuple[GateRank, ...]
    rerun_on: pulumi.Input[Sequence[pulumi.Input[str]]]
    ssh: SshAccess
    bounds: GateBounds
    poll_interval_s: float
    progress_interval_s: float

    def __post_init__(self) -> None:
        _check_ranks(self.ranks)
        self.watch_settings()  # validated here, in the program: a bad value fails the preview

    def watch_settings(self, secrets: tuple[str, ...] = ()) -> RendezvousSettings:
        return RendezvousSettings(
            bounds=self.bounds,
            poll_interval_s=self.poll_interval_s,
            progress_interval_s=self.progress_interval_s,
            secrets=secrets,
        )


@dataclass(frozen=True, kw_only=True)
class ReadyGateArgs(RendezvousGateArgs):
    """Inputs of ReadyGate: the rendezvous gate's, and the head's OpenAI API (`api_base` without /v1)."""

    api_base: pulumi.Input[str]
    model_name: pulumi.Input[str]
    api_key: pulumi.Input[str] | None = secret()
    models_timeout_s: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.models_timeout_s <= 0:
            raise ValueError(f"models_timeout_s={self.models_timeout_s} must be > 0")

    def ready_settings(self, secrets: tuple[str, ...] = ()) -> ReadySettings:
        return ReadySettings(
            bounds=self.bounds,
            poll_interval_s=self.poll_interval_s,
            progress_interval_s=self.progress_interval_s,
            secrets=secrets,
        )


# ---------------------------------------------------------------------------------------------
# Provider-side


# What makes two values of an input the same: which containers and ranks, not their order.
NORMALIZE = {"rerun_on": as_set, "ranks": as_rows}


def ssh_of(props: Mapping[str, Any]) -> SshAccess:
    """The `ssh` property; state written before it existed (0.8.0) held the same three values as flat keys."""
    if "ssh" in props:
        return read_props(SshAccess, unwrap_secret(props["ssh"]) or {})
    return read_props(
        SshAccess,
        {
            "private_key": props.get("ssh_private_key"),
            "agent_socket": props.get("ssh_agent_socket"),
            "known_hosts_file": props.get("ssh_known_hosts_file"),
        },
    )


def rank_source(ranks: Sequence[RankSpec], ssh: SshAccess) -> SshRankSource:
    """The ranks, looked at once over SSH with the stack's key, agent and known_hosts (LiveRanks)."""
    return SshRankSource(ranks, ssh)


def stream_source(ranks: Sequence[RankSpec], ssh: SshAccess) -> StreamRankSource:
    """The ranks, followed through one ssh session per node (the gates)."""
    return StreamRankSource(ranks, ssh)


def _secrets(args: RendezvousGateArgs) -> tuple[str, ...]:
    """What a gate's messages must never show."""
    api_key = args.api_key if isinstance(args, ReadyGateArgs) else None
    return tuple(str(s) for s in (args.ssh.private_key, api_key) if s)


def run_rendezvous_gate(props: Mapping[str, Any]) -> dict[str, Any]:
    """Wait for every rank to join; return the outputs (inputs echoed plus the verdict)."""
    args = read_props(RendezvousGateArgs, props)
    settings = args.watch_settings(_secrets(args))
    source = stream_source(args.ranks, args.ssh)
    result = wait_for_rendezvous(args.ranks, source, settings, SystemClock(), log_progress)
    return {
        **plain(RendezvousGateArgs.field_names(), props),
        "passed_at": result.passed_at,
        "elapsed_s": result.elapsed_s,
        "world_size": result.world_size,
        "joined_at": {str(k): v for k, v in sorted(result.joined_at.items())},
    }


def run_ready_gate(props: Mapping[str, Any]) -> dict[str, Any]:
    """Wait for the head's API to list the model; return the outputs (inputs echoed plus the verdict)."""
    args = read_props(ReadyGateArgs, props)
    model, api_base = str(args.model_name or ""), str(args.api_base or "")
    if not model or not api_base.startswith(("http://", "https://")):
        raise ValueError(
            f"ReadyGate needs model_name and an http(s) api_base, got model_name={model!r} api_base={api_base!r}"
        )
    key = str(args.api_key) if args.api_key else None
    probe = ModelsEndpoint(api_base, model, key, timeout_s=args.models_timeout_s)
    settings = args.ready_settings(_secrets(args))
    source = stream_source(args.ranks, args.ssh)
    result = wait_for_ready(args.ranks, source, settings, SystemClock(), log_progress, probe, model)
    return {
        **plain(ReadyGateArgs.field_names(), props),
        "passed_at": result.passed_at,
        "elapsed_s": result.elapsed_s,
        "phases": result.phases,
    }


class _GateProvider(StateOnlyProvider):
    """What the gates share: a gate leaves nothing behind, and any input change re-runs it in place."""

    normalize = NORMALIZE
    id_prefix = "gate"


class RendezvousGateProvider(_GateProvider):
    input_keys = RendezvousGateArgs.field_names()
    id_prefix = "rendezvous"

    def outputs(self, props: Mapping[str, Any]) -> dict[str, Any]:
        return run_rendezvous_gate(props)


class ReadyGateProvider(_GateProvider):
    input_keys = ReadyGateArgs.field_names()
    id_prefix = "ready"

    def outputs(self, props: Mapping[str, Any]) -> dict[str, Any]:
        return run_ready_gate(props)


class RendezvousGate(pulumi.dynamic.Resource, module="gates", name="RendezvousGate"):
    """Blocks until every rank joined vLLM's distributed group; fails naming the rank that did not."""

    passed_at: pulumi.Output[str]
    """When the gate passed (ISO-8601, UTC)."""
    elapsed_s: pulumi.Output[float]
    """How long the gate waited, in seconds."""
    world_size: pulumi.Output[int | None]
    """The world size vLLM reported, when its rank-assignment line was seen."""
    joined_at: pulumi.Output[dict[str, str]]
    """Per rank (as a string key), the log timestamp of its join line."""

    def __init__(self, name: str, args: RendezvousGateArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        props = {**props_of(args), "passed_at": None, "elapsed_s": None, "world_size": None, "joined_at": None}
        secret_ = pulumi.ResourceOptions(additional_secret_outputs=secret_outputs(args))
        super().__init__(RendezvousGateProvider(), name, props, pulumi.ResourceOptions.merge(secret_, opts))


class ReadyGate(pulumi.dynamic.Resource, module="gates", name="ReadyGate"):
    """Blocks until the head logged startup complete and /v1/models lists the served model."""

    passed_at: pulumi.Output[str]
    """When the gate passed (ISO-8601, UTC)."""
    elapsed_s: pulumi.Output[float]
    """How long the gate waited, in seconds."""
    phases: pulumi.Output[dict[str, str]]
    """Boot phase -> when it was first seen (the log line's timestamp)."""

    def __init__(self, name: str, args: ReadyGateArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        props = {**props_of(args), "passed_at": None, "elapsed_s": None, "phases": None}
        secret_ = pulumi.ResourceOptions(additional_secret_outputs=secret_outputs(args))
        super().__init__(ReadyGateProvider(), name, props, pulumi.ResourceOptions.merge(secret_, opts))
