"""`dsv41-exl3 VERB ...`: the operator's one command (also `python -m components VERB ...`).

Each verb is a module of its own with a `main(argv, prog=...)`; this file only names them and dispatches, so a
verb's flags are declared once, in its module. Verbs import lazily: `dsv41-exl3 logs` does not load the verifier.
Every verb that reads a stack takes `--stack NAME` and defaults to the selected stack (`pulumi stack select`),
through the one reader in stack_view.py. Exit codes are the same for every verb (exits.py).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from components.operator.exits import Exit, table

PROG = "dsv41-exl3"


@dataclass(frozen=True)
class Verb:
    module: str
    summary: str
    usage: str

    def main(self) -> Callable[..., int]:
        found: Callable[..., int] = importlib.import_module(self.module).main
        return found


VERBS: dict[str, Verb] = {
    "status": Verb(
        "components.operator.status",
        "the endpoint, every rank, memory, the watchdog, vLLM's load and the supervisor",
        "[--stack NAME] [--json] [--interval SECONDS]",
    ),
    "logs": Verb(
        "components.operator.logs", "one rank's docker logs", "[--stack NAME] NODE [-f] [--since D] [--tail N]"
    ),
    "verify": Verb(
        "components.operator.verify",
        "the recipe's logprobs request against the endpoint, in one line",
        "[--stack NAME | --endpoint URL --model NAME] [--json]",
    ),
    "rollback": Verb(
        "components.operator.rollback",
        "restore the last verified config and run up",
        "[--stack NAME] [--to VERSION] [--yes] | --list [--json]",
    ),
    "supervisor": Verb(
        "components.operator.supervisor",
        "ask the supervisor: status, pause, resume",
        "status|pause|resume [--stack NAME] [--json]",
    ),
    "doctor": Verb(
        "components.operator.doctor",
        "read only, before the first up: each node's preflight checks, the image for its platform, the hub",
        "[--stack NAME] [--json]",
    ),
    "report": Verb(
        "components.operator.report",
        "one .tar.gz to attach to an issue: config (secrets masked), versions, history, records, rank logs",
        "[--stack NAME] [--out FILE] [--json]",
    ),
    "discover": Verb(
        "components.discover.discover",
        "read each Spark's config lines before the first up",
        "[--json] [--identity FILE] [--known-hosts FILE] USER@HOST[:PORT] ...",
    ),
}


def usage() -> str:
    width = max(len(name) for name in VERBS)
    lines = [f"usage: {PROG} VERB [flags]   ({PROG} VERB --help for a verb's flags)", "", "verbs:"]
    for name, verb in VERBS.items():
        lines.append(f"  {name:<{width}}  {verb.summary}")
        lines.append(f"  {'':<{width}}    {PROG} {name} {verb.usage}")
    lines += ["", "--stack defaults to the selected stack (`pulumi stack select NAME`).", table()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return Exit.OK if args else Exit.USAGE
    verb = VERBS.get(args[0])
    if verb is None:
        print(f"error: {PROG} has no verb {args[0]!r}: one of {', '.join(VERBS)} (see --help)", file=sys.stderr)
        return Exit.USAGE
    return int(verb.main()(args[1:], prog=f"{PROG} {args[0]}"))


def moved(old: str, verb: str) -> int:
    """An old module path (`python -m components.status`) for one release: say what replaced it, then run it."""
    print(f"note: `python -m {old}` is now `{PROG} {verb}`; the old path goes in the next release", file=sys.stderr)
    return main([verb, *sys.argv[1:]])
