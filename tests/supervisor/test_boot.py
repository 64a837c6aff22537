"""A restart's boot waits on the gates' rules over every rank's log (components/supervisor/boot.py), not on
`/health`: replayed on real vLLM's recorded lines (tests/support/fixtures/real-vllm) through the real leader, a
real worker agent on loopback and fake docker daemons. The head's endpoint answers /health 200 throughout, as
real vLLM's head does with its worker gone, so a wait on /health alone would verify each of these at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

from components.gates import log_patterns
from components.supervisor import agent, boot
from tests.gates.test_decisions import L_DIST_STORE
from tests.supervisor.fake_node import (
    FakeDocker,
    FakeEndpoint,
    Script,
    frame,
    head_ready_at,
    joined_at,
    node_config,
    real_boot,
    until,
    without,
)
from tests.supervisor.test_agent import PASSED, TOKEN, ScriptedLeader, config


class Node:
    def __init__(self, leader: ScriptedLeader, head: FakeDocker, worker: FakeDocker, endpoint: FakeEndpoint) -> None:
        self.leader, self.head, self.worker, self.endpoint = leader, head, worker, endpoint

    def kill_worker(self, **state: Any) -> None:
        self.worker.containers["rank-2"]["State"].update(Running=False, Status="exited", ExitCode=137, **state)

    def heal(self) -> tuple[dict[str, Any], float]:
        """Arm, kill the worker, let the leader heal; the restart's record and how long it took."""
        if not self.leader.store.snapshot().get("armed_generation"):
            assert self.leader.step().action == "verify"
        self.kill_worker()
        started = time.monotonic()
        assert self.leader.step().action == "heal"
        return self.leader.store.snapshot()["restarts"][-1], time.monotonic() - started


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    log: list[str] = []
    head, worker = FakeDocker("node-1", log), FakeDocker("node-2", log)
    head.add("rank-1", script=real_boot("head"))
    worker.add("rank-2", script=real_boot("worker"))
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0),
        agent.make_handler(node_config("node-2", "rank-2"), worker, TOKEN, None),  # type: ignore[arg-type]
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = FakeEndpoint()
    cfg = config(tmp_path, server.server_address[1], endpoint=endpoint.url, rendezvous_timeout_s=30.0)
    leader = ScriptedLeader(cfg, head, TOKEN, agent.Store(tmp_path / "state.json"))  # type: ignore[arg-type]
    leader.verdicts = [PASSED, PASSED]
    yield Node(leader, head, worker, endpoint)
    server.shutdown()
    endpoint.close()


def test_the_restart_verifies_only_once_every_rank_joined_and_the_head_logged_ready(node: Node) -> None:
    restart, _ = node.heal()
    assert restart["result"] == "verified", restart
    verified = node.leader.verified_at[-1]
    ready = node.head.started["rank-1"] + head_ready_at(node.head.scripts["rank-1"])
    joined = node.worker.started["rank-2"] + joined_at(node.worker.scripts["rank-2"])
    assert verified >= ready and verified >= joined, (
        "the verifier runs only after the head logged 'Application startup complete' and every rank joined "
        f"(verify {verified:.3f}, head ready {ready:.3f}, worker joined {joined:.3f})"
    )
    models = node.endpoint.first("/v1/models")
    assert models is not None and models >= ready, "the ready gate asks /v1/models once the head logged ready"
    assert node.endpoint.first("/health") is None, "/health decides nothing: real vLLM's head says 200 regardless"
    assert node.worker.log_reads > 0, "the worker's log is read through its agent"
    assert set(restart["phases"]) == {"stop", "memory", "boot", "verify"}, restart["phases"]


def test_a_head_that_logged_ready_without_the_workers_join_is_not_verified(node: Node) -> None:
    node.leader.lead = replace(node.leader.lead, bounds=replace(node.leader.lead.bounds, rendezvous_timeout_s=1.5))
    node.worker.scripts["rank-2"] = without(real_boot("worker"), log_patterns.is_join_line)
    restart, _ = node.heal()
    assert restart["result"].startswith("boot failed: rendezvous did not complete within 1.5 s"), restart
    assert "rank 1 (node node-2" in restart["result"] and "never joined" in restart["result"], restart
    assert len(node.leader.verified_at) == 1, "only the arming verification: the restart never reached the verifier"


def test_a_fatal_line_ends_the_boot_at_once_naming_the_node_and_the_line(node: Node) -> None:
    # The head reached the rendezvous; torch's store gave up on the worker, which never reached it. The head's
    # container is still running: the line alone ends the attempt, not the exit and not the 30 s bound.
    head = real_boot("head")
    reached = next(t for t, x in head.lines if "world_size=" in x)
    node.head.scripts["rank-1"] = Script(
        [(t, x) for t, x in head.lines if t <= reached] + [(reached + 0.05, L_DIST_STORE)]
    )
    node.worker.scripts["rank-2"] = until(real_boot("worker"), lambda x: "world_size=" in x)
    restart, took = node.heal()
    assert took < 10, f"a fatal line fails the boot at once, not at the 30 s rendezvous bound: {took:.1f} s"
    assert "node node-1" in restart["result"] and "1/2 clients joined" in restart["result"], restart
    assert "logged a rendezvous failure" in restart["result"], restart
    assert node.head.containers["rank-1"]["State"]["Running"], "the line decided, not the head's exit"


def test_a_worker_that_dies_during_the_boot_ends_it_at_once_naming_its_node(node: Node) -> None:
    worker = real_boot("worker")
    node.worker.scripts["rank-2"] = Script(
        [(t, x) for t, x in worker.lines if t < joined_at(worker)], exits_at=joined_at(worker) - 0.05, exit_code=137
    )
    restart, took = node.heal()
    assert took < 10, f"an exited rank fails the boot at once: {took:.1f} s"
    assert "rank 1 (node node-2" in restart["result"] and "exit code 137" in restart["result"], restart


def test_an_oom_killed_rank_is_healed_and_recorded_as_oom_killed(node: Node) -> None:
    # docker's inspect of a container the kernel's OOM killer ended: State.OOMKilled true, exit code 137.
    assert node.leader.step().action == "verify"
    node.kill_worker(OOMKilled=True)
    decision = node.leader.step()
    assert decision.action == "heal" and decision.why == "the rank on node-2 was OOM-killed", decision
    (restart,) = node.leader.store.snapshot()["restarts"]
    assert restart["cause"] == "the rank on node-2 was OOM-killed" and restart["result"] == "verified", restart


def test_a_rank_oom_killed_during_the_boot_is_named_so(node: Node) -> None:
    worker = real_boot("worker")
    node.worker.scripts["rank-2"] = Script(
        [(t, x) for t, x in worker.lines if t < 0.4], exits_at=0.4, exit_code=137, oom_killed=True
    )
    restart, _ = node.heal()
    assert "node node-2" in restart["result"] and "OOM killer" in restart["result"], restart


def test_a_pause_during_the_boot_leaves_the_ranks_to_the_operator(node: Node) -> None:
    node.worker.scripts["rank-2"] = without(real_boot("worker"), log_patterns.is_join_line)

    def pause_once_booting() -> None:
        # The event, not a delay: a timer raced the restart's own start on a loaded machine.
        deadline = time.monotonic() + 10
        while not ("rank-1" in node.head.booted and "rank-2" in node.worker.booted) and time.monotonic() < deadline:
            time.sleep(0.01)
        node.leader.store.update(paused=True)

    threading.Thread(target=pause_once_booting, daemon=True).start()
    restart, took = node.heal()
    assert restart["result"] == "left to paused by the operator", restart
    assert took < 5, took


def test_the_agent_serves_its_ranks_log_from_dockers_frames(node: Node) -> None:
    url = node.leader.lead.nodes[1].url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    node.worker.started["rank-2"] = time.time() - 100  # the whole boot is in the log
    got = requests.get(f"{url}/rank/logs?since=0", headers=auth, timeout=5).json()
    texts = [item["text"] for item in got["lines"]]
    assert texts == [x for _, x in node.worker.scripts["rank-2"].lines], "every line, stdout and stderr, in order"
    assert all(item["at"].endswith("Z") for item in got["lines"])
    later = got["lines"][-3]["at"]
    since = boot.unix_since(later)
    assert len(requests.get(f"{url}/rank/logs?since={since}", headers=auth, timeout=5).json()["lines"]) == 3
    bad = requests.get(f"{url}/rank/logs?since=yesterday", headers=auth, timeout=5)
    assert bad.status_code == 400 and "since=" in bad.json()["error"]
    usage = requests.get(f"{url}/rank/usage", headers=auth, timeout=5).json()
    assert usage["memory_bytes"] == float(2 << 30) and usage["block_read_bytes"] == float(5 << 20), usage
    assert requests.get(f"{url}/rank/logs?since=0", timeout=5).status_code == 401


def test_dockers_multiplexed_stream_is_decoded_and_a_cut_frame_left_for_the_next_read() -> None:
    raw = frame(1, b"2026-12-02T23:06:16.1Z out\n") + frame(2, b"2026-12-02T23:06:16.2Z err\n")
    assert boot.demultiplex(raw, tty=False) == "2026-12-02T23:06:16.1Z out\n2026-12-02T23:06:16.2Z err\n"
    assert boot.demultiplex(raw[:-3], tty=False) == "2026-12-02T23:06:16.1Z out\n"
    assert boot.demultiplex(b"plain tty text\n", tty=True) == "plain tty text\n"
    with pytest.raises(ValueError, match="not multiplexed"):
        boot.demultiplex(b"2026-12-02T23:06:16Z raw text without frames\n", tty=False)


def test_stats_make_the_usage_the_stall_rule_compares() -> None:
    cgroup_v1 = {
        "memory_stats": {"usage": 10 << 30, "stats": {"total_inactive_file": 4 << 30}},
        "blkio_stats": {"io_service_bytes_recursive": [{"op": "Read", "value": 7}, {"op": "Write", "value": 2}]},
    }
    usage = boot.usage_of_stats(cgroup_v1)
    assert usage["memory_bytes"] == float(6 << 30) and (usage["block_read_bytes"], usage["block_written_bytes"]) == (
        7.0,
        2.0,
    )
    assert usage["text"] == "memory 6.0GiB, block I/O 7B / 2B"
    assert boot.usage_of_stats({})["memory_bytes"] is None, "a stopped container's empty stats are unknown, not 0"
