"""The host key the ssh-keyscan stand-in (tests/conftest.py) answers for every address: fixed, derived from it."""

from __future__ import annotations

import base64
import hashlib

from components import host_keys


def fake_host_key(host: str, port: int) -> host_keys.HostKey:
    blob = base64.b64encode(
        b"\x00\x00\x00\x0bssh-ed25519\x00\x00\x00\x20" + hashlib.sha256(f"{host}:{port}".encode()).digest()
    ).decode()
    return host_keys.HostKey(kind="ssh-ed25519", blob=blob)
