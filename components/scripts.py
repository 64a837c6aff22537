"""Scripts that run on a node are files beside their layer; Python renders only a header of quoted values.

Pure logic: no resources. The header is one line, so line N of a script file is line N+1 of the text that
runs, and it names the file: a script's `fail "${LINENO:-}" "why"` reports `components/<layer>/<file>:<line>: why`,
and an exit that no `fail` explained still names the file. Every script is POSIX sh and passes `shellcheck`
(`make lint`); its header values are upper-case names it declares in its opening comment.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

COMPONENTS = Path(__file__).resolve().parent
_NAME = re.compile(r"[A-Z][A-Z0-9_]*")

# `fail "${LINENO:-}" WHY [EXIT]`: LINENO counts the header line, the file's own numbering does not. bash
# (a node's login shell running a command) sets LINENO; dash sets it only for script files, and then the
# message names the file alone.
_FAIL = ('fail() { if [ -n "$1" ]; then echo "$DSV41_SCRIPT:$(($1 - 1)): $2" >&2; '
         'else echo "$DSV41_SCRIPT: $2" >&2; fi; DSV41_FAILED=1; exit "${3:-1}"; }')
_EXIT = ("trap 'rc=$?; [ \"$rc\" -eq 0 ] || [ -n \"${DSV41_FAILED:-}\" ] || "
         "echo \"$DSV41_SCRIPT: exited $rc\" >&2' EXIT")


def script_path(layer_file: str) -> Path:
    """`preflight/preflight.sh` -> its file under components/."""
    path = COMPONENTS / layer_file
    if not path.is_file():
        raise FileNotFoundError(f"node script {layer_file} is not under {COMPONENTS}")
    return path


def header(layer_file: str, values: Mapping[str, str | int | float]) -> str:
    """The one header line: the script's name, `fail`, the exit report, then each value shell-quoted."""
    for name, value in values.items():
        if not _NAME.fullmatch(name) or name.startswith("DSV41_"):
            raise ValueError(f"header value name {name!r} must be upper case (A-Z, 0-9, _), not DSV41_*")
        if "\n" in str(value) or "\0" in str(value):
            raise ValueError(f"header value {name} holds a newline or NUL: header values are one line")
    assigned = "".join(f" {k}={shlex.quote(str(v))};" for k, v in values.items())
    return f"DSV41_SCRIPT={shlex.quote('components/' + layer_file)}; {_FAIL}; {_EXIT};{assigned}\n"


def render(layer_file: str, values: Mapping[str, str | int | float]) -> str:
    """The text to run on the node: the header line, then the file unchanged."""
    return header(layer_file, values) + script_path(layer_file).read_text()


def all_scripts() -> list[Path]:
    return sorted(p for p in COMPONENTS.rglob("*.sh"))


def text_value(text: str) -> str:
    """A multi-line text (data, or a whole rendered script passed to another) as one header value.

    Backslashes are doubled and newlines written `\\n`, so the script gets the text back byte for byte with
    `printf '%b' "$VALUE"`; the text stays readable in the command (a preview diff shows it)."""
    if "\0" in text:
        raise ValueError("a text header value cannot hold a NUL")
    return text.replace("\\", "\\\\").replace("\n", "\\n")
