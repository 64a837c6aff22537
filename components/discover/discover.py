"""What each Spark can tell about its stack config lines, before the first `pulumi up` (issue #23, item 2):

    dsv41-exl3 discover [--json] [--identity FILE] [--known-hosts FILE] user@host[:port] ...

The first node is the head. Each node's host key is pinned first (components/host_keys.py: recorded on first
use, a changed one refused), then one ssh runs probe.sh (read only) and the decisions below read its report:
the fabric interface and address, the HCAs and the RoCE v2 GID index (by gid_check.sh's rule, which `gidIndex:
auto` applies again at every up), MemAvailable, the weights root on the head, docker access, the GPU, the NFS
server and sudo on the head, and containers left by a stack. It prints a block per node, a `nodes:` list to paste
into the stack file, and what it could not decide, each with its fix.

SSH: `--identity FILE` (the key the stack's `ssh.privateKey` will hold) and/or the agent at `$SSH_AUTH_SOCK`;
`--known-hosts FILE` is `ssh.knownHostsFile` (default `~/.ssh/known_hosts`). The key is never printed.

Exit 0: every node was reached and every line decided; 1: something could not be decided (or a node not
reached); 2: a usage error (a malformed argument, a key file that cannot be read).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from components import host_keys
from components.discover.findings import FORM, Pin, Run, parse_target
from components.discover.output import as_json, format_report, terminal_safe
from components.discover.report import Report, collect, run_ssh
from components.operator.exits import Exit
from components.operator.stack_view import OperatorError, OperatorParser
from components.ssh import SshTarget

# --- the command -------------------------------------------------------------------------------------------------


def _parser(prog: str) -> OperatorParser:
    parser = OperatorParser(
        prog=prog,
        allow_abbrev=False,
        description="Read only: each Spark's stack config lines (the first is the head), and what could not be "
        "decided, with the fix.",
    )
    parser.add_argument("targets", nargs="+", metavar=FORM, help="the nodes; the first is the head")
    parser.add_argument("--identity", metavar="FILE", help="private key file (else the agent at $SSH_AUTH_SOCK)")
    parser.add_argument("--known-hosts", metavar="FILE", help="the known_hosts file (default ~/.ssh/known_hosts)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the summary")
    return parser


def _read_identity(path: str) -> str:
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        raise OperatorError(f"--identity {path}: cannot read it ({why})") from None
    if "PRIVATE KEY-----" not in text:
        raise OperatorError(f"--identity {path} is not a private key file (a .pub?): give the private key's path")
    return text


def discover(
    target_args: Sequence[str],
    identity: str | None,
    known_hosts: str | None,
    run: Run = run_ssh,
    pin: Pin = host_keys.pin_all,
) -> Report:
    """Every node's report (the first is the head); a bad argument raises OperatorError before any connection."""
    specs = [parse_target(t) for t in target_args]
    seen: dict[tuple[str, int], str] = {}
    for arg, s in zip(target_args, specs, strict=True):
        if (s.host, s.port) in seen:
            raise OperatorError(f"{arg!r} names the same node as {seen[(s.host, s.port)]!r}: give each node once")
        seen[(s.host, s.port)] = arg
    key = _read_identity(identity) if identity else None
    agent = os.environ.get("SSH_AUTH_SOCK") or None
    known = str(Path(known_hosts).expanduser().absolute()) if known_hosts else None
    targets = [
        SshTarget(host=s.host, port=s.port, user=s.user, private_key=key, agent_socket=agent, known_hosts_file=known)
        for s in specs
    ]
    path = str(Path(identity).expanduser()) if identity else None
    return Report(collect(specs, targets, run=run, pin=pin), identity=path, agent=agent, known_hosts=known)


def unreached_lines(report: Report) -> list[str]:
    return [
        f"error: node {n.index + 1} ({n.role}) {n.spec.text}: {n.reached.error}"
        for n in report.nodes
        if n.reached.error is not None
    ]


def main(
    argv: Sequence[str] | None = None,
    run: Run = run_ssh,
    pin: Pin = host_keys.pin_all,
    prog: str = "dsv41-exl3 discover",
) -> int:
    try:
        options = _parser(prog).parse_args(argv)
        report = discover(options.targets, options.identity, options.known_hosts, run=run, pin=pin)
    except OperatorError as error:
        print(f"error: {error}", file=sys.stderr)
        return Exit.USAGE
    for line in unreached_lines(report):
        print(terminal_safe(line), file=sys.stderr)
    print(json.dumps(as_json(report), indent=1) if options.json else format_report(report))
    return Exit.OK if report.ok else Exit.FAILED
