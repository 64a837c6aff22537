"""Host keys: every connection to a node checks the key recorded for it in one known_hosts file.

ssh's own `StrictHostKeyChecking=accept-new` semantics, applied to every path: the docker provider's and
the gates' `ssh` read the file themselves; the command provider has no known_hosts support, so the program
looks the key up here and passes it as the connection's `hostKey`. A node seen for the first time has its
key learned with `ssh-keyscan` and recorded (trust on first use, at preview too, as ssh does); a key that
differs from the recorded one is refused before any connection, with the fix.

Parsing, lookup, the decision and messages are pure; `keyscan`, `record` and `pin_all` do the I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# The order ssh prefers; the pinned key is the first of these the node offers.
KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa")
KEYSCAN_TIMEOUT_S = 5


class HostKeyError(RuntimeError):
    """A node's host key is unknown and cannot be learned, or differs from the recorded one."""


@dataclass(frozen=True, kw_only=True)
class HostKey:
    kind: str
    blob: str  # base64, as in known_hosts

    def line(self) -> str:
        """authorized_keys form: what the command provider's `hostKey` takes."""
        return f"{self.kind} {self.blob}"

    def fingerprint(self) -> str:
        """SHA256:... as ssh prints it."""
        try:
            raw = base64.b64decode(self.blob, validate=True)
        except binascii.Error:
            raw = self.blob.encode()
        return "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One known_hosts line: host patterns (or one hashed name), an optional marker, the key."""

    hosts: str
    key: HostKey
    marker: str | None = None


@dataclass(frozen=True, kw_only=True)
class NodeAddress:
    node: str
    host: str
    port: int


@dataclass(frozen=True, kw_only=True)
class Pin:
    """The key every connection to the node must see; `recorded` when this run added it to the file."""

    key: HostKey
    recorded: bool = False
    note: str | None = None


def host_name(host: str, port: int) -> str:
    """The name ssh looks up: `host` on port 22, `[host]:port` otherwise."""
    return host if port == 22 else f"[{host}]:{port}"


def parse_known_hosts(text: str) -> list[Entry]:
    """Entries of a known_hosts file; comments, blank and malformed lines are skipped (as ssh does)."""
    entries: list[Entry] = []
    for raw in text.splitlines():
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = None
        if fields[0].startswith("@"):
            marker, fields = fields[0], fields[1:]
        if len(fields) < 3:
            continue
        entries.append(Entry(hosts=fields[0], key=HostKey(kind=fields[1], blob=fields[2]), marker=marker))
    return entries


def _hashed_match(pattern: str, name: str) -> bool:
    # |1|base64(salt)|base64(HMAC-SHA1(salt, name)): ssh's HashKnownHosts format
    parts = pattern.split("|")
    if len(parts) != 4 or parts[1] != "1":
        return False
    try:
        salt, want = base64.b64decode(parts[2]), base64.b64decode(parts[3])
    except binascii.Error:
        return False
    return hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), want)


def _glob(pattern: str, name: str) -> bool:
    # ssh patterns know only `*` and `?`: `[host]:port` is literal text, not a character class
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(regex, name.lower()) is not None


def host_matches(hosts: str, name: str) -> bool:
    """ssh's rule: a hashed name, or comma-separated patterns (`*`, `?`, `!negation`), case-insensitive."""
    if hosts.startswith("|"):
        return _hashed_match(hosts, name)
    matched = False
    for pattern in hosts.split(","):
        negated = pattern.startswith("!")
        if _glob(pattern.removeprefix("!"), name):
            if negated:
                return False
            matched = True
    return matched


def lookup(text: str, host: str, port: int) -> tuple[list[HostKey], list[HostKey]]:
    """(known keys, revoked keys) for host:port; @cert-authority lines are not host keys and are ignored."""
    name = host_name(host, port)
    known: list[HostKey] = []
    revoked: list[HostKey] = []
    for e in parse_known_hosts(text):
        if e.marker == "@revoked":
            if host_matches(e.hosts, name):
                revoked.append(e.key)
        elif e.marker is None and host_matches(e.hosts, name):
            known.append(e.key)
    return known, revoked


def parse_keyscan(stdout: str) -> list[HostKey]:
    """ssh-keyscan's lines (`name type blob`), in the order ssh prefers."""
    keys = [e.key for e in parse_known_hosts(stdout) if e.marker is None]
    return preferred_first(keys)


def preferred_first(keys: Sequence[HostKey]) -> list[HostKey]:
    rank = {k: i for i, k in enumerate(KEY_TYPES)}
    return sorted(keys, key=lambda k: rank.get(k.kind, len(KEY_TYPES)))


def known_hosts_line(host: str, port: int, key: HostKey) -> str:
    return f"{host_name(host, port)} {key.line()}\n"


def removal_command(host: str, port: int, known_hosts_file: str) -> str:
    return f"ssh-keygen -R '{host_name(host, port)}' -f {known_hosts_file}"


def changed_message(
    node: NodeAddress, known_hosts_file: str, pinned: Sequence[HostKey], offered: Sequence[HostKey]
) -> str:
    was = ", ".join(f"{k.kind} {k.fingerprint()}" for k in pinned)
    now = ", ".join(f"{k.kind} {k.fingerprint()}" for k in offered)
    return (
        f"host key of node {node.node} ({node.host}:{node.port}) changed from {was} to {now} "
        f"(recorded in {known_hosts_file}); no connection was opened. If the node was reinstalled, "
        f"remove the old key with `{removal_command(node.host, node.port, known_hosts_file)}` and run again; "
        "otherwise something else answers at that address"
    )


def decide(
    node: NodeAddress,
    known_hosts_file: str,
    known: Sequence[HostKey],
    revoked: Sequence[HostKey],
    scanned: Sequence[HostKey] | None,
    scan_error: str | None = None,
) -> Pin:
    """Which key to pin, or why not. `scanned` None: the node could not be scanned (`scan_error` says why)."""
    where = f"node {node.node} ({node.host}:{node.port})"
    scanned = preferred_first(scanned) if scanned is not None else None
    bad = [k for k in (scanned or []) if k in revoked]
    if bad:
        raise HostKeyError(
            f"{where} offers the host key {bad[0].kind} {bad[0].fingerprint()}, which "
            f"{known_hosts_file} marks @revoked; no connection was opened"
        )
    if known:
        if scanned is None:
            # Unreachable now: keep the recorded key; the connections themselves will fail or verify it.
            return Pin(
                key=preferred_first(known)[0],
                note=f"{where}: could not read its host key now ({scan_error}); using the recorded one",
            )
        common = [k for k in scanned if k.kind in {p.kind for p in known}]
        if not common:
            raise HostKeyError(changed_message(node, known_hosts_file, known, scanned))
        for k in common:
            if k not in known:
                raise HostKeyError(changed_message(node, known_hosts_file, [p for p in known if p.kind == k.kind], [k]))
        return Pin(key=common[0])
    if not scanned:
        raise HostKeyError(
            f"{where}: no host key for {host_name(node.host, node.port)} in {known_hosts_file}, and none could be "
            f"read from the node ({scan_error or 'ssh-keyscan printed no key'}). Check that the node is up and "
            f"that host and port are right; or record its key yourself: "
            f"ssh-keyscan -p {node.port} {node.host} >> {known_hosts_file}"
        )
    return Pin(
        key=scanned[0],
        recorded=True,
        note=f"{where}: first connection, recorded host key {scanned[0].kind} {scanned[0].fingerprint()} "
        f"in {known_hosts_file}",
    )


# ---------------------------------------------------------------------------------------------
# I/O


Scan = Callable[[str, int], list[HostKey]]


def default_known_hosts_file() -> str:
    """ssh's own default, so the program and every `ssh` it starts read and write the same file."""
    return str(Path("~/.ssh/known_hosts").expanduser())


def keyscan(host: str, port: int, timeout_s: int = KEYSCAN_TIMEOUT_S) -> list[HostKey]:
    """The node's host keys as ssh-keyscan reads them; raises HostKeyError when it gets none."""
    argv = ["ssh-keyscan", "-T", str(timeout_s), "-p", str(port), host]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s + 5, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired:
        raise HostKeyError(f"ssh-keyscan {host}:{port} did not finish within {timeout_s + 5} s") from None
    except OSError as err:
        raise HostKeyError(f"cannot run ssh-keyscan (OpenSSH client tools): {err}") from None
    keys = parse_keyscan(done.stdout)
    if not keys:
        why = " ".join(ln for ln in done.stderr.splitlines() if not ln.startswith("#"))[:300]
        raise HostKeyError(
            f"ssh-keyscan got no key from {host}:{port} within {timeout_s} s "
            f"({why or 'connection refused or nothing answered'})"
        )
    return keys


def record(known_hosts_file: str, line: str) -> None:
    """Append one line as ssh does (creating the file 0600 and its directory 0700 if missing)."""
    path = Path(known_hosts_file)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        if f.tell() > 0 and not path.read_bytes().endswith(b"\n"):
            line = "\n" + line
        f.write(line)


def _scan(scan: Scan, n: NodeAddress) -> tuple[list[HostKey] | None, str | None]:
    try:
        return scan(n.host, n.port), None
    except HostKeyError as err:
        return None, str(err)


def pin_all(nodes: Sequence[NodeAddress], known_hosts_file: str | None, scan: Scan | None = None) -> dict[str, Pin]:
    """Every node's key: looked up, checked against what the node offers now and, on first use, recorded.

    The scans run in parallel (a preview waits for the slowest node, not the sum); every refusal is
    reported together.
    """
    file = str(Path(known_hosts_file).expanduser()) if known_hosts_file else default_known_hosts_file()
    scanner = scan or keyscan
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        scans = {n.node: pool.submit(_scan, scanner, n) for n in nodes}
    pins: dict[str, Pin] = {}
    errors: list[str] = []
    for n in nodes:  # one by one, re-reading the file: appends never interleave
        path = Path(file)
        known, revoked = lookup(path.read_text() if path.exists() else "", n.host, n.port)
        scanned, error = scans[n.node].result()
        try:
            decision = decide(n, file, known, revoked, scanned, error)
        except HostKeyError as err:
            errors.append(str(err))
            continue
        if decision.recorded:
            record(file, known_hosts_line(n.host, n.port, decision.key))
        pins[n.node] = decision
    if errors:
        raise HostKeyError("\n".join(errors))
    return pins
