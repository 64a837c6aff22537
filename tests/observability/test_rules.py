"""The alert rules: promtool accepts them, their unit tests pass, and each has a test and a runbook line."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.observability.tools import OBSERVABILITY, REPO, tool

RULES = OBSERVABILITY / "rules.yml"
RULES_TEST = OBSERVABILITY / "rules_test.yml"


def alerts() -> list[str]:
    data = yaml.safe_load(RULES.read_text())
    return [r["alert"] for g in data["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in done.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    done = subprocess.run(
        [tool("promtool"), "test", "rules", RULES_TEST.name], cwd=OBSERVABILITY, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    data = yaml.safe_load(RULES_TEST.read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in data["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    for name in alerts():
        assert name in fired, f"{name}: no test in rules_test.yml where it fires"
    # TargetDown's quiet case is the other job's series that never fires (a whole series, not an instant).
    for name in set(alerts()) - {"Dsv41TargetDown"}:
        assert name in quiet, f"{name}: no test in rules_test.yml where it stays quiet"


def test_every_alert_has_a_runbook_line_in_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Alerts\n", 1)
    assert len(section) == 2, "README.md has no '## Alerts' section (rules.yml's annotations point there)"
    lines = re.findall(r"^\| `(Dsv41\w+)` \|", section[1].split("\n## ", 1)[0], flags=re.M)
    assert sorted(lines) == sorted(alerts()), "README's Alerts table must have one row per alert in rules.yml"
