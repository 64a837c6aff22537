"""What discovery decides, shared by its parts: the constants, an argument's form, and a decision's finding (what
it found, its warnings, what it could not decide with the fix). Runs on the operator's machine."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from components import host_keys
from components.config import Node
from components.operator.stack_view import OperatorError

SSH_TIMEOUT_S = 90  # the probe bounds each daemon call at 10 s; a dozen of them at worst
FORM = "user@host[:port]"
ROCE_V2 = "RoCE v2"
GID_PORT = "1"  # gid_check.sh reads port 1 only (one port per GB10 HCA)
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"
WEIGHTS_DIR = "dsv41-exl3"
SUDOERS_FILE = "/etc/sudoers.d/dsv41-exl3"
# What the NFS export runs as root (components/weights/export.sh, unexport.sh): the README's sudoers line.
EXPORT_COMMANDS = ("/usr/sbin/exportfs", "/usr/bin/mkdir", "/usr/bin/install", "/usr/bin/rm")
NO_RDMA = "set `ibHcas: []` to run without RDMA"
NOT_DECIDED = "<not decided: see below>"
REACH_FIX = "check the address, port and that your key is in the node's authorized_keys"
GIB_KIB = 1 << 20

Run = Callable[[list[str]], subprocess.CompletedProcess[str]]
Pin = Callable[[Sequence[host_keys.NodeAddress], str | None], dict[str, host_keys.Pin]]


@dataclass(frozen=True)
class Spec:
    """One `user@host[:port]` argument."""

    user: str
    host: str
    port: int

    @property
    def text(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user}@{host}" + ("" if self.port == 22 else f":{self.port}")


@dataclass(frozen=True)
class Undecided:
    """A config line this tool could not decide: the key, why, and the fix."""

    key: str
    reason: str
    fix: str

    def line(self) -> str:
        return f"{self.key}: {self.reason}" + (f"; fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class Finding:
    """What one decision says about a node: lines for its block, warnings, and what it could not decide."""

    found: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    undecided: tuple[Undecided, ...] = ()

    def __add__(self, other: Finding) -> Finding:
        return Finding(self.found + other.found, self.warnings + other.warnings, self.undecided + other.undecided)


# --- arguments -------------------------------------------------------------------------------------------------


def parse_target(arg: str) -> Spec:
    """`user@host[:port]` (`user@[v6]:port` for an IPv6 address), checked by the config's own `nodes[]` rules."""
    user, at, rest = arg.partition("@")
    if not at or not user:
        raise OperatorError(f"{arg!r} has no user: use the form {FORM}, e.g. nvidia@10.0.0.1")
    host, port_text = rest, None
    if rest.startswith("["):
        host, bracket, after = rest[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise OperatorError(f"{arg!r} is not of the form {FORM} (an IPv6 address goes in brackets: user@[::1]:22)")
        port_text = after[1:] if after else None
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
    port = 22
    if port_text is not None:
        if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 1 <= int(port_text) <= 65535:
            raise OperatorError(f"{arg!r} has a bad port {port_text!r}: use the form {FORM} with a port 1-65535")
        port = int(port_text)
    try:
        Node(name="spark-head", host=host, port=port, user=user, fabric_ip="192.0.2.1")
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        said = str(first["msg"]).removeprefix("Value error, ")
        raise OperatorError(f"{arg!r}: the {where} {said}; use the form {FORM}") from None
    return Spec(user=user, host=host, port=port)


def node_name(index: int) -> str:
    """The names the stack file's template uses: spark-head, spark-worker, then spark-worker-2, -3..."""
    return "spark-head" if index == 0 else "spark-worker" if index == 1 else f"spark-worker-{index}"


def role(index: int) -> str:
    return "head" if index == 0 else "worker"
