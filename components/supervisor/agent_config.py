"""The supervisor agent's config file: written by the program (supervisor.py `agent_config`), read by the agent in
its container (agent.py `main`). One declaration, serialised from its fields (components/contract.py); no secret
in it (the token is a file of its own, the API key is read from the head container's env)."""

from __future__ import annotations

from dataclasses import dataclass

from components.contract import Contract
from components.gates.decisions import GateBounds


@dataclass(frozen=True, kw_only=True)
class AgentNode(Contract):
    """A rank as the leader reaches it: its node's agent and container."""

    name: str
    url: str
    container: str
    min_mem_gib: float
    """A restart waits for this MemAvailable floor (the preflight's), or the rank it starts would refuse."""


@dataclass(frozen=True, kw_only=True)
class GuardConfig(Contract):
    """The watchdog's rule again, in the process docker restarts at boot (the host watchdog does not come back
    after a reboot until the next `pulumi up`)."""

    floor_gib: float
    sample_s: float
    samples: int


@dataclass(frozen=True, kw_only=True)
class LeaderConfig(Contract):
    """What the head's agent needs to lead: the ranks, the endpoint it probes, its budget and the gates' bounds."""

    nodes: tuple[AgentNode, ...]
    endpoint: str
    generation: str
    """What the update that installs this config verified: the leader arms for it when the head runs it."""
    model: str
    expected_answer: str
    probe_seconds: float
    probe_timeout_s: float
    max_restarts: int
    window_s: float
    backoff_s: float
    mem_wait_s: float
    bounds: GateBounds
    """A restart is a boot: the gates' rules and bounds (boot.py), then the verifier's."""
    boot_poll_s: float
    verify_timeout_s: float
    notify_command: str


@dataclass(frozen=True, kw_only=True)
class AgentConfig(Contract):
    stack: str
    node: str
    listen_hosts: tuple[str, ...]
    """The first is bound as it must be; the head's second with IP_FREEBIND (agent.py says why)."""
    listen_port: int
    token_file: str
    state_dir: str
    docker_socket: str
    container: str
    memory_guard: GuardConfig | None = None
    leader: LeaderConfig | None = None
    """Set on the head's agent only."""

    @property
    def role(self) -> str:
        return "leader" if self.leader is not None else "worker"
