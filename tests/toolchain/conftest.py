"""Fixtures for the command provider's tests: our pulumi-resource-command (built by toolchain/build_command.sh),
the project's pulumi CLI, a fresh PULUMI_HOME and file:// backend per test, and a throwaway sshd."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SDK_PLUGIN_JSON = "pulumi-plugin.json"


def read_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for line in (REPO / "toolchain" / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key] = value
    return versions


def toolchain_dir() -> Path:
    """Same path as toolchain/env.sh computes."""
    if os.environ.get("DSV41_TOOLCHAIN_DIR"):
        return Path(os.environ["DSV41_TOOLCHAIN_DIR"])
    cache = os.environ.get("DSV41_CACHE") or str(Path.home() / ".cache" / "dsv41-exl3")
    return Path(cache) / "toolchain" / f"pulumi-v{read_versions()['PULUMI_VERSION']}"


def sdk_plugin_version() -> str:
    """The provider version the installed pulumi_command SDK asks the engine for."""
    import json

    import pulumi_command

    return json.loads((Path(pulumi_command.__file__).parent / SDK_PLUGIN_JSON).read_text())["version"]


def _missing(reason: str) -> None:
    if os.environ.get("DSV41_REQUIRE_TOOLCHAIN") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def pulumi_root() -> Path:
    root = toolchain_dir()
    if not os.access(root / "bin" / "pulumi", os.X_OK):
        _missing(f"Pulumi CLI not built at {root}/bin/pulumi; run `make toolchain`")
    return root


@pytest.fixture(scope="session")
def command_provider(pulumi_root: Path) -> Path:
    """Our provider binary, (re)built from toolchain/command when its sources changed (warm: < 1 s)."""
    out = pulumi_root / "bin" / "pulumi-resource-command"
    if shutil.which("go") is None and not os.access(out, os.X_OK):
        _missing("no go on PATH to build toolchain/command")
    if shutil.which("go") is not None:
        subprocess.run(
            ["bash", str(REPO / "toolchain" / "build_command.sh"), str(out)], check=True, stdout=subprocess.DEVNULL
        )
    return out


@pytest.fixture
def engine_env(pulumi_root: Path, command_provider: Path, tmp_path: Path) -> dict[str, str]:
    """Environment of every pulumi call of one test, with our provider installed in its own PULUMI_HOME."""
    backend = tmp_path / "backend"
    home = tmp_path / "pulumi-home"
    backend.mkdir()
    home.mkdir()
    env = {
        "PULUMI_BACKEND_URL": f"file://{backend}",
        "PULUMI_HOME": str(home),
        "PULUMI_CONFIG_PASSPHRASE": "engine-test-only",
        "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",
        "PULUMI_SKIP_UPDATE_CHECK": "true",
        "PULUMI_IGNORE_AMBIENT_PLUGINS": "true",
        "PULUMI_PYTHON_CMD": sys.executable,
        "PATH": os.pathsep.join(
            [str(pulumi_root / "bin"), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
        ),
    }
    subprocess.run(
        [
            str(pulumi_root / "bin" / "pulumi"),
            "plugin",
            "install",
            "resource",
            "command",
            sdk_plugin_version(),
            "--file",
            str(command_provider),
            "--exact",
        ],
        env={**os.environ, **env},
        check=True,
        capture_output=True,
    )
    return env


@dataclass(frozen=True)
class Sshd:
    host: str
    port: int
    user: str
    private_key: str
    host_public_key: str  # authorized_keys form: "ssh-ed25519 AAAA..."
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}: {log.read_text()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"sshd did not listen on {port}: {log.read_text()}")


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """A throwaway sshd on 127.0.0.1 (random port): key-only auth, AcceptEnv DSV41_* PULUMI_COMMAND_*, sftp."""
    binary = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.access(binary, os.X_OK) or shutil.which("ssh-keygen") is None:
        _missing("openssh-server is not installed (apt-get install -y openssh-server)")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    (d / "authorized_keys").chmod(0o600)
    port = _free_port()
    user = os.environ.get("USER") or subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    config = d / "sshd_config"
    config.write_text(
        "\n".join(
            [
                "ListenAddress 127.0.0.1",
                f"Port {port}",
                f"HostKey {d / 'host_key'}",
                f"PidFile {d / 'sshd.pid'}",
                f"AuthorizedKeysFile {d / 'authorized_keys'}",
                "StrictModes no",
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PubkeyAuthentication yes",
                "PermitRootLogin prohibit-password",
                "AcceptEnv DSV41_* PULUMI_COMMAND_*",
                "Subsystem sftp internal-sftp",
                "MaxStartups 50:30:100",
                "LogLevel VERBOSE",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation directory
    log = d / "sshd.log"
    proc = subprocess.Popen([binary, "-D", "-e", "-f", str(config)], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, proc, log)
        host_pub = " ".join((d / "host_key.pub").read_text().split()[:2])
        yield Sshd("127.0.0.1", port, user, (d / "client_key").read_text(), host_pub, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
