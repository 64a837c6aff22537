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

from components.dynamic import StateOnlyProvider, as_rows, as_set, log_progress, plain, secret_or_none, unwrap_secret
from components.gates.decisions import (
    MODELS_PROBE_TIMEOUT_S,
    WATCH_POLL_INTERVAL_S,
    WATCH_PROGRESS_INTERVAL_S,
    ModelsEndpoint,
    ReadySettings,
    RendezvousSettings,
    wait_for_ready,
    wait_for_rendezvous,
)
from components.gates.observations import RankSpec, SystemClock
from components.gates.poll_source import SshRankSource
from components.gates.stream_source import StreamRankSource

SHARED_INPUT_KEYS = (
    "ranks",
    "ssh_private_key",
    "ssh_agent_socket",
    "ssh_known_hosts_file",
    "poll_interval_s",
    "progress_interval_s",
    "rerun_on",
)
RENDEZVOUS_INPUT_KEYS = (*SHARED_INPUT_KEYS, "rendezvous_timeout_s")
READY_INPUT_KEYS = (
    *SHARED_INPUT_KEYS,
    "api_base",
    "model_name",
    "api_key",
    "ready_timeout_s",
    "stall_s",
    "models_timeout_s",
)
SECRET_KEYS = ["ssh_private_key", "api_key"]

# Not operator settings: how often a node that cannot stream is polled (POLL_INTERVAL_S, <= 5 s so an exited
# container is noticed within 15 s even then), how often the gates report, and how long one /v1/models look
# may take. The program wires these.
POLL_INTERVAL_S = WATCH_POLL_INTERVAL_S
PROGRESS_INTERVAL_S = WATCH_PROGRESS_INTERVAL_S
MODELS_TIMEOUT_S = MODELS_PROBE_TIMEOUT_S


# ---------------------------------------------------------------------------------------------
# Program-side args


# The program names a rank the same way the watch does: one definition, validated on construction.
GateRank = RankSpec


def _check_ranks(ranks: Sequence[GateRank]) -> None:
    numbers = sorted(r.rank for r in ranks)
    if numbers != list(range(len(numbers))) or not numbers:
        raise ValueError(f"gate ranks {numbers} must be 0..N-1, each once (0 = the head node)")


@dataclass(frozen=True, kw_only=True)
class RendezvousGateArgs:
    """Inputs of RendezvousGate. `rerun_on`: the ids of every serving container. No defaults: the settings
    come from components/config, so a forgotten wire fails the type check."""

    ranks: Sequence[GateRank]
    rerun_on: pulumi.Input[Sequence[pulumi.Input[str]]]
    ssh_private_key: pulumi.Input[str] | None
    ssh_agent_socket: str | None
    ssh_known_hosts_file: str | None
    rendezvous_timeout_s: float
    poll_interval_s: float
    progress_interval_s: float

    def __post_init__(self) -> None:
        _check_ranks(self.ranks)
        RendezvousSettings(
            rendezvous_timeout_s=self.rendezvous_timeout_s,
            poll_interval_s=self.poll_interval_s,
            progress_interval_s=self.progress_interval_s,
        )


@dataclass(frozen=True, kw_only=True)
class ReadyGateArgs:
    """Inputs of ReadyGate: the ranks to watch and the head's OpenAI API (`api_base` without /v1). No defaults,
    as for RendezvousGateArgs."""

    ranks: Sequence[GateRank]
    rerun_on: pulumi.Input[Sequence[pulumi.Input[str]]]
    api_base: pulumi.Input[str]
    model_name: pulumi.Input[str]
    api_key: pulumi.Input[str] | None
    ssh_private_key: pulumi.Input[str] | None
    ssh_agent_socket: str | None
    ssh_known_hosts_file: str | None
    ready_timeout_s: float
    stall_s: float
    poll_interval_s: float
    progress_interval_s: float
    models_timeout_s: float

    def __post_init__(self) -> None:
        _check_ranks(self.ranks)
        ReadySettings(
            ready_timeout_s=self.ready_timeout_s,
            stall_s=self.stall_s,
            poll_interval_s=self.poll_interval_s,
            progress_interval_s=self.progress_interval_s,
        )
        if self.models_timeout_s <= 0:
            raise ValueError(f"models_timeout_s={self.models_timeout_s} must be > 0")


# ---------------------------------------------------------------------------------------------
# Provider-side: plain values from properties


def ranks_from_prop(value: Any) -> list[RankSpec]:
    """The `ranks` property as specs; every provider that watches ranks reads them this way."""
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"gate ranks must be a non-empty list of {{rank, node, host, port, user, container}}, got {value!r}"
        )
    return [RankSpec.from_prop(r) for r in value]


def _setting(props: Mapping[str, Any], key: str) -> float:
    # The program sends every setting (from components/config); a missing one is a bug, not a default.
    value = unwrap_secret(props.get(key))
    if value is None:
        raise ValueError(f"gate property {key} is missing: the program sends every setting")
    return float(value)


# What makes two values of an input the same: which containers and ranks, not their order.
NORMALIZE = {"rerun_on": as_set, "ranks": as_rows}


def _ssh_settings(props: Mapping[str, Any]) -> dict[str, str | None]:
    key = unwrap_secret(props.get("ssh_private_key"))
    agent = unwrap_secret(props.get("ssh_agent_socket"))
    known_hosts = props.get("ssh_known_hosts_file")
    return {
        "private_key": str(key) if key else None,
        "agent_socket": str(agent) if agent else None,
        "known_hosts_file": str(known_hosts) if known_hosts else None,
    }


def rank_source(props: Mapping[str, Any]) -> SshRankSource:
    """The ranks of `props`, looked at once over SSH with its key, agent and known_hosts (LiveRanks)."""
    ssh = _ssh_settings(props)
    return SshRankSource(
        ranks_from_prop(unwrap_secret(props.get("ranks"))),
        private_key=ssh["private_key"],
        agent_socket=ssh["agent_socket"],
        known_hosts_file=ssh["known_hosts_file"],
    )


def stream_source(props: Mapping[str, Any]) -> StreamRankSource:
    """The ranks of `props`, followed through one ssh session per node (the gates)."""
    ssh = _ssh_settings(props)
    return StreamRankSource(
        ranks_from_prop(unwrap_secret(props.get("ranks"))),
        private_key=ssh["private_key"],
        agent_socket=ssh["agent_socket"],
        known_hosts_file=ssh["known_hosts_file"],
    )


def run_rendezvous_gate(props: Mapping[str, Any]) -> dict[str, Any]:
    """Wait for every rank to join; return the outputs (inputs echoed plus the verdict)."""
    secrets = tuple(str(s) for s in (unwrap_secret(props.get(k)) for k in SECRET_KEYS) if s)
    settings = RendezvousSettings(
        rendezvous_timeout_s=_setting(props, "rendezvous_timeout_s"),
        poll_interval_s=_setting(props, "poll_interval_s"),
        progress_interval_s=_setting(props, "progress_interval_s"),
        secrets=secrets,
    )
    ranks = ranks_from_prop(unwrap_secret(props.get("ranks")))
    result = wait_for_rendezvous(ranks, stream_source(props), settings, SystemClock(), log_progress)
    return {
        **plain(RENDEZVOUS_INPUT_KEYS, props),
        "passed_at": result.passed_at,
        "elapsed_s": result.elapsed_s,
        "world_size": result.world_size,
        "joined_at": {str(k): v for k, v in sorted(result.joined_at.items())},
    }


def run_ready_gate(props: Mapping[str, Any]) -> dict[str, Any]:
    """Wait for the head's API to list the model; return the outputs (inputs echoed plus the verdict)."""
    api_key = unwrap_secret(props.get("api_key"))
    secrets = tuple(str(s) for s in (unwrap_secret(props.get(k)) for k in SECRET_KEYS) if s)
    settings = ReadySettings(
        ready_timeout_s=_setting(props, "ready_timeout_s"),
        stall_s=_setting(props, "stall_s"),
        poll_interval_s=_setting(props, "poll_interval_s"),
        progress_interval_s=_setting(props, "progress_interval_s"),
        secrets=secrets,
    )
    model = str(unwrap_secret(props.get("model_name")) or "")
    api_base = str(unwrap_secret(props.get("api_base")) or "")
    if not model or not api_base.startswith(("http://", "https://")):
        raise ValueError(
            f"ReadyGate needs model_name and an http(s) api_base, got model_name={model!r} api_base={api_base!r}"
        )
    probe = ModelsEndpoint(
        api_base, model, str(api_key) if api_key else None, timeout_s=_setting(props, "models_timeout_s")
    )
    ranks = ranks_from_prop(unwrap_secret(props.get("ranks")))
    result = wait_for_ready(ranks, stream_source(props), settings, SystemClock(), log_progress, probe, model)
    return {
        **plain(READY_INPUT_KEYS, props),
        "passed_at": result.passed_at,
        "elapsed_s": result.elapsed_s,
        "phases": result.phases,
    }


class _GateProvider(StateOnlyProvider):
    """What the gates share: a gate leaves nothing behind, and any input change re-runs it in place."""

    normalize = NORMALIZE
    id_prefix = "gate"


class RendezvousGateProvider(_GateProvider):
    input_keys = RENDEZVOUS_INPUT_KEYS
    id_prefix = "rendezvous"

    def outputs(self, props: Mapping[str, Any]) -> dict[str, Any]:
        return run_rendezvous_gate(props)


class ReadyGateProvider(_GateProvider):
    input_keys = READY_INPUT_KEYS
    id_prefix = "ready"

    def outputs(self, props: Mapping[str, Any]) -> dict[str, Any]:
        return run_ready_gate(props)


def _shared_props(args: RendezvousGateArgs | ReadyGateArgs) -> dict[str, Any]:
    """The inputs both gates take (SHARED_INPUT_KEYS): which ranks, how to reach them, how often to look."""
    return {
        "ranks": [r.to_prop() for r in args.ranks],
        "ssh_private_key": secret_or_none(args.ssh_private_key),
        "ssh_agent_socket": args.ssh_agent_socket,
        "ssh_known_hosts_file": args.ssh_known_hosts_file,
        "poll_interval_s": args.poll_interval_s,
        "progress_interval_s": args.progress_interval_s,
        "rerun_on": args.rerun_on,
    }


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
        props: dict[str, Any] = {
            **_shared_props(args),
            "rendezvous_timeout_s": args.rendezvous_timeout_s,
            "passed_at": None,
            "elapsed_s": None,
            "world_size": None,
            "joined_at": None,
        }
        secret = pulumi.ResourceOptions(additional_secret_outputs=list(SECRET_KEYS))
        super().__init__(RendezvousGateProvider(), name, props, pulumi.ResourceOptions.merge(secret, opts))


class ReadyGate(pulumi.dynamic.Resource, module="gates", name="ReadyGate"):
    """Blocks until the head logged startup complete and /v1/models lists the served model."""

    passed_at: pulumi.Output[str]
    """When the gate passed (ISO-8601, UTC)."""
    elapsed_s: pulumi.Output[float]
    """How long the gate waited, in seconds."""
    phases: pulumi.Output[dict[str, str]]
    """Boot phase -> when it was first seen (the log line's timestamp)."""

    def __init__(self, name: str, args: ReadyGateArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        props: dict[str, Any] = {
            **_shared_props(args),
            "api_base": args.api_base,
            "model_name": args.model_name,
            "api_key": secret_or_none(args.api_key),
            "ready_timeout_s": args.ready_timeout_s,
            "stall_s": args.stall_s,
            "models_timeout_s": args.models_timeout_s,
            "passed_at": None,
            "elapsed_s": None,
            "phases": None,
        }
        secret = pulumi.ResourceOptions(additional_secret_outputs=list(SECRET_KEYS))
        super().__init__(ReadyGateProvider(), name, props, pulumi.ResourceOptions.merge(secret, opts))
