"""The commit-subject check (.ci/commits.py): the convention in docs/development.md, as CI applies it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("ci_commits", Path(__file__).resolve().parents[1] / ".ci" / "commits.py")
assert spec is not None and spec.loader is not None
commits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(commits)


def test_area_and_fact_under_72_pass_and_a_merge_is_gits_own() -> None:
    assert (
        commits.problems(
            ["operator: one command, dsv41-exl3, with verbs", "weights, gates: advise", "Merge branch 'x'"]
        )
        == []
    )


def test_a_long_subject_or_one_without_an_area_is_refused_naming_it() -> None:
    long = "sim: " + "x" * 70
    found = commits.problems([long, "Render the head's resolved address", "Fix: stuff"])
    assert found == [
        f"{len(long)} characters (under 72): {long}",
        "not `<area>: <what>`: Render the head's resolved address",
        "not `<area>: <what>`: Fix: stuff",
    ]
