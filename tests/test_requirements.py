"""requirements.txt is all the venv the Pulumi CLI makes (`pulumi install`) needs to run the program."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def pinned(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line (names normalised as pip does)."""
    pins = {}
    for line in path.read_text().splitlines():
        if m := re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip()):
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def program_imports() -> set[str]:
    """The top-level modules the program imports that are neither the standard library nor its own."""
    found: set[str] = set()
    for path in [REPO / "__main__.py", *(REPO / "components").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in {"components", "__future__"}}


def test_the_typechecker_pulumi_yaml_runs_is_pinned_in_requirements_txt() -> None:
    options = yaml.safe_load((REPO / "Pulumi.yaml").read_text())["runtime"]["options"]
    assert options["typechecker"] in pinned(REPO / "requirements.txt")


def test_every_package_the_program_imports_is_pinned_in_requirements_txt_with_its_stubs() -> None:
    pins = pinned(REPO / "requirements.txt")
    distributions = importlib.metadata.packages_distributions()
    # Scripts the program sends to a node (the staging program, the supervisor's agent) run in the serving
    # image's python, not in this venv: they import only the standard library and what the image has.
    node_side = {"huggingface_hub"}
    for module in sorted(program_imports() - node_side):
        names = {re.sub(r"[-_.]+", "-", d).lower() for d in distributions.get(module, [])}
        assert names & set(pins), f"the program imports {module} (from {names}); pin it in requirements.txt"
        stubs = f"types-{module}"
        if stubs in pinned(REPO / "requirements-dev.txt"):
            raise AssertionError(f"{stubs} is in requirements-dev.txt: mypy needs it before every preview")
    assert "types-requests" in pins, "mypy --strict needs requests' stubs to check the program"
