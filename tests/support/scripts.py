"""Reading rendered node scripts the way a node's shell does."""

from __future__ import annotations

import shlex
import subprocess


def run_sh(text: str, shell: str = "sh") -> subprocess.CompletedProcess[str]:
    return subprocess.run([shell, "-c", text], capture_output=True, text=True, timeout=10, check=False)


def sent_script(command: str) -> str:
    """The script a command sent to a node carries (`exec [timeout ...] sh -c SCRIPT [$0 args...]`,
    components.scripts.sh_command); a rendered script itself comes back unchanged."""
    if not command.startswith("exec "):
        return command
    words = shlex.split(command)
    at = words.index("sh")
    assert words[at + 1] == "-c", f"not an `sh -c` command: {command[:80]!r}"
    return words[at + 2]


def header_value(text: str, name: str, *, as_text: bool = False) -> str:
    """What a rendered script's header (or the script a sent command carries) sets `name` to, as the node's
    shell reads it (`as_text`: a `scripts.text_value`, written back with printf '%b')."""
    fmt = "%b" if as_text else "%s"
    done = run_sh(sent_script(text).split("\n", 1)[0] + f'\nprintf {fmt} "${name}"\n')
    assert done.returncode == 0, done.stderr
    return done.stdout
