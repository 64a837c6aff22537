"""`dsv41-exl3 supervisor`: the operator's view of the supervisor, from any machine that reaches the head:

    dsv41-exl3 supervisor status [--stack NAME] [--json]
    dsv41-exl3 supervisor pause [--stack NAME]      # no action until resume (survives a reboot)
    dsv41-exl3 supervisor resume [--stack NAME]     # also clears a give-up once the cause is fixed

The leading agent's address and token come from the stack's `supervisor` output (components/operator/stack_view,
read only).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import requests

from components.operator.exits import Exit
from components.operator.stack_view import OperatorError, OperatorParser, read_stack
from components.supervisor import policy


class UsageError(Exception):
    pass


def read_supervisor(stack_name: str | None) -> tuple[str, str]:
    """(url, token) from the stack's `supervisor` output."""
    view = read_stack(stack_name)
    data = view.outputs.get("supervisor")
    if not isinstance(data, dict) or not data.get("url") or not data.get("token"):
        raise UsageError(f"stack {view.name!r} has no supervisor (supervisor.enabled false, or no verified up yet)")
    return str(data["url"]), str(data["token"])


def _ago(at: float | None, now: float) -> str:
    return "never" if not at else f"{now - float(at):.0f} s ago"


def format_status(status: dict[str, Any]) -> str:
    now = float(status.get("now") or time.time())
    lines = [f"supervisor on {status.get('node')}: {status.get('doing', 'starting')}"]
    if status.get("paused"):
        lines.append("paused: yes (dsv41-exl3 supervisor resume)")
    if status.get("lock_holder"):
        lines.append(f"update lock: {status['lock_holder']}")
    if status.get("given_up"):
        lines.append(f"gave up: {status['given_up']}")
    if status.get("state_error"):
        lines.append(f"state: {status['state_error']} (paused until resume)")
    if gap := policy.not_armed(status):
        lines.append(gap)
    probe = status.get("last_probe") or {}
    lines.append(f"last probe: {probe.get('state', '-')} {_ago(probe.get('at'), now)}: {probe.get('seen', '')}")
    verified = status.get("last_verified") or {}
    lines.append(
        f"last verified: {_ago(verified.get('at'), now)}, generation {verified.get('generation', '-')}, "
        f"logprobs {json.dumps(verified.get('logprobs', []), ensure_ascii=False)}"
    )
    restarts = status.get("restarts") or []
    lines.append(f"restarts: {len(restarts)}")
    for r in restarts[-5:]:
        lines.append(
            f"  {_ago(r.get('at'), now)}: {r.get('cause')} -> {r.get('result')}"
            + (f" in {r['seconds']} s" if r.get("seconds") is not None else "")
        )
    return "\n".join(lines)


def _parser(prog: str) -> OperatorParser:
    parser = OperatorParser(prog=prog, allow_abbrev=False, description="Ask the leading supervisor agent.")
    parser.add_argument("action", choices=("status", "pause", "resume"))
    parser.add_argument("--stack", metavar="NAME", help="default: the selected stack")
    parser.add_argument("--json", action="store_true", help="the agent's answer as one JSON object")
    return parser


def main(
    argv: Sequence[str] | None = None,
    read: Callable[[str | None], tuple[str, str]] = read_supervisor,
    session: requests.Session | None = None,
    prog: str = "dsv41-exl3 supervisor",
) -> int:
    http = session or requests.Session()
    try:
        options = _parser(prog).parse_args(argv)
        url, token = read(options.stack)
    except (UsageError, OperatorError) as error:
        print(f"error: {error}", file=sys.stderr)
        return Exit.USAGE
    headers = {"Authorization": f"Bearer {token}"}
    try:
        if options.action == "status":
            reply = http.get(f"{url}/status", headers=headers, timeout=10)
        else:
            reply = http.post(f"{url}/{options.action}", headers=headers, json={}, timeout=10)
    except requests.RequestException as error:
        print(
            f"error: the supervisor at {url} does not answer ({type(error).__name__}); is the head up? "
            f"`docker ps` on it should show the supervisor container",
            file=sys.stderr,
        )
        return Exit.FAILED
    if reply.status_code != 200:
        print(f"error: the supervisor at {url} answered HTTP {reply.status_code}", file=sys.stderr)
        return Exit.FAILED
    data = reply.json()
    if options.json:
        print(json.dumps(data, indent=1, sort_keys=True))
    elif options.action != "status":
        print(f"supervisor of {options.stack or 'the selected stack'}: {'paused' if data.get('paused') else 'resumed'}")
    else:
        print(format_status(data))
    return Exit.OK
