"""What the supervisor decides, apart from how it looks and acts: pure logic, stdlib only (it also runs
inside the supervisor's container, on the serving image's Python).

The supervisor sees each rank's container (`RankView`, from the node's agent), the update lock, its own
pause flag and the endpoint's probe verdicts; `decide` turns one such look into one action. The restart
budget (`supervisor.maxRestarts` in `supervisor.windowHours`, with doubling backoff) is `next_attempt`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

# How many drift probes in a row, `confirm`-grade ones (a refused port, a timeout with the engine idle), make a
# dead group: one can be a hiccup of the head's own loopback; NaN, -inf and vLLM's dead-engine answer act at once.
CONFIRMING_PROBES = 2


@dataclass(frozen=True)
class RankView:
    """One rank's container as its node's agent reports it; `reachable` False: the agent did not answer."""

    node: str
    reachable: bool
    exists: bool = False
    running: bool = False
    exit_code: int | None = None
    oom_killed: bool = False
    generation: str = ""
    started_at: str = ""
    mem_available_gib: float | None = None
    error: str = ""

    @classmethod
    def from_json(cls, node: str, data: Mapping[str, Any]) -> RankView:
        return cls(
            node=node,
            reachable=True,
            exists=bool(data.get("exists")),
            running=bool(data.get("running")),
            exit_code=data.get("exit_code"),
            oom_killed=bool(data.get("oom_killed")),
            generation=str(data.get("generation") or ""),
            started_at=str(data.get("started_at") or ""),
            mem_available_gib=data.get("mem_available_gib"),
        )


Action = Literal["wait", "verify", "probe", "heal"]


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str


def rank_death(ranks: Sequence[RankView]) -> str | None:
    """The cause when a rank's container has ended (the group cannot serve without it), else None.

    Of several ended ranks the one that names the cause: an OOM-killed one, then a worker before the head (real
    vLLM's head exits 0 seconds after it lost a worker: its exit is the consequence). `ranks[0]` is the head."""
    dead = [(i, r) for i, r in enumerate(ranks) if r.reachable and r.exists and not r.running]
    if not dead:
        return None
    _, r = min(dead, key=lambda d: (not d[1].oom_killed, d[0] == 0, d[0]))
    how = "was OOM-killed" if r.oom_killed else f"exited with code {r.exit_code}"
    return f"the rank on {r.node} {how}"


def decide(
    ranks: Sequence[RankView],
    *,
    paused: bool,
    lock_holder: str | None,
    given_up: str | None,
    armed_generation: str,
    probe_due: bool,
    drift_streak: int,
    last_drift: str = "",
    hard_drift: bool = False,
) -> Decision:
    """One look's action. The order is the rules' priority: the operator and an update first, then what
    is known about every node, then the group itself."""
    if paused:
        return Decision("wait", "paused by the operator (dsv41-exl3 supervisor resume)")
    if lock_holder:
        return Decision("wait", f"an update holds the head's lock ({lock_holder}): the update owns the ranks")
    if given_up:
        return Decision("wait", f"gave up: {given_up}; run `pulumi up` (or resume after fixing the cause)")
    unreachable = [r.node for r in ranks if not r.reachable]
    if unreachable:
        # A node coming back from a reboot: the group starts in order only once every node's docker answers.
        return Decision("wait", f"waiting for the agent on {', '.join(unreachable)}")
    missing = [r.node for r in ranks if not r.exists]
    if missing:
        return Decision("wait", f"no rank container on {', '.join(missing)}: that is `pulumi up`'s to create")
    head_generation = ranks[0].generation
    if head_generation != armed_generation:
        # Nothing is done for a generation the supervisor has not seen serve real logprobs.
        if all(r.running for r in ranks):
            return Decision("verify", f"generation {head_generation or '?'} not yet verified by the supervisor")
        return Decision("wait", f"generation {head_generation or '?'} was never verified: left to `pulumi up`")
    death = rank_death(ranks)
    if death:
        return Decision("heal", death)
    if hard_drift or drift_streak >= CONFIRMING_PROBES:
        return Decision("heal", f"the endpoint {last_drift}")
    if probe_due or drift_streak:
        return Decision("probe", "probe due" if probe_due else "confirming a drift probe")
    return Decision("wait", "serving")


def changed_during(before: Sequence[RankView], after: Sequence[RankView]) -> str | None:
    """Why a verification that ran between two looks says nothing about the group now, or None.

    The answer it judged may have come from other ranks than those seen before it (an update replaced them, a
    rank restarted): arming on it would hold a generation, or a start, that nobody verified."""
    if len(before) != len(after):
        return "the nodes changed"
    for b, a in zip(before, after, strict=True):
        if not (a.reachable and a.exists and a.running):
            return f"the rank on {a.node} is not running now"
        if (b.generation, b.started_at) != (a.generation, a.started_at):
            change = f"{b.generation or '?'} -> {a.generation or '?'}"
            return f"the rank on {a.node} was replaced or restarted (generation {change})"
    return None


@dataclass(frozen=True)
class Budget:
    max_restarts: int
    window_s: float
    backoff_s: float


def restarts_in_window(restart_times: Sequence[float], now: float, window_s: float) -> int:
    return sum(1 for t in restart_times if now - t < window_s)


def next_attempt(restart_times: Sequence[float], now: float, budget: Budget) -> tuple[float | None, str]:
    """(when the next restart may start, why); None: the budget is spent, give up.

    The first restart in a window starts at once; each further one waits backoff_s, doubled per restart
    already in the window, after the previous one."""
    recent = sorted(t for t in restart_times if now - t < budget.window_s)
    if len(recent) >= budget.max_restarts:
        hours = budget.window_s / 3600
        return None, (
            f"{len(recent)} restarts within {hours:g} h (supervisor.maxRestarts "
            f"{budget.max_restarts} in supervisor.windowHours {hours:g})"
        )
    if not recent:
        return now, "first restart in the window"
    wait = budget.backoff_s * 2 ** (len(recent) - 1)
    return max(now, recent[-1] + wait), f"restart {len(recent) + 1} in the window, {wait:g} s after the last"


def lock_holder(lock: Mapping[str, Any] | None, now_wall: float) -> str | None:
    """Who holds the update lock, if it has not expired (a crashed update's lock ends with its lease)."""
    if not lock:
        return None
    if float(lock.get("expires_at", 0)) <= now_wall:
        return None
    return str(lock.get("holder") or "an update")


def take_lock(
    current: Mapping[str, Any] | None, holder: str, ttl_s: float, now_wall: float, takeover: str = ""
) -> tuple[dict[str, Any] | None, str | None]:
    """(the new lock, None) when `holder` may take or renew it; (None, the holder in the way) when another
    unexpired holder has it. `takeover` names a holder the caller knows is gone (its process ended without
    releasing): only that one is replaced before its lease ends."""
    held_by = lock_holder(current, now_wall)
    if held_by and held_by != holder and held_by != takeover:
        return None, held_by
    return {"holder": holder, "expires_at": now_wall + ttl_s}, None


def release_lock(current: Mapping[str, Any] | None, holder: str, now_wall: float) -> bool:
    """Whether `holder` may release the lock: only its own, or one that has expired."""
    held_by = lock_holder(current, now_wall)
    return held_by is None or held_by == holder


def event(kind: str, stack: str, **fields: Any) -> dict[str, Any]:
    """The notification's JSON object (supervisor.notifyCommand reads it on stdin)."""
    return {"event": kind, "stack": stack, **fields}


def not_armed(status: Mapping[str, Any]) -> str | None:
    """Why the supervisor would not heal what the head runs now, when it is armed for another generation (or
    none); None when it is armed for it, or nothing runs. While an update holds the lock this is expected."""
    running = str(status.get("running_generation") or "")
    armed = str(status.get("armed_generation") or "")
    if not running or running == armed:
        return None
    return (
        f"NOT ARMED for the running generation {running} (armed for {armed or 'none'}): a dead rank is left to "
        "`pulumi up` until the supervisor verifies what runs"
    )


def summary(status: Mapping[str, Any], now: float) -> str:
    """One line of the leader's status, for a preview's output."""
    parts = [f"supervisor: {status.get('doing') or 'starting'}"]
    if gap := not_armed(status):
        parts.append(gap)
    probe = status.get("last_probe") or {}
    if probe.get("at"):
        parts.append(f"last probe {probe.get('state')} {now - float(probe['at']):.0f} s ago")
    restarts = status.get("restarts") or []
    if restarts:
        last = restarts[-1]
        parts.append(f"{len(restarts)} restart(s), last: {last.get('cause')} -> {last.get('result')}")
    if status.get("given_up"):
        parts.append(f"GAVE UP: {status['given_up']}")
    return "; ".join(parts)
