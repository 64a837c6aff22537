"""LiveRanks: a rank found not running on a preview or up replaces every rank; a healthy one changes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from components import live_ranks
from components.gates import GateRank
from components.rank_watch import ContainerState, SourceError

RANKS = [GateRank(rank=0, node="head", host="10.0.0.1", port=22, user="me", container="c-head"),
         GateRank(rank=1, node="worker", host="10.0.0.2", port=22, user="me", container="c-worker")]
PROPS: dict[str, Any] = {"ranks": [r.to_prop() for r in RANKS], "ssh_private_key": None, "ssh_agent_socket": None,
                         "ssh_known_hosts_file": None, "observed": {}}


class FakeSource:
    def __init__(self, states: dict[int, ContainerState | Exception]) -> None:
        self.states = states

    def state(self, rank: int) -> ContainerState:
        s = self.states[rank]
        if isinstance(s, Exception):
            raise s
        return s


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> dict[int, ContainerState | Exception]:
    states: dict[int, ContainerState | Exception] = {0: ContainerState(status="running"),
                                                     1: ContainerState(status="running")}
    monkeypatch.setattr(live_ranks, "_source", lambda _props: FakeSource(states))
    return states


def test_healthy_ranks_change_nothing(world: dict[int, Any]) -> None:
    diff = live_ranks.LiveRanksProvider().diff("live-1", PROPS, PROPS)
    assert not diff.changes and not diff.replaces


@pytest.mark.parametrize("down", [ContainerState(status="exited", exit_code=137), ContainerState(status="missing")])
def test_a_rank_not_running_replaces_live_ranks(world: dict[int, Any], down: ContainerState) -> None:
    world[1] = down
    diff = live_ranks.LiveRanksProvider().diff("live-1", PROPS, PROPS)
    assert diff.changes and diff.replaces == ["observed"], "the replacement is what replaces every rank"


def test_an_unreachable_node_is_not_drift(world: dict[int, Any]) -> None:
    world[1] = SourceError("ssh me@10.0.0.2:22 timed out")
    diff = live_ranks.LiveRanksProvider().diff("live-1", PROPS, PROPS)
    assert not diff.replaces


def test_refresh_reports_what_runs(world: dict[int, Any]) -> None:
    world[0] = ContainerState(status="exited", exit_code=143)
    read = live_ranks.LiveRanksProvider().read("live-1", dict(PROPS))
    assert read.outs["observed"] == {"head": "exited (143)", "worker": "running"}


def test_new_ssh_settings_update_in_place(world: dict[int, Any]) -> None:
    news = {**PROPS, "ssh_known_hosts_file": "/etc/ssh/known"}
    diff = live_ranks.LiveRanksProvider().diff("live-1", PROPS, news)
    assert diff.changes and not diff.replaces
