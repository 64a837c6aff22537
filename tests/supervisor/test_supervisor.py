"""The supervisor's wiring under the recording mock, and its config (components/supervisor/supervisor.py)."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest

from components.config import ConfigError, parse
from components.deployment import deploy
from components.supervisor import supervisor
from components.supervisor.agent_config import AgentConfig
from tests.supervisor.fake_node import agent_config
from tests.support import recording
from tests.support.graph import CONTAINER, FIXTURES, config


def stdin_of(rec: recording.Recorded, name: str) -> tarfile.TarFile:
    value = rec.named(name).inputs["stdin"]
    if isinstance(value, dict):  # a secret, as the mock monitor keeps it
        value = value["value"]
    return tarfile.open(fileobj=io.BytesIO(base64.b64decode(value)))


def run(**overrides: object) -> recording.Recorded:
    return recording.run(lambda: deploy(parse(config(**overrides)), "dev"), FIXTURES)


def test_one_agent_per_node_restarted_by_docker_and_started_after_the_verifier() -> None:
    rec = run()
    agents = [c for c in rec.of_type(CONTAINER) if c.name.startswith("supervisor-")]
    assert sorted(c.name for c in agents) == ["supervisor-spark-0", "supervisor-spark-1"]
    verifier = rec.named("verify")
    for c in agents:
        assert c.inputs["restart"] == "unless-stopped" and c.inputs["networkMode"] == "host"
        assert c.inputs["entrypoints"][:4] == ["python3", "-u", "-m", "components.supervisor.agent"]
        install = rec.named(f"{c.name}-files")
        assert rec.depends_on(c, install) and rec.depends_on(install, verifier), (
            "nothing supervises a deployment that never verified"
        )
        assert c.delete_before_replace


def test_the_token_travels_only_as_a_secret() -> None:
    rec = run()
    install = rec.named("supervisor-spark-0-files")
    assert "stdin" in install.secret_paths()
    with stdin_of(rec, "supervisor-spark-0-files") as tar:
        token = tar.extractfile("token").read().decode()  # type: ignore[union-attr]
        cfg = json.loads(tar.extractfile("config.json").read())  # type: ignore[union-attr]
    assert len(token) == 64 and token not in json.dumps(cfg)
    for reg in rec.registrations:
        for key, value in reg.inputs.items():
            if key not in reg.secret_paths():
                assert token not in json.dumps(value, default=str), f"{reg.name}.{key} holds the token"
    head = AgentConfig.from_props(cfg)
    assert head.role == "leader" and head.leader and [n.name for n in head.leader.nodes] == ["spark-0", "spark-1"]
    with stdin_of(rec, "supervisor-spark-1-files") as tar:
        assert AgentConfig.from_json(tar.extractfile("config.json").read()).role == "worker"  # type: ignore[union-attr]


def test_the_token_is_stable_across_runs() -> None:
    def token(rec: recording.Recorded) -> str:
        with stdin_of(rec, "supervisor-spark-0-files") as tar:
            return tar.extractfile("token").read().decode()  # type: ignore[union-attr]

    assert token(run()) == token(run())


def test_off_is_one_line_and_leaves_nothing() -> None:
    rec = run(supervisor={"enabled": False})
    assert not [r for r in rec.registrations if r.name.startswith("supervisor-")]
    assert "supervisor" not in rec.outputs


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"port": 8888}, "`supervisor.port` = 8888"),
        ({"probeSeconds": 0}, "supervisor.probeSeconds"),
        ({"maxRestarts": 0}, "supervisor.maxRestarts"),
        ({"windowHours": 0}, "supervisor.windowHours"),
        ({"notifyCommand": "echo a\necho b"}, "supervisor.notifyCommand"),
    ],
)
def test_bad_values_are_refused_with_the_key(section: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(config(supervisor=section))
    assert needle in str(err.value)


def run_install(tmp_path: Path, notify: str, docker_exit: int) -> subprocess.CompletedProcess[str]:
    """install.sh as the node runs it: the payload on stdin, a fake `docker` on PATH, a real socket file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/docker.log\nexit {docker_exit}\n')
    (bin_dir / "docker").chmod(0o755)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "docker.sock"))
    files, _ = supervisor.payload(agent_config(str(tmp_path)), "tok")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "DOCKER_HOST": f"unix://{tmp_path}/docker.sock"}
    try:
        return subprocess.run(
            ["sh", "-c", supervisor.install_command("p", "n1", "install", image="img@sha256:1", notify=notify)],
            input=files,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    finally:
        sock.close()


def test_install_unpacks_the_payload_and_names_the_paths(tmp_path: Path) -> None:
    done = run_install(tmp_path, "", 0)
    assert done.returncode == 0, done.stderr
    paths = json.loads(done.stdout.strip().splitlines()[-1])
    assert paths["socket"] == str(tmp_path / "docker.sock")
    assert (Path(paths["dir"]) / "token").read_text() == "tok"
    assert (Path(paths["dir"]) / "components" / "supervisor" / "agent.py").is_file()
    assert not (tmp_path / "docker.log").exists(), "no notifyCommand, no image check"


def test_an_unknown_notify_command_fails_at_install_not_at_3_am(tmp_path: Path) -> None:
    done = run_install(tmp_path, "ntfy-send", 1)
    assert done.returncode != 0
    assert "supervisor.notifyCommand runs 'ntfy-send', which the serving image does not have" in done.stderr
    assert "img@sha256:1" in (tmp_path / "docker.log").read_text(), "checked in the serving image itself"
    found = tmp_path / "found"
    found.mkdir()
    assert run_install(found, "sh", 0).returncode == 0, "a command the image has passes"


def test_the_notify_program_is_the_first_word() -> None:
    assert supervisor.notify_program("curl -fsS -d @- https://x") == "curl"
    assert supervisor.notify_program("'/opt/my tool' --x") == "/opt/my tool"
    assert supervisor.notify_program("") == ""
    with pytest.raises(ConfigError) as err:
        parse(config(supervisor={"notifyCommand": "echo 'unbalanced"}))
    assert "supervisor.notifyCommand" in str(err.value) and "quotes" in str(err.value)


def test_live_ranks_asks_the_supervisor_with_its_token_as_a_secret() -> None:
    live = run().named("live-ranks")
    assert live.inputs["supervisor_url"] == "http://10.0.0.1:18391"
    assert live.inputs["supervisor_fresh_s"] == 60.0
    assert "supervisor_token" in live.secret_paths()
    off = run(supervisor={"enabled": False}).named("live-ranks")
    assert off.inputs.get("supervisor_url") is None and off.inputs.get("supervisor_token") is None


def test_the_leaders_config_names_the_generation_this_update_verified_and_a_new_one_replaces_the_agent() -> None:
    rec = run()
    with stdin_of(rec, "supervisor-spark-0-files") as tar:
        cfg = json.loads(tar.extractfile("config.json").read())  # type: ignore[union-attr]
    assert cfg["leader"]["generation"] == rec.outputs["clusterGeneration"], "the leader arms for what was verified"
    changed = run(serve={"maxNumSeqs": 3})
    with stdin_of(changed, "supervisor-spark-0-files") as tar:
        again = json.loads(tar.extractfile("config.json").read())  # type: ignore[union-attr]
    assert again["leader"]["generation"] == changed.outputs["clusterGeneration"] != cfg["leader"]["generation"]

    def code_label(r: recording.Recorded) -> str:
        labels = r.named("supervisor-spark-0").inputs["labels"]
        return next(x["value"] for x in labels if x["label"] == supervisor.CODE_LABEL)

    assert code_label(changed) != code_label(rec), "a new generation restarts the agent on its new config"
