"""What Sparks print for the discover probe: reports assembled from the captured fixtures, fake sysfs trees, and
stand-in commands on a fake PATH to run probe.sh itself."""

from __future__ import annotations

import shlex
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from components.discover.findings import EXPORT_COMMANDS
from components.discover.report import probe_script
from components.preflight.gid import SYSFS_ROOT_ENV

FIXTURES = Path(__file__).parent / "fixtures"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
ROOTS = ("/srv", "/opt", "/var/lib")
HOME = "/home/nvidia"
REAL_TOOLS = ("sh", "cat", "grep", "awk", "timeout", "stat")


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def df_line(name: str) -> str:
    """The data line of a `df -P -k` capture (the header is line 1)."""
    return fixture(name).splitlines()[1]


def probe_text(
    *,
    ip: str = "ip_head.json",
    ib: str = "ib_head.txt",
    meminfo: str = "meminfo_idle.txt",
    docker: str = "docker_info.json",
    docker_exit: int = 0,
    df: str = "df_large.txt",
    nfs: str = "install ok installed",
    nfs_server: str = "active",
    shell: str = "/bin/bash",
    sudo_true: int = 1,
    sudo_l: int = 0,
    uid: int = 1000,
    leftovers: str = "",
    replace: dict[str, str] | None = None,
) -> str:
    """A node's report as probe.sh prints it, from the fixtures; `replace` swaps a section's body (e.g. for
    `unavailable: ...`)."""
    mem = next(line for line in fixture(meminfo).splitlines() if line.startswith("MemAvailable:"))
    free = next(line for line in fixture(meminfo).splitlines() if line.startswith("MemFree:"))
    disk = []
    for root in (*ROOTS, HOME):
        disk += [f"candidate ext2/ext3 {root}", f"df {df_line(df)}"]
    body = {
        "user": f"name nvidia\nuid {uid}\nhome {HOME}\nshell {shell}",
        "ip": ("format json\n" if ip.endswith(".json") else "format oneline\n") + fixture(ip).rstrip("\n"),
        "ib": fixture(ib).rstrip("\n"),
        "meminfo": mem,
        "memfree": free,
        "docker": f"exit {docker_exit}\n" + fixture(docker).rstrip("\n"),
        "gpu": "exit 0\n" + fixture("nvidia_smi.txt").rstrip("\n"),
        "disk": "\n".join(disk),
        "nfs": f"exit {0 if nfs.endswith(' installed') and nfs.startswith('install') else 1}\n{nfs}",
        "nfsserver": f"exit {0 if nfs_server == 'active' else 3}\n{nfs_server}",
        "sudo": f"sudo-true {sudo_true}\n" + "\n".join(f"sudo-l {sudo_l} {c}" for c in EXPORT_COMMANDS),
        "leftovers": "exit 0" + (f"\n{leftovers}" if leftovers else ""),
    }
    body.update(replace or {})
    return "".join(f"=={name}==\n{text}\n" for name, text in body.items()) + "==end==\n"


def sysfs_tree(root: Path, ib_text: str, size: int = 8) -> Path:
    """A /sys holding what an `ib` section says: states, GID tables (all-zero where unset), netdevs.

    An unset entry's type and netdev are directories here: reading one fails, as sysfs's EINVAL does (a mode
    bit would not stop root)."""
    ib = root / "class" / "infiniband"
    ports: set[Path] = set()
    for line in ib_text.splitlines():
        fields = line.split()
        if not fields:
            continue
        hca = ib / fields[1]
        if fields[0] == "netdev":
            (hca / "device" / "net" / fields[2]).mkdir(parents=True, exist_ok=True)
        elif fields[0] == "port":
            port = hca / "ports" / fields[2]
            (port / "gids").mkdir(parents=True, exist_ok=True)
            (port / "gid_attrs" / "types").mkdir(parents=True, exist_ok=True)
            (port / "gid_attrs" / "ndevs").mkdir(parents=True, exist_ok=True)
            (port / "state").write_text(" ".join(fields[3:]) + "\n")
            ports.add(port)
        elif fields[0] == "gid":
            port = hca / "ports" / fields[2]
            (port / "gids" / fields[3]).write_text(fields[4] + "\n")
            if fields[5] != "-":
                (port / "gid_attrs" / "ndevs" / fields[3]).write_text(fields[5] + "\n")
            if fields[6:] != ["-"]:
                (port / "gid_attrs" / "types" / fields[3]).write_text(" ".join(fields[6:]) + "\n")
    for port in ports:
        for i in range(size):
            if not (port / "gids" / str(i)).exists():
                (port / "gids" / str(i)).write_text(ZERO_GID + "\n")
            for attr in ("types", "ndevs"):
                if not (port / "gid_attrs" / attr / str(i)).exists():
                    (port / "gid_attrs" / attr / str(i)).mkdir()
    return root


@dataclass
class FakeNode:
    """The stand-in commands and files one probe run sees; `docker_calls` is where the fake docker logs argv."""

    env: dict[str, str]
    roots: tuple[Path, ...]
    home: Path
    docker_calls: Path

    def run(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["sh", "-c", probe_script()], env=self.env, capture_output=True, text=True, timeout=60, check=False
        )


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(stat.S_IRWXU)


def fake_node(
    tmp: Path,
    *,
    ib: str = "ib_head.txt",
    ip: str | None = "ip_head.json",
    ip_oneline: str = "ip_oneline.txt",
    meminfo: str = "meminfo_idle.txt",
    docker: str | None = "docker_info.json",
    docker_exit: int = 0,
    df: str = "df_large.txt",
    nfs: str | None = "install ok installed",
    sudo_true: int = 1,
    sudo_l: int = 0,
    leftovers: str = "",
    sysfs: Path | None = None,
) -> FakeNode:
    """A tmp dir with a fake sysfs, a home, two candidate roots and one missing, and stand-ins on PATH for ip,
    docker, df, dpkg-query, sudo, nvidia-smi, id, getent and systemctl. `ip` None: an `ip` without `-j` (old
    iproute2); `docker` None: no docker installed; `nfs` None: the package was never installed; `sysfs`: an
    existing /sys tree instead of one built from `ib`."""
    bin_dir, home = tmp / "bin", tmp / "home" / "nvidia"
    bin_dir.mkdir(parents=True)
    # Only these real tools: a docker, sudo or ip installed here must not answer for the node.
    for tool in REAL_TOOLS:
        found = shutil.which(tool)
        assert found, f"the probe test needs {tool} on PATH"
        (bin_dir / tool).symlink_to(found)
    home.mkdir(parents=True)
    roots = (tmp / "srv", tmp / "opt")
    for r in roots:
        r.mkdir()
    if sysfs is None:
        sysfs = sysfs_tree(tmp / "sys", fixture(ib))
    q = shlex.quote
    if ip is None:
        json_branch = 'echo \'Option "-j" is unknown, try "ip -help".\' >&2; exit 255'
    else:
        json_branch = f"exec cat {q(str(FIXTURES / ip))}"
    _script(
        bin_dir / "ip",
        f'case "$1 $2 $3" in\n  "-j addr show") {json_branch} ;;\n'
        f'  "-o addr show") exec cat {q(str(FIXTURES / ip_oneline))} ;;\nesac\nexit 1\n',
    )
    calls = tmp / "docker-calls"
    if docker is not None:
        lines = "".join(f"echo {q(line)}\n" for line in leftovers.splitlines())
        _script(
            bin_dir / "docker",
            f'printf "%s\\n" "$*" >> {q(str(calls))}\n'
            f'case "$1" in\n  info) cat {q(str(FIXTURES / docker))}; exit {docker_exit} ;;\n'
            f"  ps) {lines or ':'}\n      exit 0 ;;\nesac\nexit 1\n",
        )
    _script(bin_dir / "df", f'[ "$1 $2" = "-P -k" ] || exit 9\nexec cat {q(str(FIXTURES / df))}\n')
    if nfs is None:
        _script(bin_dir / "dpkg-query", 'echo "dpkg-query: no packages found matching $4" >&2\nexit 1\n')
    else:
        _script(bin_dir / "dpkg-query", f'[ "$1" = -W ] || exit 9\nprintf %s {q(nfs)}\n')
    _script(
        bin_dir / "sudo",
        f'[ "$1" = -n ] || exit 9\nif [ "$2" = true ]; then exit {sudo_true}; fi\n'
        f'[ "$2" = -l ] || exit 9\n[ "$sudo_l" = 0 ] && echo "$3"\nexit {sudo_l}\n'.replace("$sudo_l", str(sudo_l)),
    )
    _script(bin_dir / "nvidia-smi", f'[ "$1" = -L ] || exit 9\nexec cat {q(str(FIXTURES / "nvidia_smi.txt"))}\n')
    _script(bin_dir / "id", 'case "$1" in -un) echo nvidia ;; -u) echo 1000 ;; *) exit 1 ;; esac\n')
    _script(bin_dir / "getent", f'[ "$1 $2" = "passwd nvidia" ] || exit 2\necho nvidia:x:1000:1000::{home}:/bin/bash\n')
    _script(bin_dir / "systemctl", '[ "$1 $2" = "is-active nfs-server" ] || exit 9\necho active\n')
    env = {
        "PATH": str(bin_dir),
        "HOME": str(home),
        SYSFS_ROOT_ENV: str(sysfs),
        "DSV41_MEMINFO": str(FIXTURES / meminfo),
        "DSV41_ROOT_CANDIDATES": " ".join([*(str(r) for r in roots), str(tmp / "missing")]),
    }
    return FakeNode(env=env, roots=roots, home=home, docker_calls=calls)
