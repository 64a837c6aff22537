"""The supervisor's process (components/supervisor/agent.py) on loopback: a leader and a worker agent with
fake docker daemons; the verifier's calls are replaced, everything else is the real code."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

from components.supervisor import agent, agent_api, supervisor
from components.supervisor.agent_config import AgentConfig
from components.verify.client import Passed
from components.verify.verdict import Failed, Reason, TokenLogprob
from tests.supervisor.fake_node import FakeDocker, FakeEndpoint, agent_config, node_config, real_boot

TOKEN = "t0ken-for-tests"


def config(tmp_path: Path, worker_port: int, **overrides: Any) -> AgentConfig:
    return agent_config(str(tmp_path), worker_port, **overrides)


class ScriptedLeader(agent.Leader):
    """The real leader with the verifier's verdicts scripted, each in turn (and when each was asked for)."""

    verdicts: list[Passed | Failed]
    verified_at: list[float]

    def verify(self, budget_s: float) -> Any:
        self.verified_at = [*getattr(self, "verified_at", []), time.time()]
        return self.verdicts.pop(0) if self.verdicts else Failed(Reason.NAN, "NaN")

    def api_key(self) -> str | None:
        return None


PASSED = Passed(answer="Paris", logprobs=(TokenLogprob("Paris", -0.1),), latency_s=0.1)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ScriptedLeader, FakeDocker, FakeDocker, list[str], int]]:
    """A leader on node-1 and a worker agent on node-2 over loopback HTTP; each rank replays real vLLM's boot
    (time-compressed) after a start; the head's endpoint answers /v1/models."""
    log: list[str] = []
    head, worker = FakeDocker("node-1", log), FakeDocker("node-2", log)
    head.add("rank-1", script=real_boot("head"))
    worker.add("rank-2", script=real_boot("worker"))
    worker_cfg = node_config("node-2", "rank-2")
    server = ThreadingHTTPServer(("127.0.0.1", 0), agent.make_handler(worker_cfg, worker, TOKEN, None))  # type: ignore[arg-type]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = FakeEndpoint()
    cfg = config(tmp_path, server.server_address[1], endpoint=endpoint.url)
    leader = ScriptedLeader(cfg, head, TOKEN, agent.Store(tmp_path / "state.json"))  # type: ignore[arg-type]
    leader.verdicts = [PASSED]
    yield leader, head, worker, log, server.server_address[1]
    server.shutdown()
    endpoint.close()


def test_a_dead_worker_stops_every_rank_then_starts_the_workers_before_the_head(cluster: Any) -> None:
    leader, head, worker, log, _ = cluster
    assert leader.step().action == "verify"  # arms on its own verification first
    assert leader.store.snapshot()["armed_generation"] == "g1"
    worker.containers["rank-2"]["State"].update(Running=False, ExitCode=137)
    leader.verdicts = [PASSED]
    decision = leader.step()
    assert decision.action == "heal" and "node-2 exited with code 137" in decision.why
    assert log == ["stop node-1", "start node-2", "start node-1"], (
        "stop all (the dead one is already down), then the workers, then the head"
    )
    (restart,) = leader.store.snapshot()["restarts"]
    assert restart["result"] == "verified" and "node-2" in restart["cause"]
    assert set(restart["phases"]) == {"stop", "memory", "boot", "verify"}


def test_the_budget_gives_up_and_runs_the_notify_command(cluster: Any, tmp_path: Path) -> None:
    leader, head, worker, log, _ = cluster
    events = tmp_path / "events"
    leader.lead = replace(leader.lead, notify_command=f"cat >> {events}; echo >> {events}")
    leader.step()
    for _ in range(3):  # every restart comes back NaN, and the rank dies again
        worker.containers["rank-2"]["State"].update(Running=False, ExitCode=137)
        leader.verdicts = [Failed(Reason.NAN, "the answer carries NaN logprobs")]
        leader.step()
    snap = leader.store.snapshot()
    assert len(snap["restarts"]) == 2 and all(r["result"].startswith("not verified") for r in snap["restarts"])
    assert "supervisor.maxRestarts 2" in snap["given_up"]
    kinds = [json.loads(x)["event"] for x in events.read_text().splitlines() if x.strip()]
    assert kinds == ["armed", "restarting", "restart-failed", "restarting", "restart-failed", "gave-up"]
    assert leader.step().action == "wait", "a supervisor that gave up waits for the operator"


def test_pause_survives_a_restart_of_the_supervisor(cluster: Any, tmp_path: Path) -> None:
    leader, head, worker, log, _ = cluster
    leader.step()
    leader.store.update(paused=True)
    worker.containers["rank-2"]["State"].update(Running=False)
    again = ScriptedLeader(leader.cfg, head, TOKEN, agent.Store(tmp_path / "state.json"))  # type: ignore[arg-type]
    again.verdicts = [PASSED]
    assert again.step().action == "wait" and log == []


def test_the_agents_api_wants_the_token_and_acts_only_on_its_own_rank(cluster: Any) -> None:
    leader, head, worker, log, port = cluster
    url = f"http://127.0.0.1:{port}"
    assert requests.get(f"{url}/rank", timeout=5).status_code == 401
    assert requests.get(f"{url}/rank", headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    state = requests.get(f"{url}/rank", headers=auth, timeout=5).json()
    assert state["running"] is True and state["generation"] == "g1" and state["container"] == "rank-2"
    assert requests.post(f"{url}/rank/stop", headers=auth, timeout=5).json()["running"] is False
    assert log == ["stop node-2"]
    assert requests.post(f"{url}/pause", headers=auth, timeout=5).status_code == 404, "a worker does not lead"


def test_the_agent_runs_from_its_payload_alone_without_pulumi(tmp_path: Path) -> None:
    # What the node receives: the payload's files; what the serving image has: Python and requests.
    cfg = config(tmp_path, 1)
    files, _ = supervisor.payload(cfg, "secret-token")
    import base64
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(files))) as tar:
        tar.extractall(tmp_path, filter="data")
    assert (tmp_path / "token").read_text() == "secret-token"
    # The agent reads back the very object the program wrote, with nothing but the shipped files.
    probe = (
        "import sys; import components.supervisor.agent as a; "
        f"c = a.AgentConfig.from_json(open({str(tmp_path / 'config.json')!r}).read()); "
        f"assert c == a.AgentConfig.from_json({cfg.to_json()!r}) and c.leader.bounds.stall_s == 20.0, c; "
        "sys.exit(1 if any(m.split('.')[0] in ('pulumi', 'pydantic') for m in sys.modules) else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {probe}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_the_same_files_make_the_same_payload() -> None:
    # the payload is a secret input: any byte of difference would show as an update at every preview
    one, two = agent_config("/s"), agent_config("/s", generation="g2")
    assert supervisor.payload(one, "t") == supervisor.payload(agent_config("/s"), "t")
    assert supervisor.payload(one, "t")[1] != supervisor.payload(two, "t")[1]


def test_the_memory_guard_kills_the_rank_on_the_second_low_sample(tmp_path: Path) -> None:
    log: list[str] = []
    docker = FakeDocker("node-2", log)
    docker.add("rank-2")
    meminfo = tmp_path / "meminfo"
    guard = agent.MemoryGuard(
        docker,
        "rank-2",
        floor_gib=1.5,
        sample_s=1,
        samples=2,  # type: ignore[arg-type]
        meminfo=str(meminfo),
    )
    meminfo.write_text("MemTotal: 128000000 kB\nMemAvailable: 1048576 kB\n")  # 1 GiB
    assert guard.sample() is False and log == []
    meminfo.write_text("MemAvailable: 4194304 kB\n")  # back over the floor: the count starts again
    assert guard.sample() is False
    meminfo.write_text("MemAvailable: 1048576 kB\n")
    assert guard.sample() is False
    assert guard.sample() is True and log == ["kill node-2"]
    assert guard.sample() is False and guard.sample() is False, "a rank already down is not killed again"


def replace_ranks(docker: FakeDocker, name: str, generation: str) -> None:
    """What an update does to a node's rank: a new container of another generation, started now."""
    docker.generation = generation
    docker.add(name, script=docker.scripts[name])


def test_a_late_answer_never_arms_a_generation_an_update_replaced_meanwhile(cluster: Any) -> None:
    leader, head, worker, _, _ = cluster

    class ReplacedWhileVerifying(ScriptedLeader):
        def verify(self, budget_s: float) -> Any:
            replace_ranks(head, "rank-1", "g2")  # the update's new ranks answer the old generation's question
            replace_ranks(worker, "rank-2", "g2")
            return PASSED

    late = ReplacedWhileVerifying(leader.cfg, head, TOKEN, leader.store)
    assert late.step().action == "verify"
    snap = late.store.snapshot()
    assert not snap.get("armed_generation"), "g1's verification was answered by g2's ranks: it arms nothing"
    assert "replaced or restarted" in snap["last_probe"]["seen"], snap["last_probe"]
    leader.verdicts = [PASSED]
    assert leader.step().action == "verify"
    assert leader.store.snapshot()["armed_generation"] == "g2", "what runs is verified and armed on the next look"


def test_a_verification_during_an_update_lock_arms_nothing_and_the_update_after_it_is_armed(cluster: Any) -> None:
    leader, head, worker, _, _ = cluster

    class LockedWhileVerifying(ScriptedLeader):
        def verify(self, budget_s: float) -> Any:
            self.store.update(lock={"holder": "pulumi up of dev", "expires_at": time.time() + 60})
            return PASSED

    locked = LockedWhileVerifying(leader.cfg, head, TOKEN, leader.store)
    locked.step()
    assert not leader.store.snapshot().get("armed_generation"), "an update took the lock: the answer is the up's"
    replace_ranks(head, "rank-1", "g2")
    replace_ranks(worker, "rank-2", "g2")
    assert leader.step().action == "wait"
    assert leader.store.snapshot()["running_generation"] == "g2"
    leader.store.update(lock=None)  # the update ends
    leader.verdicts = [PASSED]
    assert leader.step().action == "verify"
    snap = leader.store.snapshot()
    assert snap["armed_generation"] == "g2" and snap["last_verified"]["generation"] == "g2"


def test_the_update_that_installed_the_agent_arms_it_for_the_generation_it_verified(cluster: Any) -> None:
    leader, head, worker, _, _ = cluster
    leader.store.update(armed_generation="g0")  # armed before, for what an earlier update (or a rollback) ran
    leader.lead = replace(
        leader.lead, generation="g1"
    )  # the update that verified g1 installed this config after its verifier
    leader.verdicts = []  # the supervisor's own verification would fail: the update's verdict is enough
    worker.containers["rank-2"]["State"].update(Running=False, ExitCode=255)
    decision = leader.step()
    snap = leader.store.snapshot()
    assert snap["armed_generation"] == "g1", snap
    assert decision.action == "heal", "armed for what runs, a dead worker is healed at once"
    assert any(e["event"] == "armed" and e.get("by") for e in snap["events"]), snap["events"]


def test_armed_by_the_update_the_supervisor_verifies_once_itself_to_record_what_it_answered(cluster: Any) -> None:
    leader, head, worker, _, _ = cluster
    leader.lead = replace(leader.lead, generation="g1")
    leader.verdicts = [PASSED]
    assert leader.step().action == "probe"  # armed at once; its own verification takes the probe's turn
    snap = leader.store.snapshot()
    assert snap["armed_generation"] == "g1" and snap["last_verified"]["generation"] == "g1", snap
    assert snap["last_verified"]["logprobs"] == [["Paris", -0.1]]
    asked = len(leader.verified_at)
    leader.next_probe = 0.0
    leader.step()
    assert len(leader.verified_at) == asked, "once per generation: then the probe's rules decide"


def test_an_agent_config_for_another_generation_arms_nothing(cluster: Any) -> None:
    leader, head, worker, _, _ = cluster
    leader.store.update(armed_generation="g0")
    leader.lead = replace(
        leader.lead, generation="g2"
    )  # the head still runs g1: a later update's config, not what runs
    leader.verdicts = []
    leader.step()
    assert leader.store.snapshot()["armed_generation"] == "g0"


def test_an_unreadable_state_file_keeps_the_supervisor_paused_and_is_kept(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text('{"paused": true, "armed_generation": "g1"')  # cut short, as by a power cut mid-write
    store = agent.Store(state)
    assert store.data["paused"] is True and "could not be read" in store.data["state_error"]
    assert (tmp_path / "state.unreadable").read_text().startswith('{"paused": true')
    store.update(paused=False)  # the operator's resume
    assert json.loads(state.read_text())["paused"] is False and not (tmp_path / "state.tmp").exists()
    assert agent.Store(tmp_path / "missing.json").data["paused"] is False, "no file yet: a first start"


def test_idle_connections_are_bounded_per_client_and_another_client_is_still_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    monkeypatch.setattr(agent_api, "READ_TIMEOUT_S", 1.0)
    handler = agent.make_handler(node_config("node-2", "rank-2"), FakeDocker("node-2", []), TOKEN, None)  # type: ignore[arg-type]
    server = agent_api.AgentServer(("127.0.0.1", 0), handler, per_client=8, total=48)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    threads_before = threading.active_count()
    try:
        # 500 connections that never send a byte, from one address (a LAN scanner, a slow-loris)
        idle = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.5", 0)) for _ in range(500)]
        time.sleep(0.5)
        assert threading.active_count() <= threads_before + 8, "one client holds at most 8 handler threads"
        reply = requests.get(f"http://127.0.0.1:{port}/rank", timeout=5)  # another address: answered at once
        assert reply.status_code == 401
        time.sleep(1.5)  # the idle ones said nothing within the read timeout: dropped
        assert threading.active_count() <= threads_before + 1
        again = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.5", 0))
        again.sendall(b"GET /rank HTTP/1.0\r\n\r\n")
        assert again.recv(64).startswith(b"HTTP/1.0 401"), "the same client is served again once its slots free"
        for s in [*idle, again]:
            s.close()
    finally:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_head_agent_answers_on_each_of_its_addresses_counting_into_one_bound() -> None:
    """The head's agent listens on its fabric address and on the head's address the operator reaches (no longer
    on every address): both answer, and a client's connections count against the same bounds on both."""
    handler = agent.make_handler(node_config("node-1", "rank-1"), FakeDocker("node-1", []), TOKEN, None)  # type: ignore[arg-type]
    port = _free_port()
    servers = agent_api.listen(["127.0.0.1", "127.0.0.7"], port, handler)
    try:
        for s in servers:
            threading.Thread(target=s.serve_forever, daemon=True).start()
        for host in ("127.0.0.1", "127.0.0.7"):
            assert requests.get(f"http://{host}:{port}/rank", timeout=5).status_code == 401, host
        assert servers[1].open is servers[0].open and servers[1].counting is servers[0].counting
        assert (servers[1].per_client, servers[1].total) == (servers[0].per_client, servers[0].total)
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_the_heads_second_address_binds_before_the_node_holds_it() -> None:
    """At boot docker may start the agent before DHCP or Tailscale gives the head its address: the second
    listener binds anyway (IP_FREEBIND), where a plain bind fails; the first stays a plain bind."""
    import errno

    handler = agent.make_handler(node_config("node-1", "rank-1"), FakeDocker("node-1", []), TOKEN, None)  # type: ignore[arg-type]
    absent = "198.51.100.77"  # TEST-NET-2: an address no machine here holds (bound, never sent to)
    port = _free_port()
    with pytest.raises(OSError) as err:
        agent_api.AgentServer((absent, port), handler)
    assert err.value.errno == errno.EADDRNOTAVAIL
    servers = agent_api.listen(["127.0.0.1", absent], port, handler)
    try:
        assert [s.server_address[0] for s in servers] == ["127.0.0.1", absent]
    finally:
        for s in servers:
            s.server_close()
