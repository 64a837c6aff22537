"""Scripts that run on a node are files beside their layer; Python renders only a header of quoted values.

Pure logic: no resources. The header is one line, so line N of a script file is line N+1 of the text that
runs, and it names the file: a script's `fail "${LINENO:-}" "why"` reports `components/<layer>/<file>:<line>: why`,
and an exit that no `fail` explained still names the file. Every script is POSIX sh and passes `shellcheck`
(`make lint`); its header values are upper-case names it declares in its opening comment.

Whatever runs on a node runs under `sh`: sshd hands a remote command to the SSH user's login shell
(`$SHELL -c`), which may be zsh (no word splitting of `$VAR`) or fish (not POSIX at all), so every command the
program sends is `sh -c <script>` (`sh_command`), quoted so that every such shell reads the same script back.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

COMPONENTS = Path(__file__).resolve().parent
_NAME = re.compile(r"[A-Z][A-Z0-9_]*")

# `fail "${LINENO:-}" WHY [EXIT]`: LINENO counts the header line, the file's own numbering does not. bash sets
# LINENO for `sh -c` (where sh is bash); dash (Debian's and Ubuntu's sh) sets it only for script files, and then
# the message names the file alone.
_FAIL = (
    'fail() { if [ -n "$1" ]; then echo "$DSV41_SCRIPT:$(($1 - 1)): $2" >&2; '
    'else echo "$DSV41_SCRIPT: $2" >&2; fi; DSV41_FAILED=1; exit "${3:-1}"; }'
)
_EXIT = 'trap \'rc=$?; [ "$rc" -eq 0 ] || [ -n "${DSV41_FAILED:-}" ] || echo "$DSV41_SCRIPT: exited $rc" >&2\' EXIT'


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


def quote(word: str) -> str:
    """`word` as one shell word that sh, bash, zsh and fish all read back byte for byte.

    shlex.quote's single quotes, except that runs of backslashes go inside double quotes (doubled): fish reads
    `\\\\` and `\\'` as escapes even inside single quotes, and `"\\\\"` is one backslash in all four."""
    if "\\" not in word:
        return shlex.quote(word)
    quoted = word.replace("'", "'\"'\"'")
    return "'" + re.sub(r"\\+", lambda m: "'\"" + m.group(0) * 2 + "\"'", quoted) + "'"


def sh_command(
    script: str, *args: str, timeout_s: int | None = None, kill_after_s: int | None = None, name: str = "sh"
) -> str:
    """The command line that runs `script` under `sh` on a node, whatever the SSH user's login shell.

    Every command sent to a node goes through here (components/ssh.py's `ssh_argv` and each remote.Command):
    sshd runs it with `$SHELL -c`, and this line reads the same in every shell of the sh, bash, zsh and fish
    families (csh cannot hold a quoted newline). `timeout_s` bounds it with coreutils' `timeout` (Pulumi's
    timeouts do not stop a remote command); `args` become $1...; $0 is then `name`. `exec`: the login shell
    is replaced, so what sshd started is the command itself (a signal or a cut session reaches the script)."""
    bound = ""
    if timeout_s is not None:
        bound = "timeout " + (f"-k {int(kill_after_s)} " if kill_after_s is not None else "") + f"{int(timeout_s)} "
    words = [quote(script), *([quote(name), *(quote(a) for a in args)] if args else [])]
    return f"exec {bound}sh -c {' '.join(words)}"
