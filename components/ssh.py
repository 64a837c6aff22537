"""How this program reaches a node over SSH: one place that renders ssh options and keeps key files.

No resources. The same options serve the docker provider (ssh://), the gates' log readers and any
ad-hoc `ssh` the program runs, so every path authenticates, multiplexes, checks host keys and fails the
same way.

Key files (ssh needs a file; argv must never hold the key) live only in directories that are ours:
owned by this uid, mode 0700, not a symlink; they are written under a temporary name with
O_EXCL|O_NOFOLLOW and renamed into place, so nothing planted in the directory is written through.
Two lifetimes:

- per run (`SshTarget.stack_dir` None: the gates, LiveRanks): under $XDG_RUNTIME_DIR (else the temp
  dir), named by hash and process id, removed when that process exits; files of processes that died
  without exit handlers are removed by the next run.
- per stack (`stack_dir` set: the docker providers): their stored `sshOpts` name the file, and destroy
  and refresh do not run the program, so the file stays under $XDG_STATE_HOME (survives a reboot)
  until the stack is destroyed (`components/access/stack_keys.py` removes the directory).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import re
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.contract import Contract, secret
from components.scripts import sh_command

# sun_path holds 107 characters; ssh binds the master's socket under `<ControlPath>.` + 16 random first.
_MAX_CONTROL_PATH = 107 - 17


class KeyDirError(RuntimeError):
    """A directory meant for key material is not private to this user."""


@dataclass(frozen=True, kw_only=True)
class SshAccess(Contract):
    """How the program's processes log in to every node: the stack's `ssh` section, built once per deployment
    (deployment.py) and handed to every resource that runs ssh itself (the gates, live ranks, the worker copy)."""

    private_key: Any = secret(default=None)
    """The key text: a secret Output in the program, a str in a provider; None: the agent alone."""
    agent_socket: str | None = None
    known_hosts_file: str | None = None

    def target(self, host: str, port: int, user: str, stack_dir: str | None = None) -> SshTarget:
        key = self.private_key
        return SshTarget(
            host=host,
            port=port,
            user=user,
            private_key=str(key) if key else None,
            agent_socket=self.agent_socket or None,
            known_hosts_file=self.known_hosts_file or None,
            stack_dir=stack_dir,
        )


@dataclass(frozen=True, kw_only=True)
class SshTarget:
    """One node as SSH sees it. `private_key` is the key text (a secret); never log it.

    `stack_dir`: keep the key file and the control socket there for the stack's life (see the module
    docstring); None: per-run files.
    """

    host: str
    port: int
    user: str
    # The stack's `ssh` section (components/config holds its defaults): a forgotten one fails the type check.
    private_key: str | None
    agent_socket: str | None
    known_hosts_file: str | None
    stack_dir: str | None = None

    def __repr__(self) -> str:  # keep the key out of tracebacks and logs
        return f"SshTarget({self.user}@{self.host}:{self.port})"


def check_private_dir(path: Path) -> None:
    """Refuse a directory that is a symlink, not ours, or open to group or others."""
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    elif mode & 0o077:
        problem = f"has mode {mode:04o}: group or others can reach what is in it"
    else:
        return
    raise KeyDirError(
        f"key directory {path} {problem} (found: owner uid {st.st_uid}, mode {mode:04o}); SSH keys are written only "
        f"into a directory owned by you with mode 0700. Fix: remove it (`rm -rf {path}`) and run again, or point "
        "XDG_RUNTIME_DIR / XDG_STATE_HOME at a private directory"
    )


def private_dir(path: Path) -> Path:
    """`path`, created 0700 if missing, checked by check_private_dir either way."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_private_dir(path)
    return path


def run_dir() -> Path:
    """Per-run key files and control sockets: per user, never inside the project tree."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return private_dir(Path(base) / f"dsv41-exl3-{os.getuid()}")


def state_root() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path("~/.local/state").expanduser()) / "dsv41-exl3" / "keys"


def stack_dir_name(project: str, stack: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{project}-{stack}")


def stack_dir(project: str, stack: str) -> Path:
    """The stack's private directory for the docker providers' key file and control sockets."""
    root = state_root()
    root.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    private_dir(root.parent)
    private_dir(root)
    return private_dir(root / stack_dir_name(project, stack))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _holds(path: Path, text: str) -> bool:
    """True when path is our own 0600 regular file (not a symlink) holding exactly `text`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, OSError):
        return False
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
            return False
        return f.read() == text.encode()


def write_private(directory: Path, name: str, text: str) -> Path:
    """Write `text` to directory/name (0600) via a fresh temporary name and rename: never through a link."""
    check_private_dir(directory)
    path = directory / name
    if _holds(path, text):
        return path
    tmp = directory / f".{name}.{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
        os.replace(tmp, path)  # replaces a planted file or symlink itself, never its target
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


_RUN_KEY = re.compile(r"^key-[0-9a-f]{16}-(\d+)$")
_registered: set[Path] = set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_run_keys(directory: Path) -> list[Path]:
    """Remove per-run key files whose process is gone (killed before its exit handlers ran)."""
    removed = []
    for p in directory.iterdir():
        m = _RUN_KEY.match(p.name)
        if m and not _alive(int(m.group(1))):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            removed.append(p)
    return removed


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _key_text(private_key: str) -> str:
    return private_key if private_key.endswith("\n") else private_key + "\n"


def materialize_key(private_key: str, stack_directory: str | None = None) -> Path:
    """The key as a 0600 file: per stack in `stack_directory`, else per run (removed when this process exits)."""
    text = _key_text(private_key)
    if stack_directory is not None:
        return write_private(Path(stack_directory), f"key-{_digest(text)}", text)
    directory = run_dir()
    path = directory / f"key-{_digest(text)}-{os.getpid()}"
    if path not in _registered:
        sweep_run_keys(directory)
        atexit.register(_remove, path)
        _registered.add(path)
    return write_private(directory, path.name, text)


def control_path(target: SshTarget) -> str:
    """One master per node and directory; a short fixed-length name, since socket paths are limited."""
    directory = Path(target.stack_dir) if target.stack_dir is not None else run_dir()
    path = f"{directory}/cm-{_digest(f'{target.user}@{target.host}:{target.port}')[:12]}"
    if len(path) > _MAX_CONTROL_PATH:
        raise KeyDirError(
            f"ssh control socket path {path} is {len(path)} characters; ssh allows {_MAX_CONTROL_PATH} "
            "here. Fix: set XDG_STATE_HOME / XDG_RUNTIME_DIR to a shorter private directory"
        )
    return path


def ssh_options(target: SshTarget, *, connect_timeout_s: int = 10) -> list[str]:
    """ssh options (no host): batch mode, host key checked, the node's key or agent, one multiplexed master.

    Multiplexing matters: the docker provider opens one ssh per API call and sshd's
    MaxStartups otherwise drops some of them (kreuzwerker/terraform-provider-docker#262).
    The program records each node's host key before any connection (components/host_keys.py), so
    accept-new only ever accepts a key there when destroy or refresh meet a node the file lacks.
    """
    opts = [
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=accept-new",
        "-o",
        f"ConnectTimeout={connect_timeout_s}",
        "-o",
        "ServerAliveInterval=15",
        "-o",
        "ServerAliveCountMax=4",
        "-o",
        "ControlMaster=auto",
        "-o",
        f"ControlPath={control_path(target)}",
        "-o",
        "ControlPersist=120",
        "-p",
        str(target.port),
    ]
    if target.private_key:
        opts += ["-o", "IdentitiesOnly=yes", "-i", str(materialize_key(target.private_key, target.stack_dir))]
    if target.agent_socket:
        opts += ["-o", f"IdentityAgent={target.agent_socket}"]
    if target.known_hosts_file:
        opts += ["-o", f"UserKnownHostsFile={target.known_hosts_file}"]
    return opts


def ssh_argv(target: SshTarget, script: str, *, connect_timeout_s: int = 10) -> list[str]:
    """Full argv for running `script` on the node, under `sh` whatever the user's login shell (sh_command)."""
    # `--` ends the options: a destination starting with '-' is never read as one (config refuses it too).
    return [
        "ssh",
        *ssh_options(target, connect_timeout_s=connect_timeout_s),
        "--",
        f"{target.user}@{target.host}",
        sh_command(script),
    ]


_STACK_FILE = re.compile(r"^(key-[0-9a-f]{16}|cm-[0-9a-f]{12}(\.[A-Za-z0-9]+)?|\.key-[0-9a-f]{16}\.[0-9a-f]{16})$")


def remove_stack_dir(directory: Path) -> list[str]:
    """Remove a stack directory's key files and sockets, then the directory; what else is in it is kept.

    Returns what was left behind (nothing when the directory is gone). A directory that is not ours is
    refused (KeyDirError), never emptied.
    """
    if not os.path.lexists(directory):
        return []
    check_private_dir(directory)
    for p in directory.iterdir():
        if _STACK_FILE.match(p.name):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    left = sorted(p.name for p in directory.iterdir())
    if not left:
        directory.rmdir()
    return left


# No key and no agent of the stack's: ssh's own defaults (`~/.ssh`, `$SSH_AUTH_SOCK`), as tests and tools use.
SSH_DEFAULTS = SshAccess()
