"""Per-stack names on the nodes (issue 12, item 10): safe, stable, distinct."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from components import labels
from components.labels import MAX_PREFIX, stack_prefix


def test_a_safe_project_and_stack_give_the_plain_name() -> None:
    assert stack_prefix("dsv41-exl3", "dev") == "dsv41-exl3-dev"


@given(st.text(min_size=1, max_size=80), st.text(min_size=1, max_size=80))
def test_every_prefix_is_a_safe_container_and_file_name_and_stable(project: str, stack: str) -> None:
    prefix = stack_prefix(project, stack)
    assert re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", prefix) and len(prefix) <= MAX_PREFIX
    assert stack_prefix(project, stack) == prefix


@pytest.mark.parametrize(("a", "b"), [("Dev", "dev"), ("dev/x", "dev-x"), ("a" * 60, "a" * 61)])
def test_stacks_whose_names_sanitise_alike_still_differ(a: str, b: str) -> None:
    assert stack_prefix("dsv41-exl3", a) != stack_prefix("dsv41-exl3", b)


def test_empty_names_are_refused() -> None:
    with pytest.raises(ValueError, match="must both be non-empty"):
        stack_prefix("dsv41-exl3", "")


@pytest.mark.parametrize(("stack", "node"), [("dev", "node-1"), ("sparks", "spark-1"), ("a-b.c", "x"), ("n-1", "n-1")])
def test_a_ranks_name_tells_its_stack_back(stack: str, node: str) -> None:
    assert labels.stack_of_container(labels.container_name(stack, node), node) == stack


@pytest.mark.parametrize(
    ("container", "node"), [("dsv41-rank1", "spark-b"), ("dsv41-exl3-dev-node-2", "node-1"), ("dsv41-exl3--n", "n")]
)
def test_a_name_the_program_did_not_give_tells_no_stack(container: str, node: str) -> None:
    assert labels.stack_of_container(container, node) is None
