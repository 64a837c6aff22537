"""The two ends of a worker's copy (`weights.share: copy`) read their settings from here: the head's source
(copy_source.py) and the worker's copier (copy_weights.py), each from the first line of its stdin. The program
builds them (local_copy.source_config, local_copy.copier_config; worker_copy.py sends them), the programs in the
containers read them back with `from_json`: one declaration per boundary (components/contract.py), each default
in its field, nothing read by string keys.

Standard library only: shipped into both containers with the programs (`shipped.module_files` finds it from
their imports). Each carries the run's copy token: sent on stdin only, never argv, a header value or a file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from components.contract import Contract, secret


@dataclass(frozen=True, kw_only=True)
class Limits(Contract):
    """What one client may hold at the source. max_connections exceeds weights.copyStreams' maximum (64): a copy
    never waits."""

    max_connections: int = 72
    request_timeout_s: float = 10.0
    """A request's line and headers must arrive within this of the connection (a slow-loris client is dropped)."""
    io_timeout_s: float = 60.0
    """Every send or receive on a connection (a stalled reader is dropped)."""
    silence_s: float = 40.0
    """8 missed heartbeats: the session is gone, stop within a minute of its loss."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r} must be > 0")


@dataclass(frozen=True, kw_only=True)
class SourceConfig(Contract):
    """The head's source: whom it serves, what, and for how long; then the deployer's heartbeats follow on stdin."""

    token: str = secret(repr=False)
    """This run's copy token: a request must carry `Authorization: Bearer <token>`."""
    allow: tuple[str, ...]
    """The worker's fabric address: anyone else is answered 403 at accept."""
    dirs: tuple[str, ...]
    """The staged directories served (what a rank reads), relative to the weights root."""
    max_lifetime_s: float = 86400.0
    """The source stops after this whatever its stdin says."""
    limits: Limits = dataclasses.field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not self.token or not self.allow:
            raise ValueError("the token and the workers' addresses are required")
        if self.max_lifetime_s <= 0:
            raise ValueError(f"max_lifetime_s={self.max_lifetime_s!r} must be > 0")


@dataclass(frozen=True, kw_only=True)
class ExpectedFile(Contract):
    """One file the copy must end with, as the head's staging verified it against the hub."""

    path: str
    """Relative to the copy root, e.g. `model/config.json`."""
    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class CopierConfig(Contract):
    """The worker's copier: the token that pairs it with the head's source and the files it must end with (from
    the deployer, never from the head's say-so)."""

    token: str = secret(repr=False)
    expected: tuple[ExpectedFile, ...]

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("no copy token")
        paths = [e.path for e in self.expected]
        if len(set(paths)) != len(paths):
            raise ValueError(f"a file is expected twice: {sorted({p for p in paths if paths.count(p) > 1})[:3]}")
