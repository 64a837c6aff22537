"""`dsv41-exl3 report`: the parts of the bundle from a fake stack and fake nodes, the secrets provider's marking,
the recording format of the rank logs, and no credential in any part even when a node or the state echoes one."""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from components.operator import rank_log, report
from tests.operator import stacks

pytestmark = pytest.mark.timeout(60)
SIG = "4dabf18193072939515e22adb298388d"


def inspect_json(started: str) -> str:
    return json.dumps(
        [
            {
                "Config": {
                    "Entrypoint": ["vllm"],
                    "Cmd": ["serve", "/model"],
                    "Env": ["VLLM_API_KEY_FILE=/run/x", "A=1"],
                },
                "State": {"StartedAt": started},
            }
        ]
    )


def node_answer(started: str, log: str, mem_kib: str = "125829120") -> subprocess.CompletedProcess[str]:
    out = f"{inspect_json(started)}\n=== logs\n{log}=== memory\n{mem_kib}\n=== watchdog\nwatchdog started\n"
    return subprocess.CompletedProcess(["ssh"], 0, out, "")


HEAD_LOG = (
    "2026-12-07T10:00:01.500000000Z INFO Starting vLLM API server\n"
    "2026-12-07T10:00:00.250000000Z INFO loading /model\n"
    f"2026-12-07T10:00:02.000000000Z args: api_key='{stacks.API_KEY}'\n"
)
WORKER_LOG = f"2026-12-07T10:00:00.750000000Z worker up {stacks.SSH_KEY_BODY}\n"


class FakeRun:
    def __call__(self, argv: list[str], timeout_s: int) -> subprocess.CompletedProcess[str]:
        if stacks.HEAD_CONTAINER in argv[-1]:
            return node_answer("2026-12-07T10:00:00.000000000Z", HEAD_LOG)
        return node_answer("2026-12-07T10:00:00.500000000Z", WORKER_LOG)


class FakeStack:
    def __init__(self) -> None:
        self.workspace = SimpleNamespace(
            pulumi_version="3.260.0", list_plugins=lambda: [SimpleNamespace(name="docker", version="5.1.0")]
        )

    def history(self, page_size: int, page: int) -> list[Any]:
        return [
            SimpleNamespace(
                version=7,
                kind="update",
                result="succeeded",
                start_time="t0",
                end_time="t1",
                resource_changes={"same": 30},
            )
        ]

    def export_stack(self) -> Any:
        return SimpleNamespace(
            deployment={
                "resources": [
                    {
                        "type": "pulumi-python:dynamic/gates:ReadyGate",
                        "urn": "urn:pulumi:s::dsv41-exl3::dsv41-exl3:x$pulumi-python:dynamic/gates:ReadyGate::ready",
                        "outputs": {
                            "__provider": "pickled code",
                            "passed_at": "2026-12-07T10:00:30Z",
                            "elapsed_s": 29.5,
                            "phases": {"load": 20.1},
                            "api_key": {SIG: "1b47061264138c4ac30d75fd1eb44270", "ciphertext": "v1:abc"},
                        },
                    },
                    {"type": "docker:index/container:Container", "urn": "urn:...::serving-x", "outputs": {"env": []}},
                ]
            }
        )


class Reply:
    def __init__(self, body: Any, status: int = 200) -> None:
        self.body, self.status_code = body, status

    def json(self) -> Any:
        return self.body


def fake_get(url: str, headers: dict[str, str], timeout: float) -> Reply:
    if url.endswith("/version"):
        return Reply({"version": "0.32.0"})
    assert url == f"{stacks.SUPERVISOR_URL}/status" and headers["Authorization"] == f"Bearer {stacks.SUPERVISOR_TOKEN}"
    return Reply({"decisions": [{"action": "heal", "why": f"token {stacks.SUPERVISOR_TOKEN} echoed"}]})


def test_the_bundle_has_every_part_and_no_credential_even_when_echoed(tmp_path: Path) -> None:
    parts = report.collect(stacks.view(), FakeStack(), FakeRun(), fake_get)
    assert set(parts) >= {
        "config.json",
        "versions.json",
        "history.json",
        "records.json",
        "memory.json",
        "supervisor.json",
        "boot/head.argv.json",
        "boot/head.log.jsonl",
        "boot/worker.argv.json",
        "boot/worker.log.jsonl",
    }
    everything = "\n".join(parts.values())
    for secret in (stacks.API_KEY, stacks.SSH_KEY_BODY, stacks.SUPERVISOR_TOKEN, "v1:abc", "pickled code"):
        assert secret not in everything, secret
    versions = json.loads(parts["versions.json"])
    assert versions["vllm"] == "0.32.0" and versions["pulumi"] == "3.260.0" and versions["plugins"] == ["docker 5.1.0"]
    (ready,) = json.loads(parts["records.json"])
    assert ready == {
        "name": "ready",
        "type": "ReadyGate",
        "outputs": {
            "passed_at": "2026-12-07T10:00:30Z",
            "elapsed_s": 29.5,
            "phases": {"load": 20.1},
            "api_key": "[secret]",
        },
    }
    assert json.loads(parts["history.json"])[0]["resourceChanges"] == {"same": 30}
    assert json.loads(parts["memory.json"])["spark-head"]["memAvailableGiB"] == 120.0


def test_the_rank_logs_are_in_the_recording_format_from_the_groups_first_start() -> None:
    parts = report.collect(stacks.view(), FakeStack(), FakeRun(), fake_get)
    head = [json.loads(line) for line in parts["boot/head.log.jsonl"].splitlines()]
    assert [(x["t"], x["text"][:12]) for x in head] == [
        (0.25, "INFO loading"),
        (1.5, "INFO Startin"),
        (2.0, "args: api_ke"),
    ], "ordered by docker's time, from the earliest rank start"
    assert json.loads(parts["boot/worker.log.jsonl"])["t"] == 0.75
    argv = json.loads(parts["boot/head.argv.json"])
    assert argv == {"entrypoint": ["vllm"], "cmd": ["serve", "/model"], "envNames": ["A", "VLLM_API_KEY_FILE"]}
    # The same lines and origin give what sim/record.py writes (its fixtures feed the conformance suite).
    lines = rank_log.merged_lines(HEAD_LOG)
    assert rank_log.as_jsonl(lines, rank_log.docker_time("2026-12-07T10:00:00.000000000Z")).startswith('{"t": 0.25')


def test_the_config_is_masked_by_the_secrets_providers_marking_not_by_names(tmp_path: Path) -> None:
    stack_file = tmp_path / "Pulumi.x.yaml"
    stack_file.write_text(
        "encryptionsalt: v1:salt\n"
        "config:\n"
        "  dsv41-exl3:ssh:\n    privateKey:\n      secure: v1:AAAA\n    knownHostsFile: /home/me/kh\n"
        "  dsv41-exl3:serve:\n    port: 8888\n    extraEnv:\n      MY_ODD_NAME:\n        secure: v1:BBBB\n"
        "  dsv41-exl3:image: ghcr.io/x:1\n"
    )
    masked = report.masked_config(stack_file)
    assert masked["config"] == {
        "dsv41-exl3:ssh": {"privateKey": "[secret]", "knownHostsFile": "/home/me/kh"},
        "dsv41-exl3:serve": {"port": 8888, "extraEnv": {"MY_ODD_NAME": "[secret]"}},
        "dsv41-exl3:image": "ghcr.io/x:1",
    }
    assert "v1:" not in json.dumps(masked)


def test_main_writes_one_tar_gz_and_a_bad_flag_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(report, "read_stack", lambda name: stacks.view())
    monkeypatch.setattr(report, "open_stack", lambda name: FakeStack())
    out = tmp_path / "r.tar.gz"
    assert report.main(["--out", str(out)], run=FakeRun(), get=fake_get) == 0
    with tarfile.open(out) as tar:
        names = sorted(m.name for m in tar.getmembers())
    assert all(n.startswith(f"dsv41-exl3-report-{stacks.STACK}-") for n in names)
    assert any(n.endswith("/boot/worker.log.jsonl") for n in names)
    assert str(out) in capsys.readouterr().out
    assert report.main(["--out", str(tmp_path / "j.tar.gz"), "--json"], run=FakeRun(), get=fake_get) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["out"] == str(tmp_path / "j.tar.gz") and "boot/head.log.jsonl" in said["parts"]
    assert report.main(["--outt", "x"], run=FakeRun(), get=fake_get) == 2
