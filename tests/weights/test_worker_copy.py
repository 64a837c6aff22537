"""WorkerCopy's provider: both ends over ssh (a stand-in `ssh` that records argv and stdin), the per-run token
on stdin only, the head's source stopped after the copy whatever happened, and `diff` deciding from the
worker's copy check."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from components import shipped
from components.dynamic import read_props
from components.weights import local_copy as lc
from components.weights import worker_copy as wc
from components.weights.copy_config import CopierConfig, ExpectedFile, SourceConfig
from components.weights.copy_weights import REPORT_MARKER
from tests.support import recording

FAKE_SSH = r"""#!/bin/sh
# The remote command is the last argument; argv and stdin are recorded per call.
d="$FAKE_SSH_DIR"
n=$(cat "$d/n" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "$d/n"
for a in "$@"; do printf '%s\n' "$a"; done > "$d/argv.$n"
for last in "$@"; do :; done
case "$last" in
  *components/weights/source.sh*)
    echo "DSV41_COPY_SOURCE_IDENT m:1:2"
    echo "DSV41_COPY_SOURCE_LISTENING 40123"
    cat > "$d/stdin.$n"            # the lifeline: returns at the deployer's EOF
    echo "source-stopped" > "$d/source.stopped" ;;
  *components/weights/copy.sh*)
    cat > "$d/stdin.$n"
    if [ -f "$d/copy.slow" ]; then sleep "$(cat "$d/copy.slow")"; fi
    echo "copy_weights: spark-1: copying 1 of 2 files (0.00 GiB) in 1 streams" >&2
    if [ -f "$d/copy.fail" ]; then echo "copy_weights: error: disk full on spark-1" >&2; exit 1; fi
    cat "$d/copy.out" ;;
  *components/weights/copy_check.sh*)
    cat "$d/check.out"; exit "$(cat "$d/check.rc" 2>/dev/null || echo 0)" ;;
esac
"""

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nSECRETKEYMATERIAL0123456789\n-----END OPENSSH PRIVATE KEY-----\n"


@pytest.fixture
def ssh_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text(FAKE_SSH)
    (bindir / "ssh").chmod(0o755)
    data = tmp_path / "ssh-data"
    data.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_DIR", str(data))
    report = {"root": "/copies/spark-1", "copied": ["model/a"], "bytes": 5, "seconds": 0.1, "files": 2, "removed": []}
    (data / "copy.out").write_text(f"{REPORT_MARKER} {json.dumps(report)}\n")
    return data


def props(**over: Any) -> dict[str, Any]:
    p: dict[str, Any] = {
        "worker": "spark-1",
        "worker_host": "10.0.0.2",
        "worker_port": 22,
        "worker_user": "me",
        "worker_fabric_ip": "192.168.100.2",
        "head": "spark-0",
        "head_host": "10.0.0.1",
        "head_port": 22,
        "head_user": "me",
        "head_fabric_ip": "192.168.100.1",
        "ssh_private_key": KEY,
        "ssh_agent_socket": None,
        "ssh_known_hosts_file": None,
        "head_root": "/home/me/dsv41-exl3",
        "head_image": "sha256:" + "1" * 64,
        "worker_image": "sha256:" + "2" * 64,
        "copy_root": "~/dsv41-exl3",
        "files": {"model/a": 5, "model/b": 7},
        "sha256": {"model/a": "a" * 64, "model/b": "b" * 64},
        "streams": 4,
        "timeout_s": 600,
        "stack_prefix": "dsv41-exl3-dev",
    }
    p.update(over)
    return p


def calls(d: Path) -> list[tuple[str, str]]:
    n = int((d / "n").read_text())
    return [
        ((d / f"argv.{i}").read_text(), (d / f"stdin.{i}").read_text() if (d / f"stdin.{i}").exists() else "")
        for i in range(1, n + 1)
    ]


def test_a_copy_pairs_source_and_copier_with_a_token_sent_on_stdin_only(ssh_dir: Path) -> None:
    logged: list[str] = []
    outs = wc.run_copy(props(), log=logged.append)
    (source_argv, source_stdin), (copy_argv, copy_stdin) = calls(ssh_dir)
    source = SourceConfig.from_json(source_stdin.splitlines()[0])
    token = source.token
    copier_line, program_line = copy_stdin.splitlines()
    copier = CopierConfig.from_json(copier_line)
    assert len(token) >= 32 and copier.token == token
    assert copier.expected == (
        ExpectedFile(path="model/a", size=5, sha256="a" * 64),
        ExpectedFile(path="model/b", size=7, sha256="b" * 64),
    )
    assert base64.b64decode(program_line, validate=True) == shipped.zipapp(lc.COPIER_PROGRAM), "the copier, as a zip"
    for argv in (source_argv, copy_argv):
        assert token not in argv and "SECRETKEYMATERIAL" not in argv
    assert "root@" not in copy_argv and "me@10.0.0.2" in copy_argv and "me@10.0.0.1" in source_argv
    assert " SOURCE=http://192.168.100.1:40123;" in copy_argv and " SOURCE_IDENT=m:1:2;" in copy_argv
    assert source.allow == ("192.168.100.2",) and source.max_lifetime_s == 600 + 600
    assert source.dirs == ("model", "engram-vllm"), (
        "the source serves what a rank reads: model/ and the slim Engram directory, never engram-src/"
    )
    assert (ssh_dir / "source.stopped").exists(), "the source is stopped once the copy is done"
    assert outs["root"] == "/copies/spark-1" and outs["copied_files"] == 1 and outs["copied_bytes"] == 5
    assert any("1 of 2 files copied" in m for m in logged)
    # A second run makes another token: none is kept in the state or reused.
    wc.run_copy(props(), log=logged.append)
    assert SourceConfig.from_json(calls(ssh_dir)[2][1].splitlines()[0]).token != token


def test_the_copy_says_what_it_dropped_from_the_workers_page_cache(ssh_dir: Path) -> None:
    report = {"root": "/copies/spark-1", "copied": ["model/a"], "bytes": 5, "seconds": 0.1, "files": 2}
    report["page_cache"] = {"files": 2, "bytes": 3 << 30, "failed": 1}
    (ssh_dir / "copy.out").write_text(f"{REPORT_MARKER} {json.dumps(report)}\n")
    logged: list[str] = []
    wc.run_copy(props(), log=logged.append)
    assert any(
        m.endswith(
            "1 of 2 files copied (0.00 GiB in 0.1s); page cache: 2 files dropped (3.00 GiB), 1 not (the "
            "copier's lines name them)"
        )
        for m in logged
    ), logged


def test_the_deployer_sends_the_source_heartbeats_while_the_copy_runs(
    ssh_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without them a source whose deployer vanished would outlive it (copy_source.py stops after a silence).
    monkeypatch.setattr(wc, "HEARTBEAT_S", 0.05, raising=False)
    (ssh_dir / "copy.slow").write_text("0.6")
    wc.run_copy(props(), log=lambda _m: None)
    (_, source_stdin), _ = calls(ssh_dir)
    config, *beats = source_stdin.split("\n")
    assert SourceConfig.from_json(config).allow == ("192.168.100.2",)
    assert len(beats) >= 5 and set(beats) == {""}, f"heartbeat lines after the config line: {source_stdin[-80:]!r}"


def test_a_failed_copy_names_the_worker_and_what_it_said_and_still_stops_the_source(ssh_dir: Path) -> None:
    (ssh_dir / "copy.fail").write_text("")
    with pytest.raises(wc.CopyFailed, match=r"the weights copy to spark-1 failed \(1\)") as err:
        wc.run_copy(props(), log=lambda _m: None)
    assert "disk full on spark-1" in str(err.value)
    assert (ssh_dir / "source.stopped").exists()


def diff(ssh_dir: Path, check_out: str, olds: dict[str, Any], news: dict[str, Any], rc: int = 0) -> Any:
    (ssh_dir / "check.out").write_text(check_out)
    (ssh_dir / "check.rc").write_text(str(rc))
    return wc.WorkerCopyProvider().diff("copy-1", olds, news)


def test_diff_runs_the_copy_again_only_when_the_content_would_differ(
    ssh_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = props()
    assert diff(ssh_dir, "COPY_CHECK 0\n", old, props()).changes is False
    # Another image or stream count: stored, nothing copied (the check passes).
    assert diff(ssh_dir, "COPY_CHECK 0\n", old, props(worker_image="sha256:" + "3" * 64)).changes is True
    assert diff(ssh_dir, "MODIFIED model/a\nCOPY_CHECK 1\n", old, props()).changes is True
    assert diff(ssh_dir, "COPY_CHECK 0\n", old, props(sha256={"model/a": "c" * 64, "model/b": "b" * 64})).changes
    # Moving the copy is a new copy (a new id, which the rank mounts), never an update in place.
    moved = diff(ssh_dir, "COPY_CHECK 0\n", old, props(copy_root="/nvme/dsv41"))
    assert moved.changes and moved.replaces == ["copy_root"]
    assert diff(ssh_dir, "MODIFIED model/a\nCOPY_CHECK 1\n", old, props()).replaces == []
    # An unreachable worker is reported, never taken for a change.
    assert diff(ssh_dir, "", old, props(), rc=255).changes is False


def test_update_for_a_non_content_change_copies_nothing(ssh_dir: Path) -> None:
    (ssh_dir / "check.out").write_text("COPY_CHECK 0\n")
    old = {**props(), "root": "/copies/spark-1", "copied_files": 2}
    outs = wc.WorkerCopyProvider().update("copy-1", old, props(streams=8)).outs
    assert outs["streams"] == 8 and outs["root"] == "/copies/spark-1"
    assert not any("copy.sh" in argv for argv, _ in calls(ssh_dir)), "no copier ran"


def test_the_id_is_the_absolute_copy_root(ssh_dir: Path) -> None:
    created = wc.WorkerCopyProvider().create(props())
    assert created.id == "/copies/spark-1" == created.outs["root"]


def test_delete_keeps_the_copy(ssh_dir: Path) -> None:
    wc.WorkerCopyProvider().delete("copy-1", props())
    assert not (ssh_dir / "n").exists(), "destroy opens no ssh: the worker's copy stays"


# --- the properties a deployed copy holds ----------------------------------------------------------------

# Every input before WorkerCopyArgs was a contract (a change of any is stored; the copy runs again on a change of
# COPY_INPUT_KEYS).
OLD_INPUT_KEYS = (
    "worker",
    "worker_host",
    "worker_port",
    "head_root",
    "copy_root",
    "files",
    "sha256",
    "worker_user",
    "worker_fabric_ip",
    "head",
    "head_host",
    "head_port",
    "head_user",
    "head_fabric_ip",
    "head_image",
    "worker_image",
    "streams",
    "timeout_s",
    "stack_prefix",
    "ssh_private_key",
    "ssh_agent_socket",
    "ssh_known_hosts_file",
)
# The properties WorkerCopy registered before WorkerCopyArgs was a contract (built by hand in WorkerCopy.__init__),
# for the args of `program_args`, as the engine stores them: flat, None left out, numbers as floats, the key secret.
RECORDED = {
    "worker": "spark-1",
    "worker_host": "10.0.0.2",
    "worker_port": 22.0,
    "worker_user": "me",
    "worker_fabric_ip": "192.168.100.2",
    "head": "spark-0",
    "head_host": "10.0.0.1",
    "head_port": 2222.0,
    "head_user": "me",
    "head_fabric_ip": "192.168.100.1",
    "ssh_private_key": recording.wire_secret(KEY),
    "ssh_known_hosts_file": "/home/me/kh",
    "head_root": "/home/me/dsv41-exl3",
    "head_image": "sha256:" + "1" * 64,
    "worker_image": "sha256:" + "2" * 64,
    "copy_root": "/nvme/spark-1/dsv41",
    "files": {"model/a": 5.0, "model/b": 7.0},
    "sha256": {"model/a": "a" * 64, "model/b": "b" * 64},
    "streams": 4.0,
    "timeout_s": 3600.0,
    "stack_prefix": "dsv41-exl3-dev",
}
# Every key that old code put in the properties, None ones included (the outputs, and no agent socket).
RECORDED_KEYS = {*RECORDED, "ssh_agent_socket", "root", "copied_files", "copied_bytes", "copy_seconds"}
RECORDED_KEYS |= {"elapsed_s", "verified_at"}


def program_args() -> wc.WorkerCopyArgs:
    """As components/weights/weight_store.py builds them: staging's outputs, the stack's `ssh` section flat."""
    import pulumi

    from components.ssh import SshAccess

    ssh = SshAccess(private_key=pulumi.Output.secret(KEY), known_hosts_file="/home/me/kh")
    return wc.WorkerCopyArgs(
        worker="spark-1",
        worker_host="10.0.0.2",
        worker_port=22,
        worker_user="me",
        worker_fabric_ip="192.168.100.2",
        head="spark-0",
        head_host="10.0.0.1",
        head_port=2222,
        head_user="me",
        head_fabric_ip="192.168.100.1",
        ssh_private_key=ssh.private_key,
        ssh_agent_socket=ssh.agent_socket,
        ssh_known_hosts_file=ssh.known_hosts_file,
        head_root=pulumi.Output.from_input("/home/me/dsv41-exl3"),
        head_image="sha256:" + "1" * 64,
        worker_image=pulumi.Output.from_input("sha256:" + "2" * 64),
        copy_root="/nvme/spark-1/dsv41",
        files=pulumi.Output.from_input({"model/a": 5, "model/b": 7}),
        sha256=pulumi.Output.from_input({"model/a": "a" * 64, "model/b": "b" * 64}),
        streams=4,
        timeout_s=3600,
        stack_prefix="dsv41-exl3-dev",
    )


def test_the_properties_keep_the_shape_deployed_copies_hold() -> None:
    """A deployed stack's next `up` copies nothing again: same flat keys, values and secret as before the contract."""
    from components.dynamic import props_of

    args = program_args()
    assert {*props_of(args), "root", "copied_files", "copied_bytes", "copy_seconds", "elapsed_s", "verified_at"} == (
        RECORDED_KEYS
    )
    assert wc.INPUT_KEYS == OLD_INPUT_KEYS
    assert set(wc.COPY_INPUT_KEYS) | set(wc.WHERE_KEYS) <= set(wc.INPUT_KEYS)

    def program() -> None:
        wc.WorkerCopy("weights-copy-spark-1", program_args())

    registered = recording.run(program).named("weights-copy-spark-1")
    assert registered.stored() == RECORDED
    assert registered.additional_secret_outputs == ["ssh_private_key"]


def test_the_provider_reads_back_what_the_program_sent() -> None:
    args = read_props(wc.WorkerCopyArgs, {**RECORDED, "ssh_private_key": KEY, "__provider": "pickled"})
    assert (args.worker_port, args.head_port, args.streams, args.timeout_s) == (22, 2222, 4, 3600)
    assert args.manifest() == (RECORDED["files"], RECORDED["sha256"])
    head, worker = args.head_target(), args.worker_target()
    assert (head.host, head.port, head.user, worker.host, worker.port) == ("10.0.0.1", 2222, "me", "10.0.0.2", 22)
    assert head.private_key == KEY and head.known_hosts_file == "/home/me/kh" and head.agent_socket is None
    assert "SECRETKEYMATERIAL" not in repr(args), "the key stays out of tracebacks"


def test_no_key_and_no_agent_socket_are_absent_and_read_as_none(ssh_dir: Path) -> None:
    """The engine leaves None properties out: a stack on its agent alone sends no key."""
    given = {k: v for k, v in props().items() if v is not None}
    del given["ssh_private_key"]
    target = read_props(wc.WorkerCopyArgs, given).worker_target()
    assert (target.private_key, target.agent_socket, target.known_hosts_file) == (None, None, None)
    assert wc.run_copy(given, log=lambda _m: None)["ssh_private_key"] is None
