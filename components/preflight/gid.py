"""RoCE GID index: which entry of an HCA's GID table NCCL must use on one node.

Pure logic: no resources. It renders gid_check.sh (beside this file): a POSIX sh script that
dumps the relevant part of sysfs and runs an awk program, held in the script, that decides over that dump.

Where the decision runs: ON THE NODE, inside the preflight command, and nowhere else.
Not in the Pulumi program on the command's stdout, because a remote.Command that exits 0
is recorded with that stdout and is not run again until its triggers change: a refusal
made afterwards in Python would replay the same stale dump on every `up`, even after the
node was fixed. A refusal on the node exits non-zero, records nothing, and the next `up`
checks the node again. The program only reads the index the node reported.

The rule (facts in notes/spark.md): the index is the entry i of
`<sysfs>/class/infiniband/<hca>/ports/1/gids/<i>` holding the IPv4-mapped fabric address
whose `gid_attrs/types/<i>` reads `RoCE v2`. Fail closed on a missing HCA, a port that is
not ACTIVE, an all-zero entry, a RoCE v1-only entry, or an index that moved.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from components import scripts

GidWanted = int | Literal["auto"]

# Interface names as the kernel prints them; anything else could not be a sysfs entry and
# would need quoting inside the dump loop.
_HCA_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

SYSFS_ROOT_ENV = "DSV41_SYSFS_ROOT"
"""Overrides /sys for the fixture trees in tests; the node uses the real path."""


def ipv4_mapped_gid(fabric_ip: str) -> str:
    """The GID string sysfs shows for an IPv4 address: ::ffff:a.b.c.d, fully expanded."""
    try:
        addr = ipaddress.IPv4Address(fabric_ip)
    except ValueError:
        raise ValueError(
            f"fabric_ip {fabric_ip!r} is not an IPv4 address; RoCE v2 GID resolution needs the node's "
            "IPv4 address on the CX-7 fabric interface (e.g. 192.168.100.1)"
        ) from None
    # From the bytes, not IPv6Address.exploded: Python 3.13 writes an IPv4-mapped address's last 32 bits dotted
    # (`...:ffff:192.168.100.1`), which no sysfs GID matches; sysfs always prints eight hex groups.
    packed = bytes(10) + b"\xff\xff" + addr.packed
    return ":".join(packed[i : i + 2].hex() for i in range(0, 16, 2))


def check_hca_name(name: str) -> str:
    """Return the name if it can be an infiniband device name, else raise naming it."""
    # Invariant (components/config refuses such a `nodes[].ibHcas` entry): the name is written into the script.
    if not _HCA_NAME.match(name):
        raise ValueError(
            f"ib_hcas entry {name!r} is not an RDMA device name; use names as listed by "
            "`ls /sys/class/infiniband` (e.g. rocep1s0f1)"
        )
    return name


def check_gid_wanted(wanted: object) -> GidWanted:
    """Accept "auto" or a non-negative int (bool excluded), else raise naming the value."""
    if wanted == "auto":
        return "auto"
    if isinstance(wanted, int) and not isinstance(wanted, bool) and 0 <= wanted <= 255:
        return wanted
    raise ValueError(f'gid_index {wanted!r} is invalid; use "auto" or an integer 0..255')


def render_gid_check(*, hcas: list[str] | tuple[str, ...], fabric_ip: str, wanted: GidWanted) -> str:
    """The sh script gid_check.sh under its header: prints `index <i>` or one `fail <message>` per problem.

    The sysfs root is `$DSV41_SYSFS_ROOT` when set (tests), else /sys.
    """
    if not hcas:
        raise ValueError('GID check needs at least one HCA in ib_hcas (e.g. ["rocep1s0f1"])')
    names = " ".join(check_hca_name(h) for h in hcas)
    wanted = check_gid_wanted(wanted)
    return scripts.render(
        "preflight/gid_check.sh",
        {
            "GID_HCAS": names,
            "GID_FABRIC_IP": fabric_ip,
            "GID_EXPECTED": ipv4_mapped_gid(fabric_ip),
            "GID_WANTED": str(wanted),
        },
    )
