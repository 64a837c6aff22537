"""The one stack reader of every operator verb: validated settings and plain outputs, read only.

`open_stack` selects a stack of this project through the Automation API (the selected one when no name is
given, as `pulumi` itself does); `read_stack` reads its outputs (`pulumi stack output --show-secrets`) and its
config (`pulumi config --json`), validated as the program validates it. Nothing is written to the stack. Every
failure is one `OperatorError` line for the operator, never a traceback.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from components import labels
from components import ssh as ssh_files
from components.access.node_access import ssh_target as node_target
from components.config import NAMESPACE, OPEN_ENDPOINT, ConfigError, Node, Settings, parse, read_raw
from components.ssh import SshTarget

# The Pulumi project (Pulumi.yaml `name`) is also the config namespace.
PROJECT = NAMESPACE
REPO_ROOT = Path(__file__).resolve().parents[2]
# What the upstream launcher calls its two nodes (`logs worker`): the first and the second of `nodes`.
ALIASES = {"head": 0, "worker": 1}


class OperatorError(Exception):
    """A problem the operator fixes (unknown stack or node, bad config, bad argument): one line, exit 2."""


class OperatorParser(argparse.ArgumentParser):
    """argparse that raises OperatorError instead of printing the whole usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        raise OperatorError(f"{message} (see --help)")


@dataclass(frozen=True)
class StackView:
    """What the commands read from one stack: its validated settings and its outputs as plain values."""

    name: str
    settings: Settings
    outputs: dict[str, Any]
    stack_dir: str
    """The stack's private SSH directory (components/ssh.py `stack_dir`): the key file and control sockets."""


def _first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = next((line for line in lines if "error:" in line), lines[0] if lines else "no message")
    return first.removeprefix("stderr: ")  # CommandError's text labels the CLI's streams


def _cli_error(name: str, error: Exception) -> OperatorError:
    return OperatorError(f"cannot read stack {name!r}: {_first_error_line(str(error))}")


def _no_cli(name: str) -> OperatorError:
    return OperatorError(
        f"cannot read stack {name!r}: no `pulumi` on PATH; run where the project's environment is set "
        '(`eval "$(make -s env)"`)'
    )


def selected_stack(root: Path = REPO_ROOT) -> str:
    """The stack `pulumi stack select` chose for this project: every verb's stack when `--stack` is not given."""
    from pulumi import automation as auto

    try:
        summary = auto.LocalWorkspace(work_dir=str(root)).stack()
    except auto.errors.CommandError as error:
        raise _cli_error("(selected)", error) from None
    except FileNotFoundError:
        raise _no_cli("(selected)") from None
    if summary is None:
        raise OperatorError("no stack is selected: give --stack NAME, or run `pulumi stack select NAME` once")
    return str(summary.name)


def open_stack(name: str | None) -> Any:
    """The `pulumi.automation.Stack` called `name` (None: the selected one), read and written only by the caller."""
    from pulumi import automation as auto

    name = name or selected_stack()
    try:
        return auto.select_stack(name, work_dir=str(REPO_ROOT))
    except auto.errors.CommandError as error:
        raise _cli_error(name, error) from None
    except FileNotFoundError:
        raise _no_cli(name) from None


def read_stack(name: str | None) -> StackView:
    """The stack's outputs (secrets shown: the commands need the key and token) and its config, validated."""
    from pulumi import automation as auto

    name = name or selected_stack()
    stack = open_stack(name)
    try:
        outputs = stack.outputs()
        config = stack.get_all_config()
    except auto.errors.CommandError as error:
        raise _cli_error(name, error) from None
    except FileNotFoundError:
        raise _no_cli(name) from None
    raw = read_raw({key: value.value for key, value in config.items()})
    # As components/config `from_stack`: a credential under a key stored in plain text is refused.
    secret = frozenset(k for k in raw if config[f"{NAMESPACE}:{k}"].secret)
    try:
        loaded = parse(raw, plaintext_keys=frozenset(raw) - secret, secret_keys=secret)
    except ConfigError as error:
        raise OperatorError(str(error)) from None
    return StackView(
        name=name,
        settings=loaded.settings,
        outputs={key: value.value for key, value in outputs.items()},
        stack_dir=str(ssh_files.stack_dir(PROJECT, name)),
    )


def api_key_of(view: StackView) -> str | None:
    """The key clients send: the `apiKey` output (generated, or the configured one), None for an open endpoint."""
    configured = view.settings.serve.api_key
    if configured is not None and configured.get_secret_value() == OPEN_ENDPOINT:
        return None
    key = view.outputs.get("apiKey") or (configured.get_secret_value() if configured else None)
    return str(key) if key else None


def node_or_error(view: StackView, name: str) -> Node:
    """The node called `name`, or `head`/`worker` for the first/second; otherwise an error listing them."""
    nodes = view.settings.nodes
    for node in nodes:
        if node.name == name:
            return node
    if name in ALIASES and ALIASES[name] < len(nodes):
        return nodes[ALIASES[name]]
    known = ", ".join(n.name for n in nodes)
    aliases = ", ".join(a for a, i in ALIASES.items() if i < len(nodes))
    raise OperatorError(f"stack {view.name!r} has no node {name!r}: its nodes are {known} (or {aliases})")


def container_of(view: StackView, node: Node) -> str:
    """The node's rank container: the `containers` output, else the name serving gives it (components/labels)."""
    containers = view.outputs.get("containers")
    if isinstance(containers, dict) and isinstance(containers.get(node.name), str):
        return str(containers[node.name])
    return labels.container_name(view.name, node.name)


def ssh_target(view: StackView, node_name: str) -> SshTarget:
    """How to reach the node: the same options and key directory as the program's docker providers."""
    return node_target(node_or_error(view, node_name), view.settings.ssh, view.stack_dir)


def secrets_of(view: StackView) -> list[str]:
    """Every credential the view holds, so a command can make sure none reaches its output."""
    s = view.settings
    found = [x.get_secret_value() for x in (s.ssh.private_key, s.serve.api_key, s.weights.hf_token) if x]
    supervisor = view.outputs.get("supervisor")
    if isinstance(supervisor, dict) and supervisor.get("token"):
        found.append(str(supervisor["token"]))
    if view.outputs.get("apiKey"):
        found.append(str(view.outputs["apiKey"]))
    return [x for x in found if x and x != OPEN_ENDPOINT]
