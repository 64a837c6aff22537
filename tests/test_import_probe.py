"""The import probe (tests/support/imports.py) sees each kind of side effect it is there to catch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.imports import import_side_effects

EFFECTS = {
    "thread": "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n",
    "file": "open(__file__ + '.written', 'w').close()\n",
    "process": "import subprocess\nsubprocess.run(['true'])\n",
    "socket": "import socket\nsocket.socket().bind(('127.0.0.1', 0))\n",
    "print": "print('hello')\n",
}
SEEN_AS = {
    "thread": "thread(s) left running",
    "file": "open for writing",
    "process": "subprocess.Popen",
    "socket": "socket.bind",
    "print": "printed to stdout",
}


@pytest.mark.parametrize("kind", sorted(EFFECTS))
def test_each_side_effect_is_reported(kind: str, tmp_path: Path) -> None:
    (tmp_path / f"noisy_{kind}.py").write_text(EFFECTS[kind])
    found = import_side_effects(f"noisy_{kind}", path=tmp_path)
    assert any(SEEN_AS[kind] in f for f in found), found


def test_a_module_that_only_defines_names_is_clean(tmp_path: Path) -> None:
    (tmp_path / "quiet.py").write_text("import json\nX = 1\n\ndef f() -> int:\n    return X\n")
    assert import_side_effects("quiet", path=tmp_path) == []


def test_an_import_that_fails_is_reported(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('no')\n")
    assert "the import failed" in import_side_effects("broken", path=tmp_path)[0]
