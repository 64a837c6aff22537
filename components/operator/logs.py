"""A rank's docker logs, streamed to this terminal, read only:

    dsv41-exl3 logs [--stack NAME] NODE [--follow] [--since DURATION] [--tail N]

NODE is the node's name in the stack config (`spark-head`), or `head` / `worker` for the first / second node
(as the upstream launcher's `logs worker`). The logs come over the stack's own ssh options (key, known_hosts,
multiplexing: components/ssh.py) and carry docker's timestamps. The exit code is the remote `docker logs`'s
(255: ssh failed); 2 is a usage error.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence

from components.operator.exits import Exit
from components.operator.stack_view import (
    OperatorError,
    OperatorParser,
    StackView,
    container_of,
    node_or_error,
    read_stack,
    ssh_target,
)
from components.ssh import ssh_argv

# What `docker logs --since` takes: a relative duration (`10m`) or an absolute RFC3339 time.
_DURATION = re.compile(r"^\d+(s|m|h)$")
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")

Exec = Callable[[list[str]], int]
"""Run argv with this process's stdin, stdout and stderr (streamed, not captured); its exit code."""


def check_since(value: str) -> str:
    if _DURATION.match(value) or _RFC3339.match(value):
        return value
    raise OperatorError(
        f"--since {value!r} is not a docker duration: give a number with s, m or h (e.g. 30s, 10m, 2h) or an "
        "RFC3339 time (e.g. 2025-01-31T12:00:00Z)"
    )


def check_tail(value: str) -> str:
    if value == "all" or re.fullmatch(r"\d+", value):
        return value
    raise OperatorError(f"--tail {value!r} is not a line count: give a number of lines (e.g. 200) or `all`")


def docker_logs_script(container: str, *, follow: bool, since: str | None, tail: str | None) -> str:
    """The one command run on the node; every value quoted, though each is already checked."""
    words = ["docker", "logs"]
    if follow:
        words.append("--follow")
    if since is not None:
        words += ["--since", check_since(since)]
    if tail is not None:
        words += ["--tail", check_tail(tail)]
    words += ["--timestamps", container]
    return " ".join(shlex.quote(w) for w in words)


def _parser(prog: str) -> OperatorParser:
    parser = OperatorParser(
        prog=prog,
        allow_abbrev=False,
        description="Stream one rank's docker logs (with timestamps) from its node.",
    )
    parser.add_argument("--stack", metavar="NAME", help="default: the selected stack")
    parser.add_argument("node", metavar="NODE", help="a node's config name, or `head` / `worker`")
    parser.add_argument("-f", "--follow", action="store_true", help="keep streaming new lines (Ctrl-C stops)")
    parser.add_argument("--since", metavar="DURATION", help="e.g. 10m, 2h, or 2025-01-31T12:00:00Z")
    parser.add_argument("--tail", metavar="N", help="the last N lines, or `all`")
    return parser


def main(
    argv: Sequence[str] | None = None,
    read: Callable[[str | None], StackView] = read_stack,
    exec_: Exec = subprocess.call,
    prog: str = "dsv41-exl3 logs",
) -> int:
    try:
        options = _parser(prog).parse_args(argv)
        # The flags first: a typo is refused before the stack is read.
        if options.since is not None:
            check_since(options.since)
        if options.tail is not None:
            check_tail(options.tail)
        view = read(options.stack)
        node = node_or_error(view, options.node)
        script = docker_logs_script(
            container_of(view, node), follow=options.follow, since=options.since, tail=options.tail
        )
        argv_ssh = ssh_argv(ssh_target(view, node.name), script)
    except OperatorError as error:
        print(f"error: {error}", file=sys.stderr)
        return Exit.USAGE
    try:
        return exec_(argv_ssh)
    except FileNotFoundError:
        print("error: no `ssh` on PATH: install the OpenSSH client", file=sys.stderr)
        return Exit.FAILED
    except KeyboardInterrupt:  # Ctrl-C ends --follow; ssh got the signal too
        return Exit.INTERRUPTED
