"""The project's own program and verifier through the real engine (the CLI built by `make toolchain`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pulumi
import pytest
from pulumi import automation as auto

from components.verify.verifier import Verifier, VerifierArgs
from tests.support.fake_vllm import FakeVllm, Reply, chat_body, good_items, with_literal

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def project_copy(tmp_path: Path) -> Path:
    """The program as a user has it (no state, no venv): __main__, components, the stack files."""
    dest = tmp_path / "project"
    dest.mkdir()
    for name in ("__main__.py", "Pulumi.yaml", "Pulumi.dev.yaml"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "components", dest / "components", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")  # the type checker's settings
    if (ROOT / ".mypy_cache").is_dir():  # as warm as the user's own tree after `make typecheck`
        shutil.copytree(ROOT / ".mypy_cache", dest / ".mypy_cache")
    # Pulumi.yaml's `virtualenv: venv`: the venv running these tests (`make test-python` runs them under another)
    (dest / "venv").symlink_to(sys.prefix)
    return dest


def fake_ssh_on_path(tmp_path: Path, env: dict[str, str]) -> Path:
    """An `ssh` that records every call: the unfilled preview must open no connection."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    log = tmp_path / "ssh-calls.log"
    ssh = bin_dir / "ssh"
    ssh.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 255\n')
    ssh.chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return log


def test_unfilled_dev_preview_fails_fast_naming_every_missing_key(
    pulumi_root: Path, engine_env: dict[str, str], standin_language_host: Path, tmp_path: Path
) -> None:
    project = project_copy(tmp_path)
    env = dict(engine_env)
    ssh_log = fake_ssh_on_path(tmp_path, env)
    pulumi = str(pulumi_root / "bin" / "pulumi")
    init = subprocess.run(
        [pulumi, "stack", "init", "dev", "--non-interactive"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert init.returncode == 0, init.stdout + init.stderr
    start = time.monotonic()
    proc = subprocess.run(
        [pulumi, "preview", "--stack", "dev", "--non-interactive"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for node in (0, 1):
        for key in ("host", "user", "fabricIp"):
            assert f"`nodes[{node}].{key}`" in out, f"nodes[{node}].{key} not named:\n{out}"
    assert "`ssh` has neither `privateKey` nor `agentSocket`" in out
    assert "Traceback" not in out, "a config error is a list of fixes, not a stack trace"
    assert not ssh_log.exists(), f"the preview opened a connection: {ssh_log.read_text()}"
    assert elapsed < 20, f"failing on config took {elapsed:.1f} s; it must fail within seconds"


def verifier_stack(pulumi_root: Path, env: dict[str, str], tmp_path: Path, endpoint: str, rerun: list[str]) -> Any:
    def program() -> None:
        v = Verifier(
            "verify",
            VerifierArgs(
                endpoint=endpoint,
                model="fake-model",
                rerun_on=rerun,
                api_key=None,
                timeout_s=5,
                retry_window_s=5,
                min_decode_tokens_per_second=None,
                warmup_timeout_s=None,
                expected_answer="Paris",
                rollback_command="",
            ),
        )
        pulumi.export("answer", v.answer)
        pulumi.export("logprobs", v.logprobs)

    return auto.create_or_select_stack(
        "verify-" + uuid.uuid5(uuid.NAMESPACE_URL, str(tmp_path)).hex[:8],
        project_name="dsv41-exl3-engine-test",
        program=program,
        opts=auto.LocalWorkspaceOptions(
            work_dir=str(tmp_path),
            pulumi_command=auto.PulumiCommand(root=str(pulumi_root)),
            env_vars={**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"},
        ),
    )


def test_verifier_blocks_on_real_logprobs_and_reruns_only_on_container_change(
    pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as server:
        stack = verifier_stack(pulumi_root, engine_env, tmp_path, server.url, ["c1", "c2"])
        up = stack.up()
        assert up.summary.result == "succeeded"
        assert up.outputs["answer"].value == "Paris."
        assert all(isinstance(x["logprob"], float) and x["logprob"] <= 0 for x in up.outputs["logprobs"].value)
        assert len(server.completion_requests()) == 1

        again = stack.up()
        assert again.summary.resource_changes == {"same": 2}
        assert len(server.completion_requests()) == 1, "an unchanged deployment must not be re-verified"

        stack = verifier_stack(pulumi_root, engine_env, tmp_path, server.url, ["c1", "c3"])
        changed = stack.up()
        assert changed.summary.resource_changes == {"same": 1, "update": 1}
        assert len(server.completion_requests()) == 2, "a replaced container must be re-verified"
        stack.destroy()


def test_nan_from_the_model_fails_the_update_with_the_diagnosis(
    pulumi_root: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    nan = with_literal(chat_body(good_items()), "NaN")
    with FakeVllm(Reply(body=nan)) as server:
        stack = verifier_stack(pulumi_root, engine_env, tmp_path, server.url, ["c1"])
        with pytest.raises(auto.CommandError) as err:
            stack.up()
        assert "NaN" in str(err.value)
        assert len(server.completion_requests()) == 1, "NaN is never retried"
