"""Engine tests: the Pulumi CLI built by toolchain/build.sh runs real updates (no cloud, no downloads)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from engine_file_resource import ScratchFile
from engine_support import read_versions
from pulumi import automation as auto

pytestmark = pytest.mark.engine

PULUMI_VERSION = read_versions()["PULUMI_VERSION"]


def _pulumi(pulumi_root: Path, env: dict[str, str], *args: str, cwd: Path, check: bool = True) -> str:
    proc = subprocess.run(
        [str(pulumi_root / "bin" / "pulumi"), *args, "--non-interactive"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"pulumi {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def test_cli_reports_pinned_version(pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path) -> None:
    out = subprocess.run(
        [str(pulumi_root / "bin" / "pulumi"), "version"], env=engine_env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"v{PULUMI_VERSION}"
    # The Automation API accepts this CLI (it refuses an unstamped one).
    assert str(auto.PulumiCommand(root=str(pulumi_root)).version) == PULUMI_VERSION


def test_dynamic_resource_up_noop_destroy(pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "made-by-dynamic-provider.txt"

    def program() -> None:
        ScratchFile("scratch", path=str(target), text="written by the engine")

    stack = auto.create_stack(
        f"dyn-{uuid.uuid4().hex[:8]}",
        project_name="engine-test",
        program=program,
        opts=auto.LocalWorkspaceOptions(
            work_dir=str(tmp_path),
            pulumi_command=auto.PulumiCommand(root=str(pulumi_root)),
            env_vars=engine_env,
        ),
    )
    try:
        first = stack.up(on_output=lambda _line: None)
        assert first.summary.result == "succeeded"
        assert first.summary.resource_changes == {"create": 2}
        assert target.read_text() == "written by the engine"

        second = stack.up(on_output=lambda _line: None)
        assert second.summary.resource_changes == {"same": 2}

        destroyed = stack.destroy(on_output=lambda _line: None)
        assert destroyed.summary.resource_changes == {"delete": 2}
        assert not target.exists()
    finally:
        stack.workspace.remove_stack(stack.name, force=True)


def _write_project(directory: Path, main: str) -> None:
    directory.mkdir()
    (directory / "Pulumi.yaml").write_text("name: standin-probe\nruntime: python\n")
    (directory / "__main__.py").write_text(textwrap.dedent(main))


@pytest.mark.usefixtures("standin_language_host")
def test_file_project_runs_through_standin_language_host(
    pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    project = tmp_path / "project"
    _write_project(
        project,
        """
        import pulumi
        cfg = pulumi.Config()
        pulumi.export("greeting", "hello " + cfg.require("who"))
        pulumi.export("dry_run", pulumi.runtime.is_dry_run())
        """,
    )
    stack = f"cli-{uuid.uuid4().hex[:8]}"
    _pulumi(pulumi_root, engine_env, "stack", "init", stack, cwd=project)
    _pulumi(pulumi_root, engine_env, "config", "set", "who", "engine", cwd=project)

    preview = _pulumi(pulumi_root, engine_env, "preview", cwd=project)
    assert "hello engine" in preview
    _pulumi(pulumi_root, engine_env, "up", "--yes", "--skip-preview", cwd=project)
    outputs = json.loads(_pulumi(pulumi_root, engine_env, "stack", "output", "--json", cwd=project))
    assert outputs == {"greeting": "hello engine", "dry_run": False}

    # The host reports the provider plugins that the installed SDK packages request (pulumi-plugin.json).
    about = json.loads(_pulumi(pulumi_root, engine_env, "about", "--json", cwd=project))
    plugins = {(p["name"], p["version"]) for p in about["plugins"]}
    assert ("docker", read_versions()["DOCKER_PROVIDER_VERSION"]) in plugins
    assert ("command", read_versions()["COMMAND_PROVIDER_VERSION"]) in plugins


@pytest.mark.usefixtures("standin_language_host")
def test_failing_program_fails_the_preview(pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path) -> None:
    project = tmp_path / "project"
    _write_project(project, 'raise RuntimeError("boom from the test program")\n')
    _pulumi(pulumi_root, engine_env, "stack", "init", f"fail-{uuid.uuid4().hex[:8]}", cwd=project)
    proc = subprocess.run(
        [str(pulumi_root / "bin" / "pulumi"), "preview", "--non-interactive"],
        cwd=project,
        env=engine_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    assert "boom from the test program" in proc.stdout + proc.stderr


def _layered_venv(path: Path) -> Path:
    """A venv of its own (no pip) that sees the test's packages through a .pth: quick to make."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = next((path / "lib").glob("python3*/site-packages"))
    (site / "layered.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    return path


@pytest.mark.usefixtures("standin_language_host")
def test_language_host_runs_the_program_in_the_configured_virtualenv(
    pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    project = tmp_path / "project"
    _write_project(project, 'import sys\nimport pulumi\npulumi.export("prefix", sys.prefix)\n')
    venv = _layered_venv(project / "program-venv")
    (project / "Pulumi.yaml").write_text(
        "name: standin-probe\nruntime:\n  name: python\n  options:\n    virtualenv: program-venv\n"
    )
    _pulumi(pulumi_root, engine_env, "stack", "init", f"venv-{uuid.uuid4().hex[:8]}", cwd=project)
    _pulumi(pulumi_root, engine_env, "up", "--yes", "--skip-preview", cwd=project)
    outputs = json.loads(_pulumi(pulumi_root, engine_env, "stack", "output", "--json", cwd=project))
    assert Path(outputs["prefix"]).resolve() == venv.resolve(), "the program must run with the virtualenv's Python"

    # A virtualenv option that names no venv fails with the fix, before anything runs.
    (project / "Pulumi.yaml").write_text(
        "name: standin-probe\nruntime:\n  name: python\n  options:\n    virtualenv: no-such-venv\n"
    )
    proc = subprocess.run(
        [str(pulumi_root / "bin" / "pulumi"), "preview", "--non-interactive"],
        cwd=project,
        env=engine_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    assert "no-such-venv" in proc.stdout + proc.stderr and "not a virtual environment" in proc.stdout + proc.stderr


@pytest.mark.usefixtures("standin_language_host")
def test_language_host_type_checks_before_running(
    pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    project = tmp_path / "project"
    marker = tmp_path / "program-ran"
    _write_project(
        project, f'import pathlib\npathlib.Path({str(marker)!r}).write_text("ran")\ncount: int = "not a number"\n'
    )
    _layered_venv(project / "program-venv")
    (project / "Pulumi.yaml").write_text(
        "name: standin-probe\nruntime:\n  name: python\n  options:\n    virtualenv: program-venv\n"
        "    typechecker: mypy\n"
    )
    (project / "mypy.ini").write_text("[mypy]\nfiles = __main__.py\n")
    _pulumi(pulumi_root, engine_env, "stack", "init", f"tc-{uuid.uuid4().hex[:8]}", cwd=project)
    proc = subprocess.run(
        [str(pulumi_root / "bin" / "pulumi"), "preview", "--non-interactive"],
        cwd=project,
        env=engine_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0, "a type error must fail the preview"
    assert "mypy type checking failed" in proc.stdout + proc.stderr
    assert "Incompatible types in assignment" in proc.stdout + proc.stderr
    assert not marker.exists(), "the program must not run when type checking fails"

    # Fixed, the same project previews.
    (project / "__main__.py").write_text("count: int = 3\n")
    _pulumi(pulumi_root, engine_env, "preview", cwd=project)
