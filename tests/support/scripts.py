"""Reading rendered node scripts the way a node's shell does."""

from __future__ import annotations

import subprocess


def run_sh(text: str, shell: str = "sh") -> subprocess.CompletedProcess[str]:
    return subprocess.run([shell, "-c", text], capture_output=True, text=True, timeout=10, check=False)


def header_value(text: str, name: str, *, as_text: bool = False) -> str:
    """What a rendered script's header sets `name` to, as the node's shell reads it (`as_text`: a
    `scripts.text_value`, written back with printf '%b')."""
    fmt = "%b" if as_text else "%s"
    done = run_sh(text.split("\n", 1)[0] + f'\nprintf {fmt} "${name}"\n')
    assert done.returncode == 0, done.stderr
    return done.stdout
