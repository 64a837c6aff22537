"""How this program reaches a node over SSH: one place that renders ssh options.

Pure logic: no resources. The same options serve the docker provider (ssh://),
the gates' log readers and any ad-hoc `ssh` the program runs, so every path
authenticates, multiplexes and fails the same way.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class SshTarget:
    """One node as SSH sees it. `private_key` is the key text (a secret); never log it."""

    host: str
    port: int = 22
    user: str
    private_key: str | None = None
    agent_socket: str | None = None
    known_hosts_file: str | None = None

    def __repr__(self) -> str:  # keep the key out of tracebacks and logs
        return f"SshTarget({self.user}@{self.host}:{self.port})"


def key_dir() -> Path:
    """Where materialized keys live: per user, never inside the project tree."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"dsv41-exl3-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def materialize_key(private_key: str) -> Path:
    """Write the key to a 0600 file named by its hash; ssh needs a file, argv must never hold the key."""
    text = private_key if private_key.endswith("\n") else private_key + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = key_dir() / f"key-{digest}"
    if not path.exists() or path.read_text() != text:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return path


def ssh_options(target: SshTarget, *, connect_timeout_s: int = 10) -> list[str]:
    """ssh options (no host): batch mode, the node's key or agent, one multiplexed master per node.

    Multiplexing matters: the docker provider opens one ssh per API call and sshd's
    MaxStartups otherwise drops some of them (kreuzwerker/terraform-provider-docker#262).
    """
    opts = [
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=accept-new",
        "-o", f"ConnectTimeout={connect_timeout_s}",
        "-o", "ServerAliveInterval=15",
        "-o", "ServerAliveCountMax=4",
        "-o", "ControlMaster=auto",
        "-o", f"ControlPath={key_dir()}/cm-%C",
        "-o", "ControlPersist=120",
        "-p", str(target.port),
    ]
    if target.private_key:
        opts += ["-o", "IdentitiesOnly=yes", "-i", str(materialize_key(target.private_key))]
    if target.agent_socket:
        opts += ["-o", f"IdentityAgent={target.agent_socket}"]
    if target.known_hosts_file:
        opts += ["-o", f"UserKnownHostsFile={target.known_hosts_file}"]
    return opts


def ssh_argv(target: SshTarget, remote_command: str, *, connect_timeout_s: int = 10) -> list[str]:
    """Full argv for running one remote command on the node."""
    return ["ssh", *ssh_options(target, connect_timeout_s=connect_timeout_s),
            f"{target.user}@{target.host}", remote_command]
