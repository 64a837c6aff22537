"""Unit tests never reach a network nor touch the operator's SSH files.

Every test session gets its own known_hosts file, key directories under a temporary dir, an
ssh-keyscan stand-in that answers every host with a fixed key derived from its address, an update lock
that is never sent (tests/supervisor/test_update_lock.py sends it, to loopback), and no name resolution: a node
given by name needs the test's own resolver (`deploy(..., resolver=...)`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from components import host_keys
from components.access import addresses
from components.supervisor import update_lock
from tests.support.host_keys import fake_host_key


@pytest.fixture(autouse=True, scope="session")
def offline_ssh() -> Iterator[Path]:
    # short: ssh's control socket paths are limited to ~90 characters (components/ssh.py)
    home = Path(tempfile.mkdtemp(prefix="d41-"))
    (home / "run").mkdir(mode=0o700)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(home / "run"))
        mp.setenv("XDG_STATE_HOME", str(home / "state"))
        mp.setattr(host_keys, "default_known_hosts_file", lambda: str(home / "known_hosts"))
        mp.setattr(host_keys, "keyscan", lambda host, port: [fake_host_key(host, port)])
        mp.setattr(addresses, "system_resolver", _no_lookups)
        mp.setattr(update_lock.UpdateLock, "start", lambda self, report=None: self)
        mp.setattr(update_lock.UpdateLock, "report", lambda self, report: None)
        yield home
    shutil.rmtree(home, ignore_errors=True)


def _no_lookups(name: str) -> list[str]:
    raise OSError(f"unit tests resolve no names ({name!r}): give deploy(..., resolver=...) a fake one")
