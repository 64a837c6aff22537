#!/usr/bin/env python3
"""Stand-in for Pulumi's Go language host `pulumi-language-python`, which the Go module proxy does not serve.

The engine starts `pulumi-language-python [--logtostderr] [-v=N] [--tracing URL] ENGINE_ADDRESS` in the
program directory and reads the gRPC port from the first line of stdout. This host serves the
LanguageRuntime calls a file-based `pulumi preview`/`up`/`destroy` needs:

- Run: runs the program the way the real host does, through the SDK's own `pulumi-language-python-exec`
  (installed next to this file), with config passed in PULUMI_CONFIG / PULUMI_CONFIG_SECRET_KEYS.
- GetRequiredPlugins: the resource plugins named by installed packages' `pulumi-plugin.json`.
- GetPluginInfo, About, GetProgramDependencies, InstallDependencies (no-op: `make venv` manages the venv).

It runs the program with the Python that runs this host: the project venv's, first on PATH via `make env`.
The `virtualenv`/`toolchain` runtime options of Pulumi.yaml are not honoured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from importlib import metadata
from typing import Any

try:
    import grpc
    from pulumi.runtime.proto import language_pb2, language_pb2_grpc, plugin_pb2
except ImportError as exc:  # the engine shows stderr when the port line never comes
    print(
        f"pulumi-language-python (stand-in): cannot import the Pulumi SDK with {sys.executable}: {exc}; "
        'put the project venv first on PATH (eval "$(make -s env)")',
        file=sys.stderr,
    )
    sys.exit(1)

# The exec script exits 32 after it has already shown the user an actionable message.
_EXIT_ALREADY_REPORTED = 32
# Same limit the SDK uses for its own gRPC channels: large stack states travel over them.
_MAX_RPC_MESSAGE_SIZE = 1024 * 1024 * 400
_BIN_DIR = os.path.dirname(os.path.realpath(__file__))
EXEC_SCRIPT = os.path.join(_BIN_DIR, "pulumi-language-python-exec")


def sdk_version() -> str:
    return metadata.version("pulumi")


def required_plugins() -> list[tuple[str, str, str]]:
    """(name, version, server) of each resource plugin that an installed package declares it needs."""
    found: dict[str, tuple[str, str, str]] = {}
    for dist in metadata.distributions():
        for file in dist.files or ():
            if file.name != "pulumi-plugin.json":
                continue
            try:
                spec: dict[str, Any] = json.loads(file.read_text())
            except (OSError, ValueError):
                continue
            if not spec.get("resource") or not spec.get("name"):
                continue
            name = str(spec["name"])
            version = str(spec.get("version") or dist.version)
            found[name] = (name, version.removeprefix("v"), str(spec.get("server") or ""))
    return sorted(found.values())


def exec_command(request: Any, engine_address: str) -> list[str]:
    """argv for the SDK's exec script, mirroring what the Go host passes it."""
    info = request.info
    program_dir = info.program_directory or request.pwd
    program = os.path.join(program_dir, info.entry_point or ".")
    argv = [sys.executable, "-u", EXEC_SCRIPT]
    if info.root_directory:
        argv += ["--root_directory", info.root_directory]
    argv += [
        "--project",
        request.project,
        "--stack",
        request.stack,
        "--pwd",
        request.pwd or program_dir,
        "--dry_run",
        "true" if request.dryRun else "false",
        "--parallel",
        str(request.parallel),
        "--monitor",
        request.monitor_address,
        "--engine",
        engine_address,
        "--organization",
        request.organization or "organization",
    ]
    return [*argv, program, *request.args]


class StandInLanguageHost(language_pb2_grpc.LanguageRuntimeServicer):
    def __init__(self, engine_address: str) -> None:
        self.engine_address = engine_address

    def GetPluginInfo(self, request: Any, context: Any) -> Any:
        return plugin_pb2.PluginInfo(version=sdk_version())

    def Handshake(self, request: Any, context: Any) -> Any:
        if request.engine_address:
            self.engine_address = request.engine_address
        return language_pb2.LanguageHandshakeResponse()

    def About(self, request: Any, context: Any) -> Any:
        v = sys.version_info
        return language_pb2.AboutResponse(executable=sys.executable, version=f"{v.major}.{v.minor}.{v.micro}")

    def GetRequiredPlugins(self, request: Any, context: Any) -> Any:
        return language_pb2.GetRequiredPluginsResponse(
            plugins=[
                plugin_pb2.PluginDependency(name=name, kind="resource", version=version, server=server)
                for name, version, server in required_plugins()
            ]
        )

    def GetProgramDependencies(self, request: Any, context: Any) -> Any:
        deps = sorted({(d.metadata["Name"], d.version) for d in metadata.distributions() if d.metadata["Name"]})
        return language_pb2.GetProgramDependenciesResponse(
            dependencies=[language_pb2.DependencyInfo(name=n, version=v) for n, v in deps]
        )

    def InstallDependencies(self, request: Any, context: Any) -> Iterator[Any]:
        yield language_pb2.InstallDependenciesResponse(
            stdout=b"pulumi-language-python (stand-in): dependencies are managed by `make venv`; nothing to do\n"
        )

    def Run(self, request: Any, context: Any) -> Any:
        env = dict(os.environ)
        env["PULUMI_CONFIG"] = json.dumps(dict(request.config))
        env["PULUMI_CONFIG_SECRET_KEYS"] = json.dumps(list(request.configSecretKeys))
        # The program's output goes to our stdout/stderr, which the engine already streams to the user.
        code = subprocess.call(exec_command(request, self.engine_address), env=env, cwd=request.pwd or None)
        if code == 0:
            return language_pb2.RunResponse()
        if code == _EXIT_ALREADY_REPORTED:
            return language_pb2.RunResponse(bail=True)
        return language_pb2.RunResponse(error=f"Program exited with non-zero exit code: {code}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pulumi-language-python")
    parser.add_argument("--logtostderr", action="store_true")
    parser.add_argument("--tracing")
    parser.add_argument("engine_address", nargs="?", default="")
    args, _unknown = parser.parse_known_args(argv)  # e.g. -v=9 from `pulumi -v`
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[
            ("grpc.max_receive_message_length", _MAX_RPC_MESSAGE_SIZE),
            ("grpc.max_send_message_length", _MAX_RPC_MESSAGE_SIZE),
        ],
    )
    language_pb2_grpc.add_LanguageRuntimeServicer_to_server(StandInLanguageHost(args.engine_address), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    # The engine ends its plugins with SIGINT (then a kill): stop serving quietly instead of a traceback.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop(grace=0.5))
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
