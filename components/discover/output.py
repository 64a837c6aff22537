"""Discovery's output: each node's block, the `nodes:` list to paste into the stack file, the JSON form, and the
escaping that keeps a node's text from reaching the terminal or the config raw."""

from __future__ import annotations

import json
import re
from typing import Any

from components.config import NAMESPACE, Weights
from components.discover.findings import NOT_DECIDED
from components.discover.report import NodeReport, Report

# --- output ------------------------------------------------------------------------------------------------------

_PLAIN = re.compile(r"^[A-Za-z0-9_/~][A-Za-z0-9_./~-]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def yaml_scalar(value: str) -> str:
    """A string as YAML reads it back unchanged: plain when it cannot be mistaken for anything else."""
    if _PLAIN.match(value) and value.lower() not in _YAML_WORDS and not _is_number(value):
        return value
    return json.dumps(value)


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def node_config(n: NodeReport) -> dict[str, Any]:
    """The node's `nodes[]` entry: decided values, NOT_DECIDED where a value is missing (the config refuses it)."""
    entry: dict[str, Any] = {"name": n.name, "host": n.spec.host}
    if n.spec.port != 22:
        entry["port"] = n.spec.port
    entry["user"] = n.spec.user
    f = n.fabric
    entry["fabricIp"] = f.ip
    entry["fabricInterface"] = f.interface
    entry["ibHcas"] = list(f.hcas) if f.hcas is not None else None
    entry["gidIndex"] = None if f.ip is None else "auto"
    undecided = {key for u in n.undecided for key in u.key.split(", ")}
    return {key: None if key in undecided else value for key, value in entry.items()}


def _yaml_entry(n: NodeReport) -> list[str]:
    entry = node_config(n)
    lines = []
    for i, (key, value) in enumerate(entry.items()):
        lead = "    - " if i == 0 else "      "
        if value is None:
            text = json.dumps(NOT_DECIDED)
        elif isinstance(value, list):
            text = "[" + ", ".join(yaml_scalar(v) for v in value) + "]"
        elif isinstance(value, int):
            text = str(value)
        else:
            text = yaml_scalar(value)
        if key == "gidIndex" and value == "auto" and n.fabric.gid_index is not None:
            text += f"  # index {n.fabric.gid_index} on this node now; resolved again at every up"
        lines.append(f"{lead}{key}: {text}")
    return lines


def yaml_block(report: Report) -> str:
    """The `nodes:` and `weights:` blocks as the template (Pulumi.dev.yaml) spells them, to paste under `config:`."""
    lines = [f"  {NAMESPACE}:nodes:"]
    for n in report.nodes:
        lines.extend(_yaml_entry(n))
    head = report.nodes[0] if report.nodes else None
    root = head.root.root if head is not None and head.root is not None else None
    lines += [
        f"  {NAMESPACE}:weights:",
        f"    root: {yaml_scalar(root) if root else json.dumps(NOT_DECIDED)}",
        f"    share: {Weights().share}",
    ]
    return "\n".join(lines)


def ssh_lines(report: Report) -> list[str]:
    """The stack's `ssh.*` keys for what this run used (the key's text is set from its file, never printed)."""
    out = []
    if report.identity:
        out.append(f"pulumi config set --secret --path ssh.privateKey < {report.identity}")
    if report.agent:
        out.append(f'pulumi config set --path ssh.agentSocket "{report.agent}"')
    if report.known_hosts:
        out.append(f"pulumi config set --path ssh.knownHostsFile {report.known_hosts}")
    return out


def _block(n: NodeReport) -> list[str]:
    lines = [f"# node {n.index + 1} ({n.role}): {n.spec.text}"]
    if n.reached.host_key:
        lines.append(f"#   host key: {n.reached.host_key}")
    if n.reached.error is not None:
        lines.append(f"#   not reached: {n.reached.error}")
        return lines
    everything = n.fabric.finding + n.finding
    lines += [f"#   {line}" for line in everything.found]
    lines += [f"#   warning: {line}" for line in everything.warnings]
    lines += [f"#   could not decide {u.line()}" for u in everything.undecided]
    return lines


def format_report(report: Report) -> str:
    lines: list[str] = []
    for n in report.nodes:
        lines += _block(n)
    lines.append("# paste under `config:` in Pulumi.<stack>.yaml (replacing the template's blocks):")
    lines.append(yaml_block(report))
    for line in ssh_lines(report):
        lines.append(f"# {line}")
    undecided = [(n, u) for n in report.nodes for u in n.undecided]
    lines.append("# could not decide:" + ("" if undecided else " nothing"))
    lines += [f"#   - {n.name} ({n.spec.text}) {u.line()}" for n, u in undecided]
    # A comment line carries what a node printed: one line each, with nothing the terminal would act on. The
    # YAML block's values are JSON-quoted already where they are not plain words.
    return "\n".join(terminal_safe(line) if line.startswith("#") else line for line in lines)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """`text` with every control character (escape sequences, newlines, carriage returns) shown as `\\xNN`."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def as_json(report: Report) -> dict[str, Any]:
    nodes = []
    for n in report.nodes:
        everything = n.fabric.finding + n.finding
        nodes.append(
            {
                "name": n.name,
                "role": n.role,
                "target": n.spec.text,
                "reached": n.reached.error is None,
                "error": n.reached.error,
                "hostKey": n.reached.host_key,
                "config": node_config(n),
                "gidIndexFound": n.fabric.gid_index,
                "weightsRoot": n.root.root if n.root else None,
                "createWeightsRoot": n.root.create if n.root else None,
                "found": list(everything.found),
                "warnings": list(everything.warnings),
                "couldNotDecide": [{"key": u.key, "reason": u.reason, "fix": u.fix or None} for u in n.undecided],
            }
        )
    return {
        "ok": report.ok,
        "nodes": nodes,
        "yaml": yaml_block(report),
        "ssh": ssh_lines(report),
        "couldNotDecide": [
            {"node": n.name, "key": u.key, "reason": u.reason, "fix": u.fix or None}
            for n in report.nodes
            for u in n.undecided
        ],
    }
