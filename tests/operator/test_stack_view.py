"""Reading a stack for the operator commands: validated like the program's own config, every failure one line."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
from pulumi import automation as auto
from pulumi.automation._cmd import CommandResult

from components import ssh
from components.config import NAMESPACE, parse
from components.operator import stack_view
from components.operator.stack_view import (
    REPO_ROOT,
    OperatorError,
    container_of,
    node_or_error,
    read_stack,
    secrets_of,
    ssh_target,
)
from tests.operator import stacks
from tests.operator.stacks import API_KEY, SSH_KEY, SUPERVISOR_TOKEN
from tests.support.configs import two_sparks


class FakeStack:
    def __init__(self, config: dict[str, auto.ConfigValue], outputs: dict[str, auto.OutputValue]) -> None:
        self.config, self.outputs_ = config, outputs

    def outputs(self) -> dict[str, auto.OutputValue]:
        return self.outputs_

    def get_all_config(self) -> dict[str, auto.ConfigValue]:
        return self.config


def _config(raw: dict[str, Any], secret: set[str]) -> dict[str, auto.ConfigValue]:
    # As `pulumi config --json` gives it: objects as JSON text, a section holding a --secret --path value secret.
    return {
        f"{NAMESPACE}:{k}": auto.ConfigValue(json.dumps(v) if not isinstance(v, str) else v, k in secret)
        for k, v in raw.items()
    } | {"docker:host": auto.ConfigValue("unix:///var/run/docker.sock")}


@pytest.fixture
def selected(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {"stack": FakeStack(_config(two_sparks(), {"ssh"}), {})}

    def select_stack(name: str, work_dir: str | None = None, **kwargs: Any) -> Any:
        seen.update(name=name, work_dir=work_dir, kwargs=kwargs)
        stack = seen["stack"]
        if isinstance(stack, Exception):
            raise stack
        return stack

    monkeypatch.setattr(auto, "select_stack", select_stack)
    return seen


def test_a_stack_is_read_from_the_project_with_settings_validated_and_plain_outputs(selected: dict[str, Any]) -> None:
    selected["stack"] = FakeStack(
        _config(two_sparks(serve={"port": 9999}), {"ssh"}),
        {
            "endpoint": auto.OutputValue("http://10.0.0.1:9999/v1", False),
            "apiKey": auto.OutputValue(API_KEY, True),
            "supervisor": auto.OutputValue({"url": "http://x:1", "token": SUPERVISOR_TOKEN}, True),
        },
    )
    view = read_stack("dev")
    assert (selected["name"], selected["work_dir"]) == ("dev", str(REPO_ROOT))
    assert (REPO_ROOT / "Pulumi.yaml").is_file()
    assert view.name == "dev" and view.settings.serve.port == 9999
    assert [n.name for n in view.settings.nodes] == ["spark-head", "spark-worker"]
    assert view.outputs == {
        "endpoint": "http://10.0.0.1:9999/v1",
        "apiKey": API_KEY,
        "supervisor": {"url": "http://x:1", "token": SUPERVISOR_TOKEN},
    }
    assert view.stack_dir == str(ssh.stack_dir("dsv41-exl3", "dev"))
    assert stat.S_IMODE(Path(view.stack_dir).stat().st_mode) == 0o700


def test_a_key_stored_in_plain_text_is_refused_as_the_program_refuses_it(selected: dict[str, Any]) -> None:
    selected["stack"] = FakeStack(_config(two_sparks(), set()), {})
    with pytest.raises(OperatorError, match=r"`ssh.privateKey` is stored in plain text") as caught:
        read_stack("dev")
    assert "abc" not in str(caught.value)  # the key's text (two_sparks) is never echoed


def test_a_config_error_becomes_an_operator_error_with_its_message(selected: dict[str, Any]) -> None:
    selected["stack"] = FakeStack(_config(two_sparks(serve={"port": 0}), {"ssh"}), {})
    with pytest.raises(OperatorError, match=r"`serve.port` = 0: Input should be greater than or equal to 1"):
        read_stack("dev")


def test_a_cli_error_is_one_line_naming_the_stack(selected: dict[str, Any]) -> None:
    selected["stack"] = auto.errors.StackNotFoundError(
        CommandResult("", "warning: A new version of Pulumi is available\nerror: no stack named 'nope' found\n", 255)
    )
    with pytest.raises(OperatorError) as caught:
        read_stack("nope")
    assert str(caught.value) == "cannot read stack 'nope': error: no stack named 'nope' found"


def test_no_pulumi_cli_says_how_to_get_it(selected: dict[str, Any]) -> None:
    selected["stack"] = FileNotFoundError(2, "No such file or directory", "pulumi")
    with pytest.raises(OperatorError, match=r"cannot read stack 'dev': no `pulumi` on PATH.*make -s env"):
        read_stack("dev")


def test_nodes_by_name_or_by_the_launchers_aliases() -> None:
    view = stacks.view()
    assert node_or_error(view, "spark-worker").host == "10.0.0.2"
    assert node_or_error(view, "head").name == "spark-head"
    assert node_or_error(view, "worker").name == "spark-worker"
    with pytest.raises(OperatorError, match=r"no node 'spark-9': its nodes are spark-head, spark-worker"):
        node_or_error(view, "spark-9")


def test_a_node_named_like_an_alias_is_that_node() -> None:
    raw = two_sparks()
    raw["nodes"][1]["name"] = "head"
    view = stack_view.StackView(name="s", settings=parse(raw).settings, outputs={}, stack_dir="/nowhere")
    assert node_or_error(view, "head").host == "10.0.0.2"


def test_the_ssh_target_is_the_nodes_address_with_the_stacks_ssh_settings() -> None:
    view = stacks.view(ssh={"privateKey": SSH_KEY, "knownHostsFile": "/etc/ssh/d41_known", "agentSocket": "/a.sock"})
    target = ssh_target(view, "worker")
    assert (target.host, target.port, target.user) == ("10.0.0.2", 22, "me")
    assert target.private_key == SSH_KEY
    assert (target.known_hosts_file, target.agent_socket) == ("/etc/ssh/d41_known", "/a.sock")
    assert target.stack_dir == view.stack_dir
    assert SSH_KEY not in repr(target)


def test_the_container_comes_from_the_outputs_else_from_servings_naming() -> None:
    view = stacks.view(stacks.outputs(containers={"spark-head": "h"}))
    nodes = view.settings.nodes
    assert container_of(view, nodes[0]) == "h"
    assert container_of(view, nodes[1]) == "dsv41-exl3-opstest-spark-worker"


def test_the_secrets_a_view_holds_are_all_known() -> None:
    found = secrets_of(stacks.view())
    assert {SSH_KEY, API_KEY, SUPERVISOR_TOKEN} <= set(found)
