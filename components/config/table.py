"""The README's configuration table, rendered from the keys' declarations.

`python -m components.config.table` rewrites the table in README.md (`make config-table`); `--check` exits 1
when the README's table is not the rendered one (a test runs the same comparison).
"""

from __future__ import annotations

import sys
from pathlib import Path

from components.config.declare import Declared
from components.config.flags import DECLARED

BEGIN = "<!-- config table: rendered from components/config by `make config-table`; edit the declarations -->"
END = "<!-- end of config table -->"
README = Path(__file__).resolve().parents[2] / "README.md"


def _meaning(d: Declared) -> str:
    # What a key renders to is part of its meaning: the operator greps the table for a flag or variable.
    renders = [f"`{d.flag}`"] if d.flag else []
    renders += [f"`{e}`" for e in d.env if f"`{e}`" not in d.meaning]
    text = ", ".join(renders)
    if text and d.meaning:
        text += "; "
    return (text + d.meaning).replace("|", "\\|")


def config_table() -> str:
    rows = ["| key | type | default | secret | meaning |", "|---|---|---|---|---|"]
    for d in DECLARED:
        cells = [f"`{d.key}`", d.type_text(), d.default_text(), "yes" if d.secret else "", _meaning(d)]
        rows.append("| " + " | ".join(cells).replace("  ", " ") + " |")
    return "\n".join(rows)


def with_table(readme: str) -> str:
    """`readme` with the text between the markers replaced by the rendered table."""
    try:
        start = readme.index(BEGIN) + len(BEGIN)
        end = readme.index(END, start)
    except ValueError:
        raise ValueError(f"README.md has no config table markers: put {BEGIN!r} and {END!r} around it") from None
    return readme[:start] + "\n" + config_table() + "\n" + readme[end:]


def main(argv: list[str]) -> int:
    text = README.read_text()
    rendered = with_table(text)
    if "--check" in argv:
        if rendered != text:
            print("README.md's config table differs from the declarations: run `make config-table`", file=sys.stderr)
            return 1
        return 0
    README.write_text(rendered)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
