"""The supervisor's decisions, one look at a time (components/supervisor/policy.py)."""

from __future__ import annotations

from typing import Any

from components.supervisor import policy
from components.supervisor.policy import Budget, RankView


def ranks(*states: str, generation: str = "g1") -> list[RankView]:
    """`run`, `exit`, `oom`, `gone` (no container) or `down` (agent unreachable), head first."""
    out = []
    for i, st in enumerate(states):
        node = f"node-{i + 1}"
        if st == "down":
            out.append(RankView(node=node, reachable=False))
        else:
            out.append(
                RankView(
                    node=node,
                    reachable=True,
                    exists=st != "gone",
                    running=st == "run",
                    exit_code=137 if st in ("exit", "oom") else None,
                    oom_killed=st == "oom",
                    generation=generation,
                )
            )
    return out


def decide(views: list[RankView], **overrides: Any) -> policy.Decision:
    kw: dict[str, Any] = dict(
        paused=False, lock_holder=None, given_up=None, armed_generation="g1", probe_due=False, drift_streak=0
    )
    kw.update(overrides)
    return policy.decide(views, **kw)


def test_a_dead_worker_heals_with_its_cause() -> None:
    d = decide(ranks("run", "exit"))
    assert d.action == "heal" and d.why == "the rank on node-2 exited with code 137"
    assert decide(ranks("run", "oom")).why == "the rank on node-2 was OOM-killed"


def test_of_several_ended_ranks_the_cause_is_the_oom_killed_one_then_a_worker_before_the_head() -> None:
    # Real vLLM's head exits 0 seconds after it lost its worker: seen together, the worker's end is the cause.
    assert policy.rank_death(ranks("exit", "exit", "run")) == "the rank on node-2 exited with code 137"
    assert policy.rank_death(ranks("exit", "exit", "oom")) == "the rank on node-3 was OOM-killed"
    assert policy.rank_death(ranks("oom", "exit")) == "the rank on node-1 was OOM-killed"
    assert policy.rank_death(ranks("exit", "run")) == "the rank on node-1 exited with code 137"
    assert policy.rank_death(ranks("run", "run")) is None


def test_the_operator_and_an_update_come_before_any_action() -> None:
    dead = ranks("exit", "run")
    assert decide(dead, paused=True).action == "wait"
    held = decide(dead, lock_holder="pulumi up of dev")
    assert held.action == "wait" and "pulumi up of dev" in held.why
    assert decide(dead, given_up="3 restarts").action == "wait"


def test_nothing_is_done_for_a_generation_never_verified() -> None:
    # The first up still booting, or an update's new ranks: the supervisor verifies, never heals.
    assert decide(ranks("run", "run", generation="g2")).action == "verify"
    assert decide(ranks("exit", "run", generation="g2")).action == "wait"
    assert decide(ranks("run", "run"), armed_generation="").action == "verify"


def test_a_node_not_answering_or_a_missing_container_waits() -> None:
    # after a reboot the group starts only once every node's docker answers
    d = decide(ranks("run", "down"))
    assert d.action == "wait" and "node-2" in d.why
    assert decide(ranks("run", "gone")).action == "wait"


def test_drift_probes_heal_on_a_hard_finding_at_once_and_on_a_soft_one_when_confirmed() -> None:
    serving = ranks("run", "run")
    assert decide(serving, drift_streak=1, last_drift="answers NaN", hard_drift=True).action == "heal"
    assert decide(serving, drift_streak=1).action == "probe"  # a refused port once: probe again first
    d = decide(serving, drift_streak=policy.CONFIRMING_PROBES, last_drift="refuses connections")
    assert d.action == "heal" and "refuses connections" in d.why
    assert decide(serving, probe_due=True).action == "probe"
    assert decide(serving).action == "wait"


def test_the_restart_budget_doubles_its_backoff_and_then_gives_up() -> None:
    b = Budget(max_restarts=3, window_s=3600, backoff_s=30)
    now = 10_000.0
    assert policy.next_attempt([], now, b)[0] == now
    assert policy.next_attempt([now - 5], now, b)[0] == now - 5 + 30
    assert policy.next_attempt([now - 100, now - 5], now, b)[0] == now - 5 + 60
    when, why = policy.next_attempt([now - 300, now - 100, now - 5], now, b)
    assert when is None and "supervisor.maxRestarts 3" in why
    # restarts older than the window no longer count
    assert policy.next_attempt([now - 7200, now - 7100, now - 7000], now, b)[0] == now


def test_a_lock_ends_with_its_lease() -> None:
    assert policy.lock_holder({"holder": "up", "expires_at": 200.0}, 100.0) == "up"
    assert policy.lock_holder({"holder": "up", "expires_at": 99.0}, 100.0) is None
    assert policy.lock_holder(None, 100.0) is None


def test_a_verification_says_nothing_when_a_rank_was_replaced_restarted_or_stopped_meanwhile() -> None:
    def view(node: str, generation: str = "g1", started: str = "t0", running: bool = True) -> RankView:
        return RankView(
            node=node, reachable=True, exists=True, running=running, generation=generation, started_at=started
        )

    before = [view("head"), view("worker")]
    assert policy.changed_during(before, [view("head"), view("worker")]) is None
    replaced = policy.changed_during(before, [view("head", "g2", "t1"), view("worker", "g2", "t1")])
    assert replaced is not None and "g1 -> g2" in replaced and "head" in replaced
    restarted = policy.changed_during(before, [view("head"), view("worker", started="t1")])
    assert restarted is not None and "worker" in restarted
    stopped = policy.changed_during(before, [view("head"), view("worker", running=False)])
    assert stopped is not None and "not running" in stopped


def test_the_status_line_says_when_the_supervisor_is_not_armed_for_what_runs() -> None:
    assert policy.not_armed({"running_generation": "g1", "armed_generation": "g1"}) is None
    assert policy.not_armed({"running_generation": "", "armed_generation": "g1"}) is None
    gap = policy.not_armed({"running_generation": "g2", "armed_generation": "g1"})
    assert gap is not None and "g2" in gap and "armed for g1" in gap
    line = policy.summary({"doing": "serving", "running_generation": "g2", "armed_generation": "g1"}, 0.0)
    assert "NOT ARMED for the running generation g2" in line


def test_the_status_command_names_an_unreadable_state_and_a_gap_in_arming() -> None:
    from components.operator.supervisor import format_status

    out = format_status(
        {
            "node": "spark-0",
            "doing": "paused by the operator",
            "paused": True,
            "state_error": "/var/lib/x/supervisor-state.json could not be read",
            "running_generation": "g2",
            "armed_generation": "g1",
        }
    )
    assert "state: /var/lib/x/supervisor-state.json could not be read (paused until resume)" in out
    assert "NOT ARMED for the running generation g2 (armed for g1)" in out
