"""The lock the program holds on the leading agent while an update runs (components/supervisor/update_lock.py),
against a real agent's API on loopback."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from components.supervisor import agent, update_lock
from tests.supervisor.fake_node import agent_config


@pytest.fixture
def leader_api(tmp_path: Path) -> Iterator[tuple[str, agent.Leader]]:
    cfg = agent_config(str(tmp_path), max_restarts=1, window_s=1)
    leader = agent.Leader(cfg, None, "tok", agent.Store(tmp_path / "state.json"))  # type: ignore[arg-type]
    server = ThreadingHTTPServer(("127.0.0.1", 0), agent.make_handler(cfg, None, "tok", leader))  # type: ignore[arg-type]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", leader
    server.shutdown()


def test_an_update_holds_the_lock_until_it_releases_it(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    lock = update_lock.UpdateLock(url, "tok", "pulumi up of dev from laptop pid 1")
    assert lock.renew() and lock.held
    assert leader.lock_holder() == "pulumi up of dev from laptop pid 1"
    lock.release()
    assert leader.lock_holder() is None


def test_a_release_by_another_holder_leaves_the_lock(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    assert update_lock.UpdateLock(url, "tok", "first").renew()
    update_lock.UpdateLock(url, "tok", "second").release()
    assert leader.lock_holder() == "first"


def test_a_wrong_token_is_refused_and_said_once(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    said: list[str] = []
    lock = update_lock.UpdateLock(url, "wrong", "me", log=said.append)
    assert not lock.renew() and not lock.renew()
    assert len(said) == 1 and "HTTP 401" in said[0]
    assert leader.lock_holder() is None


def test_no_supervisor_yet_is_not_an_error() -> None:
    # the first up: nothing listens on the head yet (port 1 on loopback refuses)
    lock = update_lock.UpdateLock("http://127.0.0.1:1", "tok", "me", log=lambda m: pytest.fail(m))
    assert lock.renew() is False
    lock.release()


def test_the_preview_gets_the_supervisors_state_in_one_line(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    leader.store.update(
        doing="serving",
        last_probe={"at": 1.0, "state": "healthy"},
        restarts=[{"at": 1.0, "cause": "the rank on node-2 exited with code 137", "result": "verified"}],
    )
    lock = update_lock.UpdateLock(url, "tok", "me")  # start() is kept offline for the unit tests (conftest)
    line = lock.status_line()
    assert line is not None
    assert line.startswith("supervisor: serving; last probe healthy")
    assert "1 restart(s), last: the rank on node-2 exited with code 137 -> verified" in line


# The real methods: the unit tests' conftest keeps the program's lock offline (patched after this import).
REAL_START = update_lock.UpdateLock.start
REAL_REPORT = update_lock.UpdateLock.report


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_second_live_update_is_refused_naming_the_holder(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    first = update_lock.UpdateLock(url, "tok", "pulumi up of dev from laptop pid 1")
    assert first.renew()
    second = update_lock.UpdateLock(url, "tok", "pulumi up of dev from desktop pid 2")
    with pytest.raises(update_lock.LockHeld, match="pulumi up of dev from laptop pid 1"):
        REAL_START(second)
    assert leader.lock_holder() == "pulumi up of dev from laptop pid 1", "the refused update leaves the lock"
    second.release()
    assert leader.lock_holder() == "pulumi up of dev from laptop pid 1", "a release names its own holder only"
    first.release()
    assert leader.lock_holder() is None


def test_an_up_killed_before_its_release_is_taken_over_from_this_machine(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    gone = f"pulumi up of dev from {socket.gethostname()} pid {dead_pid()}"
    assert update_lock.UpdateLock(url, "tok", gone).renew()
    said: list[str] = []
    again = update_lock.UpdateLock(url, "tok", update_lock.holder_name("dev", False), log=said.append)
    assert again.renew() and leader.lock_holder() == again.holder
    assert any("that process is gone" in line for line in said), said
    again.release()


def test_an_expired_lease_is_taken_by_anyone(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    leader.store.update(lock={"holder": "pulumi up of dev from laptop pid 1", "expires_at": time.time() - 1})
    assert update_lock.UpdateLock(url, "tok", "pulumi up of dev from desktop pid 2").renew()


def test_a_release_without_a_holder_is_refused(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    assert update_lock.UpdateLock(url, "tok", "pulumi up of dev from laptop pid 1").renew()
    reply = requests.delete(f"{url}/lock", json={}, headers={"Authorization": "Bearer tok"}, timeout=5)
    assert reply.status_code == 409 and leader.lock_holder() == "pulumi up of dev from laptop pid 1"
    taken = requests.post(f"{url}/lock", json={}, headers={"Authorization": "Bearer tok"}, timeout=5)
    assert taken.status_code == 400, "a take names its holder"


def test_a_preview_takes_no_lock_and_cannot_end_a_running_ups(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    up = update_lock.UpdateLock(url, "tok", update_lock.holder_name("dev", False))
    assert up.renew()
    lines: list[str] = []
    # What `_wire` does in a preview: the supervisor's line, no take and so no release.
    preview = update_lock.UpdateLock(url, "tok", "pulumi preview of dev from laptop pid 3")
    REAL_REPORT(preview, lines.append)
    assert leader.lock_holder() == up.holder and lines, lines
    up.release()


def test_an_update_whose_engine_is_gone_releases_the_lock(leader_api: tuple[str, agent.Leader]) -> None:
    url, leader = leader_api
    engine = {"alive": True}
    said: list[str] = []

    def log(line: str) -> None:  # as pulumi.log does once its engine is gone
        said.append(line)
        if not engine["alive"]:
            raise RuntimeError("the engine's Log RPC: UNAVAILABLE")

    lock = update_lock.UpdateLock(
        url,
        "tok",
        "pulumi up of dev from laptop pid 1",
        log=log,
        engine_alive=lambda: engine["alive"],
        renew_s=0.05,
    )
    REAL_START(lock)
    time.sleep(0.2)
    assert leader.lock_holder() == lock.holder, "renewed while the engine answers"
    engine["alive"] = False  # the CLI was killed; this process lingers
    deadline = time.monotonic() + 5
    while leader.lock_holder() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leader.lock_holder() is None and any("engine" in line for line in said), said


def test_the_engine_check_says_gone_only_when_nothing_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    import grpc
    from pulumi.runtime import settings

    from components import deployment

    class Engine:
        def __init__(self, code: grpc.StatusCode | None) -> None:
            self.code = code

        def GetRootResource(self, request: object, timeout: float) -> None:  # noqa: N802 - the RPC's name
            if self.code is not None:
                error = grpc.RpcError()
                error.code = lambda: self.code  # type: ignore[attr-defined]
                raise error

    for code, alive in ((None, True), (grpc.StatusCode.UNAVAILABLE, False), (grpc.StatusCode.DEADLINE_EXCEEDED, True)):
        monkeypatch.setattr(settings, "get_engine", lambda code=code: Engine(code))
        assert deployment.engine_alive() is alive, code
