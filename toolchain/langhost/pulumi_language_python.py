#!/usr/bin/env python3
"""Stand-in for Pulumi's Go language host `pulumi-language-python`, which the Go module proxy does not serve.

The engine starts `pulumi-language-python [--logtostderr] [-v=N] [--tracing URL] ENGINE_ADDRESS` in the
program directory and reads the gRPC port from the first line of stdout. This host serves the
LanguageRuntime calls a file-based `pulumi preview`/`up`/`destroy` needs:

- Run: runs the program the way the real host does, through the SDK's own `pulumi-language-python-exec`
  (installed next to this file), with config passed in PULUMI_CONFIG / PULUMI_CONFIG_SECRET_KEYS.
- GetRequiredPlugins: the resource plugins named by installed packages' `pulumi-plugin.json`.
- GetPluginInfo, About, GetProgramDependencies, InstallDependencies (no-op: `make venv` manages the venv).

Runtime options of Pulumi.yaml, as the Go host reads them:
- `virtualenv: DIR` (relative to the project root): the program, the plugin list and the type checker use that
  venv's Python; a DIR that is not a venv fails the run with the fix. Without it, the Python running this host.
- `typechecker: mypy|pyright`: runs before the program, in the project root; a type error fails the preview
  or update before any resource is registered.
- `toolchain`: only `pip` (the venv is made by `make venv`, not by `pulumi install`).
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
    from google.protobuf import json_format
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


class ProgramError(Exception):
    """A problem with the project's runtime options, reported to the user as the run's error."""


def runtime_options(info: Any) -> dict[str, Any]:
    """The `runtime.options` of Pulumi.yaml, as the engine passes them in ProgramInfo."""
    if info is None or not info.HasField("options"):
        return {}
    return dict(json_format.MessageToDict(info.options))


def program_python(info: Any) -> str:
    """The interpreter the program runs with: the `virtualenv` option's, else this host's."""
    venv = runtime_options(info).get("virtualenv")
    if not venv:
        return sys.executable
    root = info.root_directory or info.program_directory or os.getcwd()
    path = venv if os.path.isabs(venv) else os.path.join(root, venv)
    python = os.path.join(path, "bin", "python")
    if not os.access(python, os.X_OK):
        raise ProgramError(
            f"The 'virtualenv' option in Pulumi.yaml is set to {venv!r}, but {path} is not a virtual environment "
            f"(no bin/python); create it with `make venv`"
        )
    return python


def site_packages(python: str) -> list[str] | None:
    """The venv's site-packages for `python`, or None for this host's own interpreter."""
    if python == sys.executable:
        return None
    prefix = os.path.dirname(os.path.dirname(python))
    lib = os.path.join(prefix, "lib")
    found = (
        [os.path.join(lib, d, "site-packages") for d in sorted(os.listdir(lib)) if d.startswith("python")]
        if os.path.isdir(lib)
        else []
    )
    paths = list(found)
    for sp in found:  # .pth files may add more paths (e.g. an editable or layered venv)
        for pth in sorted(f for f in os.listdir(sp) if f.endswith(".pth")):
            with open(os.path.join(sp, pth)) as f:
                paths += [line.strip() for line in f if line.strip() and not line.startswith(("#", "import"))]
    return [p for p in paths if os.path.isdir(p)]


def type_check(info: Any, python: str) -> str | None:
    """Runs the `typechecker` option's checker in the project root; returns an error message on failure."""
    checker = runtime_options(info).get("typechecker")
    if not checker:
        return None
    if checker not in ("mypy", "pyright"):
        return f"The 'typechecker' option in Pulumi.yaml must be mypy or pyright, not {checker!r}"
    root = info.root_directory or info.program_directory or os.getcwd()
    # mypy reads its targets from the project's config (pyproject.toml [tool.mypy] files).
    proc = subprocess.run([python, "-m", checker], cwd=root, capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    sys.stderr.write(proc.stdout + proc.stderr)
    sys.stderr.flush()
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-20:]
    return f"{checker} type checking failed (exit {proc.returncode}); the program was not run:\n" + "\n".join(tail)


def required_plugins(path: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(name, version, server) of each resource plugin that an installed package declares it needs."""
    found: dict[str, tuple[str, str, str]] = {}
    for dist in metadata.distributions(path=path) if path is not None else metadata.distributions():
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


def exec_command(request: Any, engine_address: str, python: str) -> list[str]:
    """argv for the SDK's exec script, mirroring what the Go host passes it."""
    info = request.info
    program_dir = info.program_directory or request.pwd
    program = os.path.join(program_dir, info.entry_point or ".")
    argv = [python, "-u", EXEC_SCRIPT]
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
        self.programs: set[subprocess.Popen[bytes]] = set()
        """Programs running now: ended with the host, so the engine is not left waiting for them."""

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
        try:
            path = site_packages(program_python(request.info))
        except ProgramError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return language_pb2.GetRequiredPluginsResponse(
            plugins=[
                plugin_pb2.PluginDependency(name=name, kind="resource", version=version, server=server)
                for name, version, server in required_plugins(path)
            ]
        )

    def GetProgramDependencies(self, request: Any, context: Any) -> Any:
        try:
            path = site_packages(program_python(request.info))
        except ProgramError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        dists = metadata.distributions(path=path) if path is not None else metadata.distributions()
        deps = sorted({(d.metadata["Name"], d.version) for d in dists if d.metadata["Name"]})
        return language_pb2.GetProgramDependenciesResponse(
            dependencies=[language_pb2.DependencyInfo(name=n, version=v) for n, v in deps]
        )

    def InstallDependencies(self, request: Any, context: Any) -> Iterator[Any]:
        yield language_pb2.InstallDependenciesResponse(
            stdout=b"pulumi-language-python (stand-in): dependencies are managed by `make venv`; nothing to do\n"
        )

    def Run(self, request: Any, context: Any) -> Any:
        try:
            python = program_python(request.info)
        except ProgramError as err:
            return language_pb2.RunResponse(error=str(err))
        failed = type_check(request.info, python)
        if failed:
            return language_pb2.RunResponse(error=failed)
        env = dict(os.environ)
        env["PULUMI_CONFIG"] = json.dumps(dict(request.config))
        env["PULUMI_CONFIG_SECRET_KEYS"] = json.dumps(list(request.configSecretKeys))
        # The program's output goes to our stdout/stderr, which the engine already streams to the user.
        program = subprocess.Popen(exec_command(request, self.engine_address, python), env=env, cwd=request.pwd or None)
        self.programs.add(program)
        try:
            code = program.wait()
        finally:
            self.programs.discard(program)
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
    host = StandInLanguageHost(args.engine_address)
    language_pb2_grpc.add_LanguageRuntimeServicer_to_server(host, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)

    # The engine ends its plugins with SIGINT, and kills them 5 s later: end any program still running (after a
    # failed update it may be waiting on the engine), stop serving and exit at once, so the engine never waits.
    def stop(*_: Any) -> None:
        for program in list(host.programs):
            program.terminate()
        server.stop(grace=0.5).wait(1.0)
        sys.stdout.flush()
        os._exit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
