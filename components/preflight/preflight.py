"""Preflight: one node is fit to take this stack's serving container, checked on the node itself.

Two phases per node, each one remote.Command running components/preflight/preflight.sh (rendered by spec.py)
over SSH, both when `rerun_on` changes (exactly when the node's container is created or replaced):
- `PreflightCheck`, the check phase: every check, with this stack's old containers left serving. It waits for
  nothing but the node's SSH, so a refusal fails the update in seconds.
- `Preflight`, the stop phase: after `stop_after` (every node's check phase and every node's image pull), it
  stops the old containers, checks MemAvailable, and reports the RoCE v2 GID index the container's NCCL env
  must use. So the old ranks serve until every node holds the new image and has nothing to object to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pulumi
from pulumi_command import remote

from components.preflight.spec import (
    PreflightResult,
    PreflightSpec,
    format_report,
    parse_output,
    render_command,
)
from components.scripts import sh_command

# Headroom over the script's own `timeout` for dialing SSH and collecting the output.
_DIAL_MARGIN_S = 60


@dataclass(frozen=True, kw_only=True)
class PreflightArgs:
    spec: PreflightSpec
    """What the script checks on this node; validated when it is built."""
    connection: pulumi.Input[remote.ConnectionArgs]
    """Built by the caller; the provider keeps the whole connection secret."""
    rerun_on: list[pulumi.Input[str]]
    """The only inputs that re-run the check (remote.Command replaces on triggers alone)."""
    stop_after: Sequence[pulumi.Resource] = ()
    """The stop phase only: what must be done on every node before this node's old containers stop."""


# The components each phase had until issue 36; their commands keep aliases to them (components/wiring.py).
CHECK_COMPONENT = "dsv41-exl3:preflight:PreflightCheck"
STOP_COMPONENT = "dsv41-exl3:preflight:Preflight"


def _check_command(
    name: str,
    spec: PreflightSpec,
    args: PreflightArgs,
    opts: pulumi.ResourceOptions | None,
    after: Sequence[pulumi.Resource],
) -> remote.Command:
    command = render_command(spec)  # holds no secret: the key travels only inside `connection`
    timeout = f"{spec.command_timeout_s + _DIAL_MARGIN_S}s"
    return remote.Command(
        name,
        connection=args.connection,
        create=command,
        # Any other input change (e.g. a new script after a program upgrade) runs `update`:
        # the same idempotent check.
        update=command,
        delete=sh_command("true"),  # nothing to undo on the node
        triggers=args.rerun_on,
        add_previous_output_in_env=False,
        opts=pulumi.ResourceOptions.merge(
            opts,
            pulumi.ResourceOptions(
                depends_on=list(after),
                custom_timeouts=pulumi.CustomTimeouts(create=timeout, update=timeout),
            ),
        ),
    )


class PreflightCheck:
    """The check phase on one node: every check; this stack's old containers keep serving. One command named
    `<name>-check`; `opts` places it (no component of its own: it would only add a registration per node)."""

    command: remote.Command
    report: pulumi.Output[str]
    """One human line: what was measured and decided on the node."""

    def __init__(self, name: str, args: PreflightArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        spec = replace(args.spec, stop=False)
        self.command = _check_command(f"{name}-check", spec, args, opts, ())
        self.report = self.command.stdout.apply(lambda out: format_report(parse_output(out, spec), spec))


class Preflight:
    """The stop phase on one node: one command named `<name>-check`, after `args.stop_after`."""

    command: remote.Command
    """What the next phases wait for: the node passed its stop phase."""
    gid_index: pulumi.Output[int | None]
    """RoCE v2 GID index resolved or checked on the node; None when check_rdma is False."""
    mem_available_gib: pulumi.Output[float]
    """MemAvailable measured on the node after this stack's own containers were stopped."""
    report: pulumi.Output[str]
    """One human line: what was measured and decided on the node."""

    def __init__(self, name: str, args: PreflightArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        spec = replace(args.spec, stop=True)
        self.command = _check_command(f"{name}-check", spec, args, opts, args.stop_after)

        # Refusals happen on the node (the command fails); this only reads what the node reported.
        def parse(stdout: str) -> PreflightResult:
            return parse_output(stdout, spec)

        result = self.command.stdout.apply(parse)
        self.gid_index = result.apply(lambda r: r.gid_index)
        self.mem_available_gib = result.apply(lambda r: r.mem_available_gib)
        self.report = result.apply(lambda r: format_report(r, spec))
