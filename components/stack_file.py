"""A user's own stack file, written from the committed template (`make stack STACK=name`).

    python -m components.stack_file --stack NAME [--force] [--hosts USER@HOST[:PORT] ... [--identity FILE]
                                                             [--known-hosts FILE]]

`Pulumi.dev.yaml` is the committed template (the recipe's defaults, `<placeholders>` where the user decides);
`Pulumi.<name>.yaml` is the user's, git-ignored, so filling in hosts never conflicts with a `git pull`. The
template itself is never filled in: `dev` is refused as a name. Given `--hosts` (the first is the head), the
nodes are discovered first (`dsv41-exl3 discover`, read only) and the template's `nodes:` and
`weights:` blocks are replaced by what discovery found; what it could not decide stays a loud placeholder
(`<not decided: see below>`, refused by the first preview) and is listed with its fix. An unreachable host
writes nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = "Pulumi.dev.yaml"
TEMPLATE_STACK = "dev"
# Pulumi's own rule for a stack name; also keeps the file name a plain one.
STACK_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


class StackFileError(Exception):
    """A refusal, with the fix in its message."""


def render(template: str, stack: str) -> str:
    """The template with its commands addressed to `stack`."""
    header = f"# Stack `{stack}`, written by `make stack STACK={stack}` from {TEMPLATE}: yours, git-ignored.\n"
    return header + template.replace(f"--stack {TEMPLATE_STACK}", f"--stack {stack}")


def _blocks_removed(template: str, keys: Sequence[str]) -> tuple[list[str], int]:
    """The template's lines without the top-level `  ns:key:` blocks named, and where the first one was."""
    out: list[str] = []
    at, skipping = -1, False
    for line in template.splitlines():
        top = line.startswith("  ") and not line.startswith("   ") and line.strip().endswith(":")
        if top or not line.startswith("    "):
            skipping = top and line.strip().rstrip(":") in keys
            if skipping and at < 0:
                at = len(out)
        if not skipping:
            out.append(line)
    return out, at if at >= 0 else len(out)


def with_discovered(template: str, discovered: str, ssh: Mapping[str, str]) -> str:
    """The template with its nodes and weights blocks replaced by discovery's, plus the ssh leaves it used."""
    from components.config import NAMESPACE

    lines, at = _blocks_removed(template, [f"{NAMESPACE}:nodes", f"{NAMESPACE}:weights", f"{NAMESPACE}:ssh"])
    block = discovered.splitlines()
    if ssh:
        block += [f"  {NAMESPACE}:ssh:", *(f"    {k}: {json.dumps(v)}" for k, v in sorted(ssh.items()))]
    return "\n".join(lines[:at] + block + lines[at:]) + "\n"


def discovered_text(
    hosts: Sequence[str], identity: str | None, known_hosts: str | None, repo: Path = REPO, **seams: Any
) -> str:
    """Discover `hosts` and return the stack file's text; StackFileError when a host cannot be reached.
    `seams`: discover's `run` and `pin` (tests)."""
    from components.discover import discover as found
    from components.discover.output import format_report, yaml_block
    from components.operator.stack_view import OperatorError

    try:
        report = found.discover(hosts, identity, known_hosts, **seams)
    except OperatorError as err:
        raise StackFileError(str(err)) from None
    unreached = found.unreached_lines(report)
    if unreached:
        raise StackFileError(
            "; ".join(unreached) + ". Nothing was written: fix the host (or drop it from HOSTS) and run it again"
        )
    for line in format_report(report).splitlines():
        if line.startswith("#"):
            print(line, file=sys.stderr)
    ssh = {}
    if report.known_hosts:
        ssh["knownHostsFile"] = report.known_hosts
    if report.agent and not report.identity:
        ssh["agentSocket"] = report.agent
    return with_discovered((repo / TEMPLATE).read_text(), yaml_block(report), ssh)


def stack_path(stack: str, repo: Path = REPO) -> Path:
    if not STACK_NAME.match(stack):
        raise StackFileError(
            f"STACK={stack!r} is not a stack name: use letters, digits, '-', '_' or '.', e.g. STACK=sparks"
        )
    if stack == TEMPLATE_STACK:
        raise StackFileError(
            f"STACK={stack!r} is the committed template ({TEMPLATE}): a filled-in copy would be tracked by git. "
            "Choose another name, e.g. STACK=sparks"
        )
    return repo / f"Pulumi.{stack}.yaml"


def write(stack: str, repo: Path = REPO, *, force: bool = False, template: str | None = None) -> Path:
    """Write Pulumi.<stack>.yaml from the template (or `template`, the template filled by discovery); an existing
    file is kept unless `force`."""
    path = stack_path(stack, repo)
    if path.exists() and not force:
        raise StackFileError(f"{path.name} exists: edit it, or pass FORCE=1 to rewrite it from {TEMPLATE}")
    path.write_text(render(template if template is not None else (repo / TEMPLATE).read_text(), stack))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m components.stack_file", description=__doc__.split("\n")[0])
    parser.add_argument("--stack", required=True, metavar="NAME")
    parser.add_argument("--force", action="store_true", help="rewrite an existing stack file from the template")
    parser.add_argument("--hosts", nargs="+", metavar="USER@HOST[:PORT]", help="discover these nodes (head first)")
    parser.add_argument("--identity", metavar="FILE", help="discovery's private key file (else the ssh agent)")
    parser.add_argument("--known-hosts", metavar="FILE", help="discovery's known_hosts (default ~/.ssh/known_hosts)")
    args = parser.parse_args(argv)
    try:
        stack_path(args.stack)  # a bad name is refused before any connection
        template = discovered_text(args.hosts, args.identity, args.known_hosts) if args.hosts else None
        path = write(args.stack, force=args.force, template=template)
    except StackFileError as err:
        print(f"make stack: {err}", file=sys.stderr)
        return 2
    left = sum("<" in line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    print(
        f"wrote {path.name}"
        + (f" from discovery of {len(args.hosts)} node(s)" if args.hosts else "")
        + (f": fill in the {left} <...> value(s) left" if left else ": every value filled in")
        + f", then `pulumi preview --stack {args.stack}`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
