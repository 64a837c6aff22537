"""A user's own stack file, written from the committed template (`make stack STACK=name`).

    python -m components.stack_file --stack NAME [--force]

`Pulumi.dev.yaml` is the committed template (the recipe's defaults, `<placeholders>` where the user decides);
`Pulumi.<name>.yaml` is the user's, git-ignored, so filling in hosts never conflicts with a `git pull`. The
template itself is never filled in: `dev` is refused as a name.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

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


def write(stack: str, repo: Path = REPO, *, force: bool = False) -> Path:
    """Write Pulumi.<stack>.yaml from the template; an existing file is kept unless `force`."""
    path = stack_path(stack, repo)
    if path.exists() and not force:
        raise StackFileError(f"{path.name} exists: edit it, or pass FORCE=1 to rewrite it from {TEMPLATE}")
    path.write_text(render((repo / TEMPLATE).read_text(), stack))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m components.stack_file", description=__doc__.split("\n")[0])
    parser.add_argument("--stack", required=True, metavar="NAME")
    parser.add_argument("--force", action="store_true", help="rewrite an existing stack file from the template")
    args = parser.parse_args(argv)
    try:
        path = write(args.stack, force=args.force)
    except StackFileError as err:
        print(f"make stack: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path.name}: fill in every <...> value, then `pulumi preview --stack {args.stack}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
