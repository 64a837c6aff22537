"""What probe.sh printed on one node, as typed records: pure parsers, no I/O.

Each `==name==` section becomes one record; a section that printed `unavailable: <reason>` keeps the reason
(`Probe.unavailable`), so the decisions can say what could not be read rather than guess. A report without
`==end==` did not run through and is refused as a whole (`ProbeError`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

SECTIONS = ("user", "ip", "ib", "meminfo", "memfree", "docker", "gpu", "disk", "nfs", "nfsserver", "sudo", "leftovers")
END = "end"
UNAVAILABLE = "unavailable: "
_SECTION = re.compile(r"^==([a-z]+)==$")
_EXIT = re.compile(r"^exit (\d+)$")


class ProbeError(ValueError):
    """The node's report is not one probe.sh printed in full."""


@dataclass(frozen=True)
class Address:
    family: str
    """`inet` or `inet6`."""
    local: str
    prefixlen: int


@dataclass(frozen=True)
class Interface:
    name: str
    operstate: str | None
    """`UP`/`DOWN`/...; None from `ip -o addr`, which does not print it."""
    addresses: tuple[Address, ...]

    @property
    def ipv4(self) -> tuple[Address, ...]:
        return tuple(a for a in self.addresses if a.family == "inet")


@dataclass(frozen=True)
class Port:
    hca: str
    port: str
    state: str
    """The state's name (`ACTIVE`, `DOWN`, ...), without sysfs's number (`4: ACTIVE`)."""


@dataclass(frozen=True)
class Gid:
    hca: str
    port: str
    index: int
    gid: str
    """As sysfs shows it: eight groups of four lowercase hex digits."""
    ndev: str | None
    type: str
    """`RoCE v2`, `IB/RoCE v1`; empty when sysfs would not say."""


@dataclass(frozen=True)
class Rdma:
    ports: tuple[Port, ...] = ()
    gids: tuple[Gid, ...] = ()
    netdevs: tuple[tuple[str, str], ...] = ()
    """(hca, netdev) from each HCA's `device/net/`."""


@dataclass(frozen=True)
class Docker:
    exit_code: int
    server_version: str | None
    runtimes: tuple[str, ...]
    errors: tuple[str, ...]
    storage_driver: str | None = None
    """`docker info`'s `Driver` (overlay2, vfs, ...)."""
    """ServerErrors, else what docker printed besides its JSON (its error line)."""

    @property
    def usable(self) -> bool:
        return self.exit_code == 0 and bool(self.server_version) and not self.errors


@dataclass(frozen=True)
class Gpu:
    exit_code: int
    gpus: tuple[str, ...]
    """`GPU 0: NVIDIA GB10 (UUID: ...)` lines."""
    said: str | None
    """nvidia-smi's error line when it listed none."""


@dataclass(frozen=True)
class DiskCandidate:
    path: str
    fstype: str
    filesystem: str | None
    """df's first column (the device); None when df printed nothing for it."""
    available_kib: int | None
    mount: str | None


@dataclass(frozen=True)
class Disk:
    candidates: tuple[DiskCandidate, ...]
    missing: tuple[str, ...]


@dataclass(frozen=True)
class Nfs:
    installed: bool
    status: str
    """dpkg's status (`install ok installed`) or its message."""


@dataclass(frozen=True)
class NfsServer:
    exit_code: int
    state: str
    """`systemctl is-active nfs-server`'s answer: active, inactive, failed, ..."""

    @property
    def active(self) -> bool:
        return self.exit_code == 0 and self.state == "active"


@dataclass(frozen=True)
class Sudo:
    sudo_true: int | None
    """`sudo -n true`'s exit status."""
    listed: tuple[tuple[str, int], ...]
    """(command, `sudo -n -l <command>`'s exit status)."""


@dataclass(frozen=True)
class Leftover:
    name: str
    status: str
    stack: str


@dataclass(frozen=True)
class Leftovers:
    exit_code: int
    containers: tuple[Leftover, ...]
    said: str | None


@dataclass(frozen=True)
class User:
    name: str
    uid: int | None
    home: str
    shell: str | None = None
    """The login shell (`getent passwd`); None when the node could not say."""


@dataclass(frozen=True)
class Probe:
    user: User | None = None
    interfaces: tuple[Interface, ...] | None = None
    rdma: Rdma | None = None
    mem_available_kib: int | None = None
    mem_free_kib: int | None = None
    docker: Docker | None = None
    gpu: Gpu | None = None
    disk: Disk | None = None
    nfs: Nfs | None = None
    nfs_server: NfsServer | None = None
    sudo: Sudo | None = None
    leftovers: Leftovers | None = None
    unavailable: dict[str, str] = field(default_factory=dict)
    """section -> the reason the node gave (or the parser's, for a section it could not read)."""


def sections(text: str) -> dict[str, list[str]]:
    """`==name==` markers and the lines under each; lines before the first marker are dropped."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in text.splitlines():
        line = raw.rstrip("\r")
        marker = _SECTION.match(line.strip())
        if marker:
            current = found.setdefault(marker.group(1), [])
        elif current is not None:
            current.append(line)
    return found


def _exit_and_rest(lines: list[str]) -> tuple[int, list[str]]:
    if lines and (m := _EXIT.match(lines[0].strip())):
        return int(m.group(1)), lines[1:]
    raise ValueError("no `exit <status>` line")


def _first(lines: list[str]) -> str | None:
    return next((line.strip() for line in lines if line.strip()), None)


def parse_user(lines: list[str]) -> User:
    values: dict[str, str] = {}
    for line in lines:
        word, _, rest = line.partition(" ")
        values[word] = rest
    uid = values.get("uid", "").strip()
    shell = values["shell"].strip() if "shell" in values else None
    return User(
        name=values.get("name", "?").strip(),
        uid=int(uid) if uid.isdigit() else None,
        home=values.get("home", ""),
        shell=shell,
    )


def _json_interfaces(data: Any) -> tuple[Interface, ...]:
    if not isinstance(data, list):
        raise ValueError("`ip -j addr` did not print a list")
    found = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("ifname"), str):
            continue
        addresses = tuple(
            Address(family=str(a["family"]), local=str(a["local"]), prefixlen=int(a.get("prefixlen", 0)))
            for a in item.get("addr_info") or []
            if isinstance(a, dict) and "family" in a and "local" in a
        )
        state = item.get("operstate")
        found.append(Interface(name=item["ifname"], operstate=str(state) if state else None, addresses=addresses))
    return tuple(found)


def _oneline_interfaces(lines: list[str]) -> tuple[Interface, ...]:
    # `4: enp1s0f1np1    inet 192.168.100.1/24 brd ... scope global enp1s0f1np1\       valid_lft ...`
    by_name: dict[str, list[Address]] = {}
    for line in lines:
        fields = line.split()
        if len(fields) < 4 or not fields[0].endswith(":") or fields[2] not in ("inet", "inet6"):
            continue
        name = fields[1].split("@", 1)[0]
        local, _, prefix = fields[3].partition("/")
        by_name.setdefault(name, []).append(
            Address(family=fields[2], local=local, prefixlen=int(prefix) if prefix.isdigit() else 0)
        )
    return tuple(Interface(name=n, operstate=None, addresses=tuple(a)) for n, a in by_name.items())


def parse_ip(lines: list[str]) -> tuple[Interface, ...]:
    """`format json` + `ip -j addr show`, or `format oneline` + `ip -o addr show`."""
    if not lines:
        raise ValueError("empty")
    kind, rest = lines[0].strip(), lines[1:]
    if kind == "format json":
        return _json_interfaces(json.loads("\n".join(rest)))
    if kind == "format oneline":
        return _oneline_interfaces(rest)
    raise ValueError(f"unknown format line {kind!r}")


def port_state(text: str) -> str:
    """`4: ACTIVE` -> `ACTIVE` (gid_check.sh strips the number the same way)."""
    return re.sub(r"^[0-9]+: *", "", text.strip())


def parse_ib(lines: list[str]) -> Rdma:
    ports: list[Port] = []
    gids: list[Gid] = []
    netdevs: list[tuple[str, str]] = []
    for line in lines:
        fields = line.split()
        if fields[:1] == ["netdev"] and len(fields) == 3:
            netdevs.append((fields[1], fields[2]))
        elif fields[:1] == ["port"] and len(fields) >= 4:
            ports.append(Port(hca=fields[1], port=fields[2], state=port_state(" ".join(fields[3:]))))
        elif fields[:1] == ["gid"] and len(fields) >= 7 and fields[3].isdigit():
            kind = " ".join(fields[6:])
            gids.append(
                Gid(
                    hca=fields[1],
                    port=fields[2],
                    index=int(fields[3]),
                    gid=fields[4].lower(),
                    ndev=None if fields[5] == "-" else fields[5],
                    type="" if kind == "-" else kind,
                )
            )
    return Rdma(ports=tuple(ports), gids=tuple(gids), netdevs=tuple(netdevs))


def _meminfo_kib(lines: list[str], key: str) -> int:
    """/proc/meminfo's `key:` in KiB (its `kB` are KiB)."""
    for line in lines:
        if m := re.match(rf"^{key}:\s+(\d+)\s*kB", line.strip()):
            return int(m.group(1))
    raise ValueError(f"no `{key}: N kB` line")


def parse_meminfo(lines: list[str]) -> int:
    return _meminfo_kib(lines, "MemAvailable")


def parse_memfree(lines: list[str]) -> int:
    return _meminfo_kib(lines, "MemFree")


def parse_docker(lines: list[str]) -> Docker:
    """`docker info --format '{{json .}}'`: usable only with a server version and no server error.

    docker 28 prints its client-side JSON and exits 1 when it cannot reach the daemon; older versions put the
    error in `ServerErrors` and exit 0: both read as not usable, with docker's own words."""
    code, rest = _exit_and_rest(lines)
    data: dict[str, Any] = {}
    others = []
    for line in rest:
        if line.lstrip().startswith("{") and not data:
            try:
                loaded = json.loads(line)
            except ValueError:
                others.append(line.strip())
                continue
            if isinstance(loaded, dict):
                data = loaded
        elif line.strip():
            others.append(line.strip())
    errors = [str(e) for e in data.get("ServerErrors") or []]
    if not errors and (code != 0 or not data):
        errors = others or [f"docker info exited {code} and printed nothing"]
    runtimes = data.get("Runtimes")
    return Docker(
        exit_code=code,
        server_version=str(data["ServerVersion"]) if data.get("ServerVersion") else None,
        runtimes=tuple(sorted(runtimes)) if isinstance(runtimes, dict) else (),
        errors=tuple(errors),
        storage_driver=str(data["Driver"]) if data.get("Driver") else None,
    )


def parse_gpu(lines: list[str]) -> Gpu:
    code, rest = _exit_and_rest(lines)
    gpus = tuple(line.strip() for line in rest if re.match(r"^GPU \d+:", line.strip()))
    return Gpu(exit_code=code, gpus=gpus, said=None if gpus else _first(rest))


def parse_df_line(line: str) -> tuple[str, int, str] | None:
    """df -P -k's data line -> (filesystem, available KiB, mount point); None if it is not one."""
    fields = line.split()
    if len(fields) < 6 or not fields[3].isdigit():
        return None
    return fields[0], int(fields[3]), " ".join(fields[5:])


def parse_disk(lines: list[str]) -> Disk:
    candidates: list[DiskCandidate] = []
    missing: list[str] = []
    pending: tuple[str, str] | None = None  # (fstype, path) waiting for its df line

    def flush(df: tuple[str, int, str] | None) -> None:
        if pending is not None:
            fstype, path = pending
            candidates.append(
                DiskCandidate(
                    path=path,
                    fstype=fstype,
                    filesystem=df[0] if df else None,
                    available_kib=df[1] if df else None,
                    mount=df[2] if df else None,
                )
            )

    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "missing":
            missing.append(rest)
        elif word == "candidate":
            flush(None)
            fstype, _, path = rest.partition(" ")
            pending = (fstype, path)
        elif word == "df":
            flush(parse_df_line(rest))
            pending = None
    flush(None)
    return Disk(candidates=tuple(candidates), missing=tuple(missing))


def parse_nfs(lines: list[str]) -> Nfs:
    """dpkg-query's `${Status}`: `install ok installed` is the one that means installed."""
    code, rest = _exit_and_rest(lines)
    said = " ".join(line.strip() for line in rest if line.strip())
    return Nfs(installed=code == 0 and said.endswith(" installed") and said.split()[0] == "install", status=said)


def parse_nfs_server(lines: list[str]) -> NfsServer:
    code, rest = _exit_and_rest(lines)
    return NfsServer(exit_code=code, state=_first(rest) or "no answer")


def parse_sudo(lines: list[str]) -> Sudo:
    sudo_true = None
    listed = []
    for line in lines:
        fields = line.split()
        if fields[:1] == ["sudo-true"] and len(fields) == 2 and fields[1].isdigit():
            sudo_true = int(fields[1])
        elif fields[:1] == ["sudo-l"] and len(fields) == 3 and fields[1].isdigit():
            listed.append((fields[2], int(fields[1])))
    return Sudo(sudo_true=sudo_true, listed=tuple(listed))


def parse_leftovers(lines: list[str]) -> Leftovers:
    code, rest = _exit_and_rest(lines)
    if code != 0:
        return Leftovers(exit_code=code, containers=(), said=_first(rest))
    found = []
    for line in rest:
        if not line.strip():
            continue
        name, _, more = line.strip().partition("|")
        status, _, stack = more.partition("|")
        found.append(Leftover(name=name, status=status, stack=stack))
    return Leftovers(exit_code=code, containers=tuple(found), said=None)


_PARSERS: dict[str, Any] = {
    "user": parse_user,
    "ip": parse_ip,
    "ib": parse_ib,
    "meminfo": parse_meminfo,
    "memfree": parse_memfree,
    "docker": parse_docker,
    "gpu": parse_gpu,
    "disk": parse_disk,
    "nfs": parse_nfs,
    "nfsserver": parse_nfs_server,
    "sudo": parse_sudo,
    "leftovers": parse_leftovers,
}
_FIELDS = {
    "ip": "interfaces",
    "ib": "rdma",
    "meminfo": "mem_available_kib",
    "memfree": "mem_free_kib",
    "nfsserver": "nfs_server",
}


def parse_probe(text: str) -> Probe:
    """Every section of probe.sh's output; a section that cannot be read is `unavailable`, never a crash."""
    found = sections(text)
    if END not in found:
        raise ProbeError("the node's report was cut short (no `==end==`)")
    values: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    for name in SECTIONS:
        lines = found.get(name)
        if lines is None:
            unavailable[name] = "the probe printed no such section"
            continue
        said = _first(lines) or ""
        if said.startswith(UNAVAILABLE):
            unavailable[name] = said.removeprefix(UNAVAILABLE)
            continue
        try:
            values[_FIELDS.get(name, name)] = _PARSERS[name](lines)
        except (ValueError, KeyError, TypeError) as error:
            unavailable[name] = f"could not read what the node printed ({error})"
    return Probe(**values, unavailable=unavailable)
