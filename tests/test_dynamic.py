"""What every dynamic provider shares: plain values, input comparison, the CRUD of a state-only resource."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi.runtime import rpc

from components.dynamic import StateOnlyProvider, as_rows, as_set, changed_inputs, plain, unwrap_secret


def _wrapped(value: Any) -> dict[str, Any]:
    return {rpc._special_sig_key: rpc._special_secret_sig, "value": value}  # noqa: SLF001


class Echo(StateOnlyProvider):
    input_keys = ("name", "rerun_on")
    normalize = {"rerun_on": as_set}
    id_prefix = "echo"

    def outputs(self, props: Mapping[str, Any]) -> dict[str, Any]:
        return {**plain(self.input_keys, props), "seen": True}


def test_a_wrapped_secret_is_unwrapped_and_anything_else_left_alone() -> None:
    assert unwrap_secret(_wrapped("k-1")) == "k-1"
    assert unwrap_secret({"value": "not a secret"}) == {"value": "not a secret"}
    assert plain(["a", "b"], {"a": _wrapped(1)}) == {"a": 1, "b": None}


def test_numbers_compare_as_the_state_round_trips_them() -> None:
    assert changed_inputs(["n"], {"n": 5}, {"n": 5.0}) == []
    assert changed_inputs(["n", "s"], {"n": 5, "s": "a"}, {"n": 6, "s": "a"}) == ["n"]


def test_normalizers_say_what_order_does_not_matter() -> None:
    olds = {"ids": ["a", "b"], "rows": [{"rank": 1, "node": "b"}, {"rank": 0, "node": "a"}]}
    news = {"ids": ["b", "a"], "rows": [{"rank": 0.0, "node": "a"}, {"rank": 1, "node": "b"}]}
    assert changed_inputs(["ids", "rows"], olds, news, {"ids": as_set, "rows": as_rows}) == []
    assert changed_inputs(["ids", "rows"], olds, news) == ["ids", "rows"]
    assert changed_inputs(["ids"], olds, {"ids": ["a"]}, {"ids": as_set}) == ["ids"]


def test_a_state_only_resource_creates_and_updates_in_place_and_leaves_nothing() -> None:
    created = Echo().create({"name": "x", "rerun_on": ["c1"]})
    assert created.id.startswith("echo-") and len(created.id) == len("echo-") + 16
    assert created.outs == {"name": "x", "rerun_on": ["c1"], "seen": True}
    same = Echo().diff(
        created.id,
        {"name": "x", "rerun_on": ["c1", "c2"], "__provider": "old"},
        {"name": "x", "rerun_on": ["c2", "c1"], "__provider": "new"},
    )
    assert same.changes is False
    changed = Echo().diff(created.id, {"name": "x"}, {"name": "y"})
    assert changed.changes is True and changed.replaces == [] and not changed.delete_before_replace
    assert Echo().update(created.id, {}, {"name": "y"}).outs == {"name": "y", "rerun_on": None, "seen": True}
    assert Echo().delete(created.id, {}) is None
