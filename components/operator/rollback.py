"""`dsv41-exl3 rollback`: go back to the last verified deployment:

    dsv41-exl3 rollback [--stack NAME] [--to VERSION] [--yes]
    dsv41-exl3 rollback [--stack NAME] --list [--json]

Reads the stack's history (Automation API), picks the newest update that succeeded (so was verified) or the
one `--to` names, shows which config leaves change (secrets as `(secret, changed)`), and after a yes (typed,
or `--yes`) saves the stack file as it is, restores that update's config and runs `up`, streaming its output.
Exit codes (components/operator/exits.py): 0 rolled back, 1 the `up` failed (the restored config stays; the saved
file brings back the one before), 2 refused (nothing changed).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import yaml

from components.operator.exits import Exit
from components.operator.stack_view import REPO_ROOT, OperatorError, OperatorParser, open_stack, selected_stack
from components.rollback.history import (
    RollbackError,
    Update,
    Value,
    changes,
    choose,
    leaves,
    verified_updates,
)


class Stack(Protocol):
    """The part of `pulumi.automation.Stack` this command uses."""

    def history(self, page_size: int | None = None, page: int | None = None, show_secrets: bool = True) -> Any: ...
    def get_all_config(self) -> Any: ...
    def remove_all_config(self, keys: list[str], path: bool = False) -> None: ...
    def set_all_config(self, config: Any, path: bool = False) -> None: ...
    def up(self, **kwargs: Any) -> Any: ...


def history_of(stack: Stack) -> list[Update]:
    """The stack's history, each update numbered. A self-managed backend (a file or bucket) reports version 0 for
    every update; then they are numbered from the oldest, 1, as the Pulumi Cloud backend numbers them."""
    summaries = list(reversed(list(stack.history(show_secrets=True))))  # the CLI lists the newest first
    given = [s.version for s in summaries]
    real = all(isinstance(v, int) and v > 0 for v in given) and len(set(given)) == len(given)
    return [
        Update(
            version=int(summary.version) if real else number,
            kind=str(summary.kind),
            result=str(summary.result),
            started=summary.start_time if isinstance(summary.start_time, datetime) else datetime.now(),
            message=str(summary.message or ""),
            config={k: Value(str(v.value), bool(v.secret)) for k, v in summary.config.items()},
        )
        for number, summary in enumerate(summaries, 1)
    ]


def stack_file(name: str, root: Path = REPO_ROOT) -> Path:
    """The stack's settings file (`Pulumi.<name>.yaml`; an `org/name` stack keeps only the name)."""
    return root / f"Pulumi.{name.rsplit('/', 1)[-1]}.yaml"


def secure_now(path: Path) -> frozenset[str]:
    """The leaves encrypted in the stack file today, so restoring keeps them encrypted."""
    from components.config.paths import secure_leaves

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return frozenset()
    config = data.get("config") if isinstance(data, dict) else None
    return secure_leaves(config) if isinstance(config, dict) else frozenset()


def backup_dir() -> Path:
    """Where the stack file is saved before a rollback changes it: the project's state home (toolchain/env.sh)."""
    home = os.environ.get("DSV41_STATE_HOME") or str(
        Path(os.environ.get("XDG_STATE_HOME") or Path("~/.local/state").expanduser()) / "dsv41-exl3"
    )
    return Path(home) / "rollback"


def save_copy(path: Path, where: Path) -> Path:
    """A private copy of the stack file (it holds ciphertexts and the node list) named by the time."""
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    copy = where / f"{path.name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    # Private from its first byte: created 0600 (never copied then narrowed), and never over an existing file.
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(path.read_bytes())
    return copy


def restore_config(stack: Stack, target: dict[str, Value], path: Path, saved: Path) -> None:
    """Replace the stack's whole config with `target`'s leaves; on any failure the saved file goes back."""
    from pulumi import automation as auto

    try:
        current = list(stack.get_all_config())
        if current:
            stack.remove_all_config(current)
        stack.set_all_config({k: auto.ConfigValue(v.text, secret=v.secret) for k, v in target.items()}, path=True)
    except Exception:
        shutil.copyfile(saved, path)
        raise


def describe(update: Update) -> str:
    when = update.started.strftime("%Y-%m-%d %H:%M:%S")
    message = f" {update.message!r}" if update.message else ""
    return f"version {update.version} ({update.kind} {update.result}, started {when}{message})"


def list_history(updates: Sequence[Update], out: Callable[[str], None], as_json: bool = False) -> None:
    verified = {u.version for u in verified_updates(updates)}
    newest_first = sorted(updates, key=lambda u: u.version, reverse=True)
    if as_json:
        rows = [
            {
                "version": u.version,
                "kind": u.kind,
                "result": u.result,
                "started": u.started.isoformat(),
                "message": u.message,
                "verified": u.version in verified,
            }
            for u in newest_first
        ]
        out(json.dumps(rows, indent=1))
        return
    for update in newest_first:
        mark = "verified" if update.version in verified else "        "
        out(f"{mark}  {describe(update)}")


def _parser(prog: str) -> OperatorParser:
    parser = OperatorParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", help="the stack to roll back (default: the selected one)")
    parser.add_argument("--to", type=int, help="the version to restore (`--list` shows the verified ones)")
    parser.add_argument("--yes", action="store_true", help="do not ask before changing the config and running up")
    parser.add_argument("--list", action="store_true", help="list the stack's history, verified versions marked")
    parser.add_argument("--json", action="store_true", help="with --list: the history as a JSON list")
    return parser


def confirmed(ask: Callable[[str], str], interactive: bool) -> bool:
    if not interactive:
        raise OperatorError("not a terminal, so nobody can confirm: add --yes to roll back (or --list to look)")
    return ask("Restore this config and run `pulumi up`? Type yes: ").strip().lower() == "yes"


def main(
    argv: Sequence[str] | None = None,
    open_: Callable[[str], Stack] = open_stack,
    ask: Callable[[str], str] = input,
    interactive: Callable[[], bool] = sys.stdin.isatty,
    root: Path = REPO_ROOT,
    selected: Callable[[], str] = selected_stack,
    prog: str = "dsv41-exl3 rollback",
) -> int:
    try:
        options = _parser(prog).parse_args(argv)
        if options.json and not options.list:
            raise OperatorError("--json goes with --list (a rollback itself streams the up's output)")
        name = options.stack or selected()
        stack = open_(name)
        updates = history_of(stack)
        if options.list:
            list_history(updates, print, as_json=options.json)
            return Exit.OK
        target = choose(updates, name, options.to)
        path = stack_file(name, root)
        secure = secure_now(path)
        current = leaves({k: Value(str(v.value), bool(v.secret)) for k, v in stack.get_all_config().items()}, secure)
        restored = leaves(target.config, secure, plain_now={k: v.text for k, v in current.items() if not v.secret})
        diff = changes(current, restored)
        print(f"stack {name}: back to {describe(target)}")
        print("config changes:" if diff else "config: the same as now (the up re-applies it)")
        for change in diff:
            print(f"  {change.describe()}")
        if not options.yes and not confirmed(ask, interactive()):
            print("not rolled back: nothing was changed")
            return Exit.USAGE
        if not path.exists():
            raise OperatorError(f"{path} is missing: rollback restores config into the stack file; run from the clone")
        saved = save_copy(path, backup_dir())
        print(f"the stack file as it was is saved at {saved}")
    except (OperatorError, RollbackError) as error:
        print(f"error: {error}", file=sys.stderr)
        return Exit.USAGE
    try:
        restore_config(stack, restored, path, saved)
    except Exception as error:  # the CLI refused a value: the file is back as it was, no up ran
        print(f"error: could not restore the config: {error}; {path} is back as it was", file=sys.stderr)
        return Exit.FAILED
    try:
        stack.up(on_output=print, message=f"rollback to version {target.version}")
    except Exception as error:  # the CLI's failure (CommandError) and anything under it: one clear end
        lines = [line for line in str(error).splitlines() if line.strip()]
        first = next((line for line in lines if "error:" in line), lines[-1] if lines else type(error).__name__)
        print(
            f"error: the rollback's up failed: {first.strip()}\n"
            f"the config of version {target.version} stays in {path}; the one before is saved at {saved} "
            f"(cp {saved} {path} brings it back)",
            file=sys.stderr,
        )
        return Exit.FAILED
    print(f"rolled back: stack {name} runs version {target.version}'s config again, verified")
    return Exit.OK
