"""The typed objects at process boundaries (components/contract.py): serialisation derived from the fields, used
on both sides, errors naming the field; and the files shipped with a node program derived from its imports."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pytest

from components.contract import Contract, ContractError, secret
from components.dynamic import props_of, read_props, secret_outputs
from components.gates.decisions import GateBounds
from components.shipped import REPO, module_files
from components.ssh import SshAccess
from components.supervisor.agent_config import AgentConfig
from tests.supervisor.fake_node import agent_config


@dataclass(frozen=True, kw_only=True)
class Inner(Contract):
    token: str | None = secret(default=None)
    size: int


@dataclass(frozen=True, kw_only=True)
class Outer(Contract):
    name: str
    limit_s: float
    inner: Inner
    items: tuple[Inner, ...]
    note: str | None = None


def test_a_round_trip_through_json_gives_the_same_object_with_nested_types() -> None:
    value = Outer(name="a", limit_s=1.5, inner=Inner(size=2), items=(Inner(size=3, token="t"),))
    again = Outer.from_json(value.to_json())
    assert again == value and isinstance(again.items, tuple) and isinstance(again.items[0], Inner)
    assert json.loads(value.to_json())["items"] == [{"size": 3, "token": "t"}]


def test_numbers_come_back_as_the_declared_type_as_the_state_keeps_them_as_floats() -> None:
    again = Outer.from_props({"name": "a", "limit_s": 5, "inner": {"size": 2.0}, "items": []})
    assert again.limit_s == 5.0 and isinstance(again.limit_s, float)
    assert again.inner.size == 2 and isinstance(again.inner.size, int)


@pytest.mark.parametrize(
    "props, said",
    [
        ({"name": "a", "inner": {"size": 1}, "items": []}, "Outer.limit_s is missing"),
        ({"name": "a", "limit_s": 1, "inner": {}, "items": []}, "Outer.inner.size is missing"),
        ({"name": "a", "limit_s": 1, "inner": {"size": 1}, "items": [{}]}, r"Outer.items\[0\].size is missing"),
        ({"name": 7, "limit_s": 1, "inner": {"size": 1}, "items": []}, "Outer.name must be str, got 7"),
        ({"name": "a", "limit_s": 1, "inner": "x", "items": []}, "Outer.inner must be an object"),
    ],
)
def test_a_payload_that_does_not_match_names_the_field(props: dict[str, object], said: str) -> None:
    with pytest.raises(ContractError, match=said):
        Outer.from_props(props)


def test_a_declared_rule_is_checked_on_the_receiving_side_too() -> None:
    with pytest.raises(ContractError, match="GateBounds: stall_s=0.0 must be > 0"):
        GateBounds.from_props({"rendezvous_timeout_s": 1, "ready_timeout_s": 1, "stall_s": 0})


def test_credentials_at_any_depth_are_sent_as_secrets_and_marked_secret_in_the_state() -> None:
    value = Outer(name="a", limit_s=1, inner=Inner(size=1, token="T"), items=())
    props = props_of(value)
    assert isinstance(props["inner"]["token"], pulumi.Output) and props["name"] == "a"
    assert secret_outputs(value) == ["inner"]
    # What the engine hands the provider: a secret arrives wrapped, and is read back plain.
    wrapped = {"4dabf18193072939515e22adb298388d": "1b47061264138c4ac30d75fd1eb44270", "value": "T"}
    back = read_props(Outer, {**value.to_props(), "inner": {"size": 1, "token": wrapped}})
    assert back == value
    assert SshAccess.secret_fields() == ["private_key"]


def test_the_agent_config_is_written_and_read_as_one_declaration() -> None:
    cfg = agent_config("/state", 4242, stall_s=33)
    again = AgentConfig.from_json(cfg.to_json())
    assert again == cfg and again.role == "leader" and again.leader and again.leader.bounds.stall_s == 33.0
    assert AgentConfig.from_json(json.dumps({**cfg.to_props(), "leader": None})).role == "worker"


# --- what is shipped with the supervisor agent --------------------------------------------------------------


def _project_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    found |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    return {m for m in found if m.startswith("components")}


def test_the_files_shipped_with_the_agent_are_its_imports_closed_over() -> None:
    shipped = module_files("components.supervisor.agent")
    assert "components/contract.py" in shipped and "components/supervisor/agent_config.py" in shipped
    assert "components/gates/gates.py" not in shipped, "the gates' pulumi resources stay on the operator's machine"
    for name in shipped:
        for module in _project_imports(REPO / name):
            as_file = module.replace(".", "/")
            assert f"{as_file}.py" in shipped or f"{as_file}/__init__.py" in shipped, f"{name} imports {module}"


def test_an_import_of_a_missing_module_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from components import shipped

    (tmp_path / "components").mkdir()
    (tmp_path / "components" / "__init__.py").write_text("")
    (tmp_path / "components" / "a.py").write_text("from components.gone import x\n")
    monkeypatch.setattr(shipped, "REPO", tmp_path)
    with pytest.raises(ImportError, match=r"components.gone \(imported on the way from components.a\)"):
        shipped.module_files("components.a")
