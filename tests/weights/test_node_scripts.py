"""The weight store's node scripts with a fake head: exports that touch only this stack, roots refused on
the node, containers named per stack."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from components.weights import local_copy as lc
from components.weights import manifest as wm
from tests.support.fake_docker import install_fake_docker as _fake_docker
from tests.support.scripts import header_value
from tests.support.staging import (
    PREFIX,
    fresh_dir,
    run_logged,
    stage_command,
)

# --- per-stack names and exports that touch only this stack (issue 12, item 10) -----------------------

OTHER = "dsv41-exl3-prod"


@pytest.fixture
def head(tmp_path: Path) -> dict[str, str]:
    """A fake head: exportfs and systemctl that log their argv, sudo that just runs, a temp exports.d."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    for name, body in (
        ("exportfs", f'echo "exportfs $*" >> {log}\n'),
        ("systemctl", "exit 0\n"),
        ("sudo", '[ "$1" = -n ] && shift\nexec "$@"\n'),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "home").mkdir()
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "TEST_EXPORTS_DIR": str(tmp_path / "exports.d"),
        "CALLS": str(log),
    }


def sh(script: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    for shell in ("sh", "bash"):
        syntax = subprocess.run([shell, "-n", "-c", script], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{shell} -n: {syntax.stderr}"
    return subprocess.run(["sh", "-c", script], env=env, input=stdin, capture_output=True, text=True, timeout=60)


def calls(env: dict[str, str]) -> list[str]:
    path = Path(env["CALLS"])
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return lines


def export(env: dict[str, str], root: Path, ips: list[str], prefix: str = PREFIX) -> subprocess.CompletedProcess[str]:
    return sh(
        wm.render_export_command(
            head_name="head",
            abs_root=str(root),
            worker_ips=ips,
            stack_prefix=prefix,
            exports_dir=env["TEST_EXPORTS_DIR"],
        ),
        env,
    )


def test_two_stacks_export_their_own_entries_and_never_resync_the_host(head: dict[str, str], tmp_path: Path) -> None:
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    root_a.mkdir()
    root_b.mkdir()
    assert export(head, root_a, ["10.0.0.2"]).returncode == 0
    assert calls(head) == [f"exportfs -o ro,sync,no_subtree_check 10.0.0.2:{root_a}"]
    proc = export(head, root_b, ["10.0.0.3"], prefix=OTHER)
    assert proc.returncode == 0, proc.stderr
    assert calls(head) == [f"exportfs -o ro,sync,no_subtree_check 10.0.0.3:{root_b}"], "no -ra: only our entry"
    exports = Path(head["TEST_EXPORTS_DIR"])
    assert sorted(p.name for p in exports.iterdir()) == sorted([f"{OTHER}.exports", f"{PREFIX}.exports"])
    assert f'"{root_a}" 10.0.0.2(ro,sync,no_subtree_check)' in (exports / f"{PREFIX}.exports").read_text()

    unexport = wm.render_unexport_command(
        abs_root=str(root_a), worker_ips=["10.0.0.2"], stack_prefix=PREFIX, exports_dir=head["TEST_EXPORTS_DIR"]
    )
    assert sh(unexport, head).returncode == 0
    assert calls(head) == [f"exportfs -u 10.0.0.2:{root_a}"], "destroying one stack withdraws only its entry"
    assert sorted(p.name for p in exports.iterdir()) == [f"{OTHER}.exports"]


def test_export_change_withdraws_only_the_entries_this_stack_no_longer_exports(
    head: dict[str, str], tmp_path: Path
) -> None:
    root = tmp_path / "w"
    root.mkdir()
    assert export(head, root, ["10.0.0.2", "10.0.0.3"]).returncode == 0
    calls(head)
    assert export(head, root, ["10.0.0.3"]).returncode == 0
    assert calls(head) == [f"exportfs -u 10.0.0.2:{root}", f"exportfs -o ro,sync,no_subtree_check 10.0.0.3:{root}"]


def test_legacy_export_file_is_removed_only_when_it_holds_exactly_this_export(
    head: dict[str, str], tmp_path: Path
) -> None:
    exports = Path(head["TEST_EXPORTS_DIR"])
    exports.mkdir()
    legacy = exports / wm.LEGACY_EXPORTS_NAME
    root = tmp_path / "w"
    root.mkdir()
    legacy.write_text(wm.legacy_exports(str(tmp_path / "someone-else"), ["10.0.0.9"]))
    assert export(head, root, ["10.0.0.2"]).returncode == 0
    assert legacy.exists(), "another stack's export (an earlier version's shared file) is left alone"
    legacy.write_text(wm.legacy_exports(str(root), ["10.0.0.2"]))
    assert export(head, root, ["10.0.0.2"]).returncode == 0
    assert not legacy.exists(), "our own export moved to our per-stack file"
    assert (exports / f"{PREFIX}.exports").exists()


@pytest.mark.parametrize("which", ["slash", "home", "link-to-home"])
def test_staging_and_export_refuse_a_root_that_is_slash_or_home_on_the_node(
    which: str, head: dict[str, str], tmp_path: Path
) -> None:
    home = Path(head["HOME"])
    (tmp_path / "link").symlink_to(home)
    root = {"slash": "/", "home": "~", "link-to-home": str(tmp_path / "link")}[which]
    log = tmp_path / "docker-argv.log"
    _fake_docker(tmp_path / "docker-bin", log)
    env = {**head, "PATH": f"{tmp_path / 'docker-bin'}:{head['PATH']}"}
    proc = sh(stage_command(root=root), env, stdin=wm.stage_stdin(None, wm.stage_program_text()))
    assert proc.returncode == 1
    assert "is / or the home directory of" in proc.stderr and "use a directory of its own" in proc.stderr
    assert not log.exists(), "refused before any container runs"
    assert not (home / "model").exists() and not Path("/model").exists(), "nothing is created there"
    abs_root = "/" if which == "slash" else str(home.resolve())
    refused = export(head, Path(abs_root), ["10.0.0.2"])
    assert refused.returncode == 1 and "is / or the home directory of" in refused.stderr
    assert calls(head) == [] and not Path(head["TEST_EXPORTS_DIR"]).exists(), "nothing exported"


def test_staging_and_the_copy_refuse_a_root_resolving_to_a_path_docker_v_would_split(
    head: dict[str, str], tmp_path: Path
) -> None:
    odd = tmp_path / "a:b,c"
    odd.mkdir()
    (tmp_path / "link").symlink_to(odd)  # config cannot see this: the node resolves it
    log = tmp_path / "docker-argv.log"
    _fake_docker(tmp_path / "docker-bin", log)
    env = {**head, "PATH": f"{tmp_path / 'docker-bin'}:{head['PATH']}"}
    proc = sh(stage_command(root=str(tmp_path / "link")), env, stdin=wm.stage_stdin(None, wm.stage_program_text()))
    assert proc.returncode == 1 and f"weights root {odd} on the head holds ':' or ','" in proc.stderr
    assert "(weights.root)" in proc.stderr
    copy = lc.render_copy_command(
        node="w1",
        copy_root=str(tmp_path / "link"),
        source="http://10.0.0.1:1",
        source_ident="m:1:2",
        bind="10.0.0.2",
        image="img",
        container="c",
        streams=1,
        timeout_s=60,
    )
    proc = sh(copy, env, stdin='{"token": "t"}\n')
    assert proc.returncode == 1 and f"copy root {odd} on w1 holds ':' or ','" in proc.stderr
    assert "(weights.copyRoot)" in proc.stderr
    assert not log.exists(), "refused before any container runs"
    assert list(odd.iterdir()) == [], "nothing is created there"


def test_stage_and_check_containers_are_named_per_stack(tmp_path: Path) -> None:
    cmd = stage_command()
    assert header_value(cmd, "CONTAINER") == f"{PREFIX}-stage-weights" and "dsv41-exl3-stage-weights" not in cmd
    ran = run_logged(cmd, fresh_dir(tmp_path / "stage"), stdin=wm.stage_stdin(None, wm.stage_program_text()))
    assert ran.line("docker rm ") == f"docker rm -f {PREFIX}-stage-weights"
    assert ran.line("docker run ").startswith(f"docker run --rm -i --name {PREFIX}-stage-weights ")
    check = wm.render_volume_check(
        node="w1",
        image="img",
        model_volume="m",
        engram_volume="e",
        files={"model/a": 1, "engram-vllm/model.safetensors.index.json": 2},
        stack_prefix=OTHER,
    )
    assert header_value(check, "CONTAINER") == f"{OTHER}-weights-check"
    ran = run_logged(check, fresh_dir(tmp_path / "check"))
    assert ran.line("docker rm ") == f"docker rm -f {OTHER}-weights-check"
    assert ran.line("docker run ").startswith(f"docker run --rm -i --name {OTHER}-weights-check ")
    with pytest.raises(ValueError, match="stack_prefix='a b'"):
        stage_command(stack_prefix="a b")
