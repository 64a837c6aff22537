"""What the weight store renders (`manifest.py`): the staging plan and command, the exports, the NFS volume
options, and the visibility checks, run as scripts with fake docker."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from components.weights import manifest as wm
from components.weights.staging.plan import MAX_STREAMS, RepoPlan, plan_streams
from tests.support.fake_docker import install_fake_docker as _fake_docker
from tests.support.scripts import header_value
from tests.support.staging import (
    ENGRAM_REPO,
    MODEL_REPO,
    PREFIX,
    TOKEN,
    FakeHub,
    fresh_dir,
    run_logged,
    stage_command,
)


def test_plan_selects_every_model_file_and_four_engram_files() -> None:
    plan = wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="main")
    model, engram = (RepoPlan.from_json(r) for r in plan["repos"])
    assert (model.dest, model.files, model.safetensors_count) == ("model", None, 39)
    assert engram.dest == "engram-src"
    assert engram.files == tuple(
        sorted(
            [
                "model-00047-of-00048.safetensors",
                "model-00048-of-00048.safetensors",
                "model.safetensors.index.json",
                "config.json",
            ]
        )
    )
    assert (engram.index_file, engram.index_shard_total) == ("model.safetensors.index.json", 48)
    assert engram.required_shards == ("model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors")


def test_plan_rejects_bad_repo_and_revision() -> None:
    with pytest.raises(ValueError, match="model_repo='nope'"):
        wm.staging_plan(model_repo="nope", engram_repo=ENGRAM_REPO, revision="main")
    with pytest.raises(ValueError, match="revision=''"):
        wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="")


def test_plan_carries_the_download_streams_the_staging_program_reads() -> None:
    plan = wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="main", download_streams=8)
    assert plan_streams(json.loads(json.dumps(plan))) == 8
    unplanned = wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="main")
    assert "download_streams" not in unplanned and plan_streams(unplanned) == 1
    for bad in (0, MAX_STREAMS + 1):
        with pytest.raises(ValueError, match=f"download_streams={bad} must be from 1 to 64"):
            wm.staging_plan(model_repo=MODEL_REPO, engram_repo=ENGRAM_REPO, revision="main", download_streams=bad)


# --- rendering and parsing (pure) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("root", "expected"),
    [
        ("~/dsv41-exl3", '"$HOME"/dsv41-exl3'),
        ("~", '"$HOME"'),
        ("~/a b/", "\"$HOME\"/'a b'"),
        ("/srv/w", "/srv/w"),
    ],
)
def test_root_expands_tilde_on_the_node(root: str, expected: str) -> None:
    assert wm.root_shell_expr(root) == expected
    out = subprocess.run(
        ["sh", "-c", f"printf %s {wm.root_shell_expr(root)}"],
        capture_output=True,
        text=True,
        env={"HOME": "/home/remote", "PATH": os.environ["PATH"]},
        check=True,
    ).stdout
    assert out == root.replace("~", "/home/remote", 1).rstrip("/") or out == "/srv/w"


@pytest.mark.parametrize("root", ["relative/dir", "~other/x", ""])
def test_root_must_be_absolute_or_home(root: str) -> None:
    with pytest.raises(ValueError, match="must be absolute or start with '~/'"):
        wm.root_shell_expr(root)


def test_stage_command_gives_the_token_to_the_container_on_stdin_only_and_is_bounded(tmp_path: Path) -> None:
    cmd = stage_command()
    assert "HF_TOKEN=" not in cmd and TOKEN not in cmd and header_value(cmd, "WITH_TOKEN") == "1"
    ran = run_logged(cmd, tmp_path, stdin=wm.stage_stdin(TOKEN, wm.stage_program_text()))
    bounded = ran.line("timeout ")
    assert bounded.startswith("timeout --kill-after=60 7200 docker run --rm -i "), bounded
    run = ran.line("docker run ")
    assert " -e HF_TOKEN" not in run and " -e HF_ENDPOINT=http://127.0.0.1:9 " in run, (
        "no `-e HF_TOKEN`: docker would copy it into the container's Config.Env (`docker inspect`)"
    )
    assert all(TOKEN not in line for line in ran.argv), "the token must never be in argv"
    assert ran.docker_env == ["HF_TOKEN=unset"] and TOKEN not in ran.docker_environ, (
        "the token is in no environment docker could pass on"
    )
    assert ran.docker_stdin == f"{TOKEN}\n", "the staging program's stdin is the token line, nothing else"
    assert " --network host " in run and " --entrypoint python3 img:tag /stage/stage_weights.pyz " in run
    assert " -e HF_HUB_OFFLINE=0 " in run, "the serving image's offline default must not break staging"
    anonymous = stage_command(with_token=False, hf_endpoint=None)
    assert "HF_TOKEN" not in anonymous.split("\n", 1)[0] and header_value(anonymous, "WITH_TOKEN") == "0"
    ran = run_logged(anonymous, fresh_dir(tmp_path / "anonymous"), stdin=wm.stage_stdin(None, wm.stage_program_text()))
    run = ran.line("docker run ")
    assert "HF_TOKEN" not in run and "HF_ENDPOINT" not in run
    assert ran.docker_env == ["HF_TOKEN=unset"] and ran.docker_stdin == "\n", "anonymous: an empty token line"
    with pytest.raises(ValueError, match="stage_timeout_s=0"):
        stage_command(timeout_s=0)


@pytest.mark.parametrize(
    ("root", "expected"),
    [("~/dsv41-exl3", "{home}/dsv41-exl3"), ("~/a b/", "{home}/a b"), ("{tmp}/srv/w/", "{tmp}/srv/w")],
)
def test_stage_script_expands_tilde_to_the_remote_home(root: str, expected: str, tmp_path: Path) -> None:
    home = fresh_dir(tmp_path / "remote-home").resolve()
    cmd = stage_command(root=root.format(tmp=tmp_path))
    ran = run_logged(cmd, tmp_path, stdin=wm.stage_stdin(None, wm.stage_program_text()), home=home)
    want = expected.format(home=home, tmp=tmp_path.resolve())
    run = ran.line("docker run ")
    assert f" -v {want}:/weights " in run and f" --host-root {want}" in run, run
    assert (Path(want) / "model").is_dir() and (Path(want) / "engram-src").is_dir()


def test_stage_stdin_is_token_line_then_script() -> None:
    assert wm.stage_stdin(TOKEN, "print(1)\n") == f"{TOKEN}\nprint(1)\n"
    assert wm.stage_stdin(None, "x") == "\nx"
    with pytest.raises(ValueError, match="line break") as err:
        wm.stage_stdin("a\nb", "x")
    assert "a\nb" not in str(err.value)


def test_stage_command_runs_end_to_end_with_token_only_on_stdin(hub: FakeHub, tmp_path: Path) -> None:
    """The rendered shell, with a stand-in docker CLI: token from stdin reaches the hub, never argv."""
    log = tmp_path / "docker-argv.log"
    _fake_docker(tmp_path / "bin", log)
    home = tmp_path / "home"
    home.mkdir()
    cmd = stage_command(hf_endpoint=hub.url, timeout_s=120)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(home), "NO_PROXY": "*"}
    proc = subprocess.run(
        ["sh", "-c", cmd],
        input=wm.stage_stdin(TOKEN, wm.stage_program_text()),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged = wm.parse_stage_output(proc.stdout)
    assert staged.root == str((home / "dsv41-exl3").resolve()), "root is expanded on the node, absolute"
    assert (home / "dsv41-exl3" / "model" / "config.json").is_file()
    assert {a for _, _, a in hub.requests} == {f"Bearer {TOKEN}"}
    assert TOKEN not in log.read_text(), "the token must never be in docker's argv"
    container_env = [json.loads(ln) for ln in Path(f"{log}.env").read_text().splitlines()]
    assert container_env and all(TOKEN not in json.dumps(e) for e in container_env), (
        "the token must not be in the container's environment (its Config.Env, which `docker inspect` shows)"
    )
    assert TOKEN not in cmd


def test_parse_stage_output_takes_the_marker_line() -> None:
    out = "pulling...\nDSV41_WEIGHTS_MANIFEST " + json.dumps({"root": "/r", "files": {"b": 2, "a": 1}}) + "\n"
    staged = wm.parse_stage_output(out)
    assert staged.root == "/r" and list(staged.files) == ["a", "b"]
    assert json.loads(staged.manifest_json()) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="no 'DSV41_WEIGHTS_MANIFEST' line"):
        wm.parse_stage_output("Traceback ...")
    with pytest.raises(ValueError, match="root='rel'"):
        wm.parse_stage_output('DSV41_WEIGHTS_MANIFEST {"root": "rel", "files": {"a": 1}}')
    with pytest.raises(ValueError, match="no files"):
        wm.parse_stage_output('DSV41_WEIGHTS_MANIFEST {"root": "/r", "files": {}}')


def test_parse_stage_output_reads_what_staging_dropped_from_the_page_cache() -> None:
    line = {"root": "/r", "files": {"a": 1}, "page_cache": {"files": 47, "bytes": 415_000_000_000, "failed": 0}}
    staged = wm.parse_stage_output("DSV41_WEIGHTS_MANIFEST " + json.dumps(line))
    assert staged.page_cache == wm.PageCacheDropped(files=47, bytes=415_000_000_000, failed=0)
    older = wm.parse_stage_output('DSV41_WEIGHTS_MANIFEST {"root": "/r", "files": {"a": 1}}')
    assert older.page_cache is None, "a stack's state keeps an older staging script's output: it dropped nothing"
    for bad in ({"files": 1}, {"files": -1, "bytes": 0, "failed": 0}, {"files": True, "bytes": 0, "failed": 0}, 3):
        with pytest.raises(ValueError, match="page_cache="):
            wm.parse_stage_output("DSV41_WEIGHTS_MANIFEST " + json.dumps({**line, "page_cache": bad}))


def test_exports_are_read_only_and_limited_to_worker_ips() -> None:
    text = wm.render_exports("/home/u/dsv41-exl3", ["10.0.0.2", "10.0.0.3"])
    line = text.splitlines()[-1]
    assert line == '"/home/u/dsv41-exl3" 10.0.0.2(ro,sync,no_subtree_check) 10.0.0.3(ro,sync,no_subtree_check)'
    assert "*" not in text
    with pytest.raises(ValueError, match="worker fabric_ip='worker1'"):
        wm.render_exports("/r", ["worker1"])
    assert "# export: 10.0.0.2 /home/u/dsv41-exl3\n# export: 10.0.0.3 /home/u/dsv41-exl3\n" in text


def test_nfs_volume_options() -> None:
    opts = wm.nfs_volume_options(head_ip="10.0.0.1", device_path="/home/u/dsv41-exl3/model")
    assert opts == {
        "type": "nfs",
        "device": ":/home/u/dsv41-exl3/model",
        "o": "addr=10.0.0.1,nfsvers=4.2,ro,nconnect=8,rsize=1048576,wsize=1048576,hard,timeo=600",
    }
    other = wm.nfs_volume_options(head_ip="10.0.0.9", device_path="/home/u/dsv41-exl3/model")
    assert wm.volume_name("ws-w1", "model", opts) != wm.volume_name("ws-w1", "model", other)
    assert wm.volume_name("ws-w1", "model", opts) == wm.volume_name("ws-w1", "model", dict(opts))


# What a rank reads, as a volume check is given it: model/ and the slim Engram directory.
SERVED = {"model/a": 1, "engram-vllm/model.safetensors.index.json": 2}


def _staged_tree(root: Path) -> dict[str, int]:
    files = {
        "model/a.safetensors": 5,
        "model/config.json": 2,
        "engram-src/model-00047-of-00048.safetensors": 3,
        "engram-src/model.safetensors.index.json": 9,
        "engram-vllm/model-00047-of-00048.safetensors": 3,
        "engram-vllm/model.safetensors.index.json": 4,
    }
    for rel, size in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * size)
    return files


def test_bind_check_passes_when_every_file_is_visible(tmp_path: Path) -> None:
    files = _staged_tree(tmp_path)
    cmd = wm.render_bind_check(node="head", abs_root=str(tmp_path), files=files, timeout_s=30)
    proc = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "weights visible on node head: 6 files" in proc.stdout, "the head sees every staged file"


def test_bind_check_fails_naming_node_and_missing_files(tmp_path: Path) -> None:
    files = _staged_tree(tmp_path)
    (tmp_path / "model/a.safetensors").write_bytes(b"x")  # wrong size
    (tmp_path / "engram-src/model-00047-of-00048.safetensors").unlink()
    cmd = wm.render_bind_check(node="spark-2", abs_root=str(tmp_path), files=files, timeout_s=30)
    proc = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    summary = proc.stderr.strip().splitlines()[-1]
    assert "weights not visible on node spark-2" in summary
    assert "model/a.safetensors" in summary and "engram-src/model-00047-of-00048.safetensors" in summary
    assert "model/config.json" not in summary
    assert "found missing" in proc.stderr and "expected 5 bytes, found 1" in proc.stderr


def test_volume_check_mounts_both_volumes_read_only_and_is_bounded(tmp_path: Path) -> None:
    cmd = wm.render_volume_check(
        node="w1",
        image="sha256:abc",
        model_volume="ws-w1-model-1",
        engram_volume="ws-w1-engram-src-2",
        files={**SERVED, "engram-src/model.safetensors.index.json": 9},
        timeout_s=45,
        stack_prefix=PREFIX,
    )
    ran = run_logged(cmd, tmp_path)
    bounded = ran.line("timeout ")
    assert bounded.startswith("timeout --kill-after=30 45 docker run --rm -i "), bounded
    assert " -v ws-w1-model-1:/w/model:ro " in bounded and " -v ws-w1-engram-src-2:/w/engram-vllm:ro " in bounded, (
        "the engram volume is the slim Engram directory: it mounts where the listing names its files"
    )
    assert " --entrypoint sh " in bounded and bounded.endswith(" sha256:abc -s")
    inner = header_value(cmd, "SIZE_CHECK", as_text=True)
    assert ran.docker_stdin == inner, "the size check reaches the container's sh on stdin"
    assert header_value(inner, "FILES", as_text=True) == "2 engram-vllm/model.safetensors.index.json\n1 model/a\n", (
        "through the volumes only what a rank reads is checked: never engram-src/"
    )
    assert header_value(inner, "WEIGHTS_ROOT") == "/w"


def test_served_files_are_model_and_the_slim_engram_directory() -> None:
    staged = {**SERVED, "engram-src/model.safetensors.index.json": 9, "engram-src/config.json": 3}
    assert wm.served_files(staged) == SERVED
    with pytest.raises(ValueError, match=r"no engram-vllm/model.safetensors.index.json .*run staging again"):
        wm.served_files({"model/a": 1, "engram-src/model.safetensors.index.json": 9})


def test_volume_check_script_runs_inside_the_container_root(tmp_path: Path) -> None:
    """Run the volume check with a docker stand-in that maps the two volumes to directories."""
    files = _staged_tree(tmp_path / "head")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        f"#!/bin/sh\n[ \"$1\" = run ] || exit 0\nsed 's# WEIGHTS_ROOT=/w;# WEIGHTS_ROOT={tmp_path}/head;#' | sh -s\n"
    )
    (bin_dir / "docker").chmod(0o755)
    cmd = wm.render_volume_check(
        node="w1", image="img", model_volume="m", engram_volume="e", files=files, timeout_s=30, stack_prefix=PREFIX
    )
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    ok = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30, env=env)
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "head/engram-src/model.safetensors.index.json").unlink()
    ok = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30, env=env)
    assert ok.returncode == 0, "a worker's volumes do not show engram-src/: it is not checked there"
    (tmp_path / "head/model/config.json").unlink()
    (tmp_path / "head/engram-vllm/model.safetensors.index.json").unlink()
    bad = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30, env=env)
    assert bad.returncode == 1 and "node w1" in bad.stderr and "model/config.json" in bad.stderr
    assert "engram-vllm/model.safetensors.index.json" in bad.stderr


def test_check_timeout_names_the_node(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\n[ "$1" = run ] || exit 0\nexec sleep 30\n')
    (bin_dir / "docker").chmod(0o755)
    cmd = wm.render_volume_check(
        node="w9",
        image="img",
        model_volume="m",
        engram_volume="e",
        files=SERVED,
        timeout_s=1,
        stack_prefix=PREFIX,
    )
    proc = subprocess.run(
        ["sh", "-c", cmd], capture_output=True, text=True, timeout=60, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    )
    assert proc.returncode == 124
    assert "weights check on node w9 timed out after 1s" in proc.stderr


def test_stage_timeout_fails_with_resume_hint(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\n[ "$1" = run ] || exit 0\nexec sleep 30\n')
    (bin_dir / "docker").chmod(0o755)
    proc = subprocess.run(
        ["sh", "-c", stage_command(timeout_s=1)],
        input=wm.stage_stdin(None, wm.stage_program_text()),
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 124
    assert "weights staging timed out after 1s on the head; raise stage_timeout_s" in proc.stderr
