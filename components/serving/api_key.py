"""The key the endpoint requires: never open unless the stack says so.

`serve.apiKey` unset: the program uses a generated key, stable across updates (a new key would replace every
rank and lock every client out), exported as the secret output `apiKey`. `serve.apiKey: none`: the endpoint
serves without a key, warned at every preview. Any other value is the user's key.

The generated key is derived from the stack's `ssh.privateKey` when the config has one, so a second operator's
machine derives the same; otherwise it is kept in the stack's private key directory on this machine (0600).
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from pydantic import SecretStr

from components.config import OPEN_ENDPOINT, Settings
from components.ssh import write_private

KEY_FILE = "api.key"


def is_open(s: Settings) -> bool:
    return s.serve.api_key is not None and s.serve.api_key.get_secret_value() == OPEN_ENDPOINT


def generated_key(s: Settings, stack: str, keys_dir: str) -> str:
    """The stack's generated key: the same on every run."""
    if s.ssh.private_key is not None:
        material = s.ssh.private_key.get_secret_value().encode()
        digest = hashlib.sha256(b"dsv41-exl3 api key\0" + stack.encode() + b"\0" + material).hexdigest()
        return f"sk-{digest[:48]}"
    path = Path(keys_dir) / KEY_FILE
    if path.exists():
        return path.read_text().strip()
    key = f"sk-{secrets.token_hex(24)}"
    write_private(Path(keys_dir), KEY_FILE, key)
    return key


def with_endpoint_key(s: Settings, stack: str, keys_dir: str) -> Settings:
    """The settings with `serve.apiKey` the key the endpoint requires (None: open, by the user's choice)."""
    if is_open(s):
        return s.model_copy(update={"serve": s.serve.model_copy(update={"api_key": None})})
    if s.serve.api_key is not None:
        return s
    key = SecretStr(generated_key(s, stack, keys_dir))
    return s.model_copy(update={"serve": s.serve.model_copy(update={"api_key": key})})
