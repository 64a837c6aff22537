"""LiveRanks: a rank found not running, or an endpoint without real logprobs, on a preview or up replaces every
rank; a healthy deployment changes nothing."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from components.gates import live_ranks
from components.gates.gates import GateRank
from components.gates.observations import ContainerState, SourceError
from components.gates.poll_source import SshRankSource
from components.ssh import SshAccess
from components.verify import client as verify
from tests.support import recording
from tests.support.fake_ssh import install_fake_ssh
from tests.support.fake_vllm import (
    ENGINE_DEAD_BODY,
    NAN_STREAM_ERROR,
    FakeVllm,
    Reply,
    chat_body,
    free_port,
    good_items,
    logprob_item,
)

RANKS = [
    GateRank(rank=0, node="head", host="10.0.0.1", port=22, user="me", container="c-head"),
    GateRank(rank=1, node="worker", host="10.0.0.2", port=22, user="me", container="c-worker"),
]
PROPS: dict[str, Any] = {
    "ranks": [r.to_props() for r in RANKS],
    "ssh": {"private_key": None, "agent_socket": None, "known_hosts_file": None},
    "observed": {},
}


class FakeSource:
    def __init__(self, states: dict[int, ContainerState | Exception]) -> None:
        self.states = states
        self.argv = SshRankSource(RANKS).argv  # the probe from the head runs over the real ssh argv

    def state(self, rank: int) -> ContainerState:
        s = self.states[rank]
        if isinstance(s, Exception):
            raise s
        return s


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> dict[int, ContainerState | Exception]:
    states: dict[int, ContainerState | Exception] = {
        0: ContainerState(status="running"),
        1: ContainerState(status="running"),
    }
    monkeypatch.setattr(live_ranks, "rank_source", lambda _ranks, _ssh: FakeSource(states))
    return states


def test_healthy_ranks_change_nothing(world: dict[int, Any]) -> None:
    diff = live_ranks.LiveRanksProvider().diff("live-1", PROPS, PROPS)
    assert not diff.changes and not diff.replaces


@pytest.mark.parametrize("down", [ContainerState(status="exited", exit_code=137), ContainerState(status="missing")])
def test_a_rank_not_running_replaces_live_ranks(world: dict[int, Any], down: ContainerState) -> None:
    world[1] = down
    diff = live_ranks.LiveRanksProvider().diff("live-1", PROPS, PROPS)
    assert diff.changes and diff.replaces == ["observed"], "the replacement is what replaces every rank"


def test_a_head_exited_0_is_named_a_dead_rank(world: dict[int, Any], warnings: list[str]) -> None:
    world[0] = ContainerState(status="exited", exit_code=0)
    diff = live_ranks.LiveRanksProvider().diff("live-1", PROPS, PROPS)
    assert diff.replaces == ["observed"]
    assert any("head (the head) is exited (0): a rank of the group died" in w for w in warnings), warnings


def test_an_unreachable_node_is_not_drift(world: dict[int, Any], warnings: list[str]) -> None:
    world[1] = SourceError("ssh me@10.0.0.2:22 timed out")
    diff = live_ranks.LiveRanksProvider().diff("live-1", PROPS, PROPS)
    assert not diff.replaces and not diff.changes
    # Not drift, but not silence either: the operator is told which node could not be read, and why.
    unreachable = [w for w in warnings if "cannot tell whether its rank runs" in w]
    assert len(unreachable) == 1, warnings
    assert "node worker unreachable: ssh me@10.0.0.2:22 timed out" in unreachable[0]


def test_refresh_reports_what_runs(world: dict[int, Any]) -> None:
    world[0] = ContainerState(status="exited", exit_code=143)
    read = live_ranks.LiveRanksProvider().read("live-1", dict(PROPS))
    assert read.outs["observed"] == {"head": "exited (143)", "worker": "running"}


def test_new_ssh_settings_update_in_place(world: dict[int, Any]) -> None:
    news = {**PROPS, "ssh": {**PROPS["ssh"], "known_hosts_file": "/etc/ssh/known"}}
    diff = live_ranks.LiveRanksProvider().diff("live-1", PROPS, news)
    assert diff.changes and not diff.replaces


def test_state_from_before_the_ssh_object_reads_its_flat_keys() -> None:
    from components.gates.gates import ssh_of

    old = {"ssh_private_key": "KEY", "ssh_agent_socket": "/run/agent", "ssh_known_hosts_file": None}
    assert ssh_of(old) == SshAccess(private_key="KEY", agent_socket="/run/agent")
    assert ssh_of(PROPS) == SshAccess()


# ---------------------------------------------------------------------------------------------
# Every rank runs, but does the endpoint still compute? One 1-token completion, the verifier's rules.

MODEL = "fake-model"
KEY = "sk-probe-secret-0123-0123456789a"


def probed(fake: FakeVllm, key: str | None = None) -> dict[str, Any]:
    return {**PROPS, "endpoint": fake.url, "model": MODEL, "api_key": key}


@pytest.fixture
def head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The head's ssh (a fake `ssh` running head_request.sh against a fake `docker`, whose `exec` runs the probe
    program on this machine): the probe from the head goes to 127.0.0.1 at the endpoint's port."""
    return install_fake_ssh(tmp_path, monkeypatch)


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    said: list[str] = []
    monkeypatch.setattr(live_ranks.pulumi.log, "warn", lambda msg, *_a, **_k: said.append(str(msg)))
    return said


def test_a_healthy_endpoint_costs_one_tiny_completion_and_changes_nothing(
    world: dict[int, Any], warnings: list[str]
) -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as fake:
        props = probed(fake, KEY)
        diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
        sent = fake.completion_requests()
    assert not diff.changes and not diff.replaces and not warnings, warnings
    assert len(sent) == 1, "one probe per preview or up"
    body = sent[0].body
    assert (body["max_tokens"], body["temperature"], body["logprobs"], body["top_logprobs"]) == (1, 0, True, 1)
    assert sent[0].headers.get("Authorization") == f"Bearer {KEY}"


@pytest.mark.parametrize(
    ("reply", "seen"),
    [
        (
            Reply(
                status=400,
                body=json.dumps(
                    {"error": {"message": NAN_STREAM_ERROR, "type": "BadRequestError", "code": 400}}
                ).encode(),
            ),
            "NaN",
        ),
        (Reply(body=chat_body([logprob_item("Paris", -9999.0)]).encode()), "-9999.0"),
        (Reply(body=chat_body([logprob_item("Paris", None)]).encode()), "null"),
        (Reply(status=500, body=b'{"error":{"message":"EngineCore encountered an issue"}}'), "HTTP 500"),
    ],
)
def test_an_endpoint_without_real_logprobs_replaces_every_rank(
    world: dict[int, Any], warnings: list[str], reply: Reply, seen: str
) -> None:
    with FakeVllm(reply) as fake:
        props = probed(fake)
        diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
    assert diff.changes and diff.replaces == ["observed"], "the replacement is what replaces every rank"
    assert any(seen in w and "every rank is replaced" in w for w in warnings), warnings


def test_a_refused_connection_while_every_rank_runs_is_drift(
    world: dict[int, Any], warnings: list[str], head: Path
) -> None:
    props = {**PROPS, "endpoint": f"http://127.0.0.1:{free_port()}/v1", "model": MODEL, "api_key": None}
    diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
    assert diff.replaces == ["observed"], warnings
    (warning,) = [w for w in warnings if "refuses connections" in w]
    assert "from the head itself too: refuses connections" in warning and "c-head on head" in warning, warning


@pytest.fixture
def short_probe(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(live_ranks, "PROBE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(verify, "BUSY_CHECK_GAP_S", 0.3)
    return 0.5


def test_a_hung_endpoint_with_a_frozen_engine_is_drift_within_the_bound(
    world: dict[int, Any], warnings: list[str], short_probe: float, head: Path
) -> None:
    frozen = 'vllm:iteration_tokens_total_count{engine="0"} 42.0\n'
    with FakeVllm(Reply(hang_s=30), metrics=lambda: frozen) as fake:
        props = probed(fake)
        started = time.monotonic()
        diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
        took = time.monotonic() - started
    assert diff.replaces == ["observed"], warnings
    assert any(
        "a rank is dead or hung" in w and "stayed at 42" in w and "from the head itself too" in w for w in warnings
    ), warnings
    assert took < verify.probe_worst_case_seconds(short_probe), f"the probe must be bounded, took {took:.1f} s"


def _working(kv: list[float], running: list[int], tokens: list[int]) -> Any:
    """Real vLLM 0.32's /metrics while it works: the i-th read shows the i-th value of each list."""
    reads = iter(range(len(kv)))

    def metrics() -> str:
        i = next(reads)
        return (
            f'vllm:iteration_tokens_total_count{{engine="0"}} 40\n'
            f'vllm:prompt_tokens_total{{engine="0"}} 601000\n'
            f'vllm:generation_tokens_total{{engine="0"}} {tokens[i]}\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} {kv[i]}\n'
            f'vllm:num_requests_running{{engine="0"}} {running[i]}\n'
        )

    return metrics


@pytest.mark.parametrize(
    ("kv", "running", "tokens", "busy"),
    [
        # both slots in long partial prefills: no step with output moves a counter, the KV cache fills
        ([0.41, 0.43], [2, 2], [33, 33], "KV cache usage 41.00% -> 43.00%"),
        # a prefill step longer than the gap: nothing moves between the reads, but requests run
        ([0.43, 0.43], [1, 1], [33, 33], "1 request(s) running"),
        # a token counter moves (the last decode of a request that just ended)
        ([0.0, 0.0], [0, 0], [33, 34], "tokens 601033 -> 601034"),
    ],
)
def test_a_busy_engine_is_not_drift(
    world: dict[int, Any],
    warnings: list[str],
    short_probe: float,
    kv: list[float],
    running: list[int],
    tokens: list[int],
    busy: str,
) -> None:
    with FakeVllm(Reply(hang_s=30), metrics=_working(kv, running, tokens)) as fake:
        props = probed(fake)
        diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
    assert not diff.replaces, "a serving deployment is never replaced on a guess"
    assert any(f"busy ({busy}" in w and "not treated as drift" in w for w in warnings), warnings


def test_a_busy_engine_that_keeps_stepping_is_not_drift(
    world: dict[int, Any], warnings: list[str], short_probe: float
) -> None:
    steps = iter(range(100, 10_000, 7))
    with FakeVllm(Reply(hang_s=30), metrics=lambda: f"vllm:iteration_tokens_total_count {next(steps)}\n") as fake:
        props = probed(fake)
        diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
    assert not diff.replaces, "a serving deployment is never replaced on a guess"
    assert any("busy (engine steps" in w and "not treated as drift" in w for w in warnings), warnings


def test_a_refused_key_is_reported_not_drift_and_never_shown(world: dict[int, Any], warnings: list[str]) -> None:
    echo = json.dumps({"error": {"message": f"Unauthorized: bad key {KEY}", "code": 401}}).encode()
    with FakeVllm(Reply(status=401, body=echo)) as fake:
        props = probed(fake, KEY)
        diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
    assert not diff.replaces and warnings, warnings
    assert not any(KEY in w for w in warnings), "the API key never reaches the output"


def test_no_probe_when_a_rank_is_down(world: dict[int, Any], warnings: list[str]) -> None:
    world[1] = ContainerState(status="exited", exit_code=1)
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as fake:
        props = probed(fake)
        diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
        assert diff.replaces == ["observed"] and not fake.completion_requests()


def test_the_deployed_endpoint_is_probed_not_the_configured_one(world: dict[int, Any], warnings: list[str]) -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as deployed:
        olds = probed(deployed, KEY)
        news = {**olds, "endpoint": f"http://127.0.0.1:{free_port()}/v1", "api_key": "sk-next-0123456789abcdef01234567"}
        diff = live_ranks.LiveRanksProvider().diff("live-1", olds, news)
        assert len(deployed.completion_requests()) == 1
    assert not diff.replaces and diff.changes, "the new endpoint is stored in place; the containers follow"


def test_refresh_reports_what_the_endpoint_answers(world: dict[int, Any]) -> None:
    nan = json.dumps({"error": {"message": NAN_STREAM_ERROR, "code": 400}}).encode()
    with FakeVllm(Reply(status=400, body=nan)) as fake:
        read = live_ranks.LiveRanksProvider().read("live-1", probed(fake))
    assert "NaN" in read.outs["endpoint_observed"], read.outs


def test_no_answer_and_no_tcp_connection_is_unreachable_not_drift(
    world: dict[int, Any], warnings: list[str], short_probe: float, head: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeVllm(Reply(hang_s=30)) as fake:  # no /metrics either
        props = probed(fake)
        hung = live_ranks.LiveRanksProvider().diff("live-1", props, props)
        assert hung.replaces == ["observed"] and any("/metrics does not answer" in w for w in warnings), warnings
        monkeypatch.setattr(verify, "_accepts", lambda _endpoint: False)  # a route that drops packets
        dropped = live_ranks.LiveRanksProvider().diff("live-1", props, props)
    assert not dropped.replaces and "cannot be reached" in warnings[-1], warnings


# ---------------------------------------------------------------------------------------------
# What the network between could cause is confirmed from the head itself before anything is replaced.


def test_http_429_is_busy_not_drift(world: dict[int, Any], warnings: list[str], head: Path) -> None:
    with FakeVllm(Reply(status=429, body=b'{"detail":"rate limited"}')) as fake:
        props = probed(fake)
        diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
    assert not diff.replaces and any("HTTP 429" in w and "busy" in w for w in warnings), warnings
    assert not (head / "head.n").exists(), "nothing to confirm: too many requests is no drift from anywhere"


@pytest.mark.parametrize("status", [403, 404, 502, 504])
def test_an_http_error_seen_only_from_this_machine_is_a_warning(
    world: dict[int, Any], warnings: list[str], head: Path, status: int
) -> None:
    # A proxy in front of the head answers `status` (127.0.0.2); the head itself serves real logprobs on the
    # same port of its own loopback (127.0.0.1).
    with (
        FakeVllm(Reply(body=chat_body(good_items()).encode())) as served,
        FakeVllm(
            Reply(status=status, body=b'{"detail":"from the proxy"}'),
            host="127.0.0.2",
            port=int(served.url.split(":")[2].split("/")[0]),
        ) as proxy,
    ):
        props = probed(proxy, KEY)
        diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
        (asked,) = served.completion_requests()
    assert not diff.replaces, warnings
    (warning,) = [w for w in warnings if "from the head itself" in w]
    assert f"HTTP {status}" in warning and "answers with real logprobs" in warning and "not the ranks" in warning
    assert asked.headers.get("Authorization") == f"Bearer {KEY}", "the head's probe carries the key"
    assert asked.body["max_tokens"] == 1
    assert KEY not in (head / "argv.log").read_text() + (head / "docker.log").read_text(), "the key never in argv"
    assert not any(KEY in w for w in warnings)


@pytest.mark.parametrize("proxy", ["refused", "hang"])
def test_a_refused_or_hung_route_with_a_healthy_head_is_a_warning(
    world: dict[int, Any], warnings: list[str], head: Path, short_probe: float, proxy: str
) -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as served:
        port = int(served.url.split(":")[2].split("/")[0])
        if proxy == "refused":  # nothing listens on 127.0.0.2 (a firewall's reject)
            diff = live_ranks.LiveRanksProvider().diff(
                "live-1", *[{**PROPS, "endpoint": f"http://127.0.0.2:{port}/v1", "model": MODEL, "api_key": None}] * 2
            )
        else:
            with FakeVllm(Reply(hang_s=30), host="127.0.0.2", port=port) as hung:
                diff = live_ranks.LiveRanksProvider().diff("live-1", probed(hung), probed(hung))
    assert not diff.replaces, warnings
    assert any("but from the head itself it answers with real logprobs" in w for w in warnings), warnings


def test_drift_the_head_cannot_confirm_is_a_warning(world: dict[int, Any], warnings: list[str], head: Path) -> None:
    (head / "exec.fail").write_text("Error response from daemon: container c-head is not running")
    props = {**PROPS, "endpoint": f"http://127.0.0.1:{free_port()}/v1", "model": MODEL, "api_key": None}
    diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
    assert not diff.replaces, warnings
    (warning,) = [w for w in warnings if "refuses connections" in w]
    assert "the head could not confirm it" in warning and "container c-head is not running" in warning, warning


def test_what_the_server_proves_is_drift_without_asking_the_head(
    world: dict[int, Any], warnings: list[str], head: Path
) -> None:
    nan = Reply(body=chat_body([logprob_item("Paris", None)]).encode())
    for reply in (Reply(status=500, body=ENGINE_DEAD_BODY), nan):
        with FakeVllm(reply) as fake:
            props = probed(fake)
            assert live_ranks.LiveRanksProvider().diff("live-1", props, props).replaces == ["observed"]
    assert not (head / "head.n").exists(), "no probe from the head"
    assert any("a rank of the group died" in w for w in warnings), warnings


def test_every_node_is_read_at_once_not_one_after_another() -> None:
    # Eight nodes: each read waits until all eight are in flight. Read one after another, the first read
    # would wait for the others forever (the barrier breaks after 10 s and the test fails).
    ranks = [
        GateRank(rank=i, node=f"n{i}", host=f"10.0.0.{i + 1}", port=22, user="me", container=f"c{i}") for i in range(8)
    ]
    barrier = threading.Barrier(len(ranks), timeout=10)

    def state(rank: int) -> ContainerState:
        barrier.wait()
        if rank == 3:
            raise SourceError("ssh me@10.0.0.4:22 timed out")
        return ContainerState(status="running") if rank != 5 else ContainerState(status="exited", exit_code=137)

    observed = live_ranks.observe(ranks, state)
    assert list(observed) == [f"n{i}" for i in range(8)], "reported in rank order"
    assert observed["n3"] == "unreachable: ssh me@10.0.0.4:22 timed out"
    assert observed["n5"] == "exited (137)"
    assert {observed[f"n{i}"] for i in (0, 1, 2, 4, 6, 7)} == {"running"}


# ---------------------------------------------------------------------------------------------
# The supervisor's own fresh, healthy probe stands in for the preview's.

TOKEN = "supervisor-token-4711"


class FakeSupervisor:
    """GET /status with the bearer token, answering `status`; counts the requests."""

    def __init__(self, status: dict[str, Any]) -> None:
        import http.server

        self.status, self.requests = status, 0
        self.auth: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.requests += 1
                outer.auth.append(self.headers.get("Authorization", ""))
                body = json.dumps(outer.status).encode()
                self.send_response(200 if self.path == "/status" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def status(age_s: float = 10.0, state: str = "healthy", **over: Any) -> dict[str, Any]:
    now = 1_800_000_000.0
    return {
        "now": now,
        "last_probe": {"at": now - age_s, "state": state, "seen": "answered"},
        "armed_generation": "g1",
        "paused": False,
        "given_up": None,
        "doing": "watching",
        **over,
    }


def with_supervisor(props: dict[str, Any], sup: FakeSupervisor, fresh_s: float = 60.0) -> dict[str, Any]:
    return {**props, "supervisor_url": sup.url, "supervisor_token": TOKEN, "supervisor_fresh_s": fresh_s}


def test_a_fresh_healthy_supervisor_probe_replaces_the_previews_own(
    world: dict[int, Any], warnings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    monkeypatch.setattr(live_ranks.pulumi.log, "info", lambda msg, *_a, **_k: said.append(str(msg)))
    sup = FakeSupervisor(status(age_s=80.0))  # 60 s interval + 30 s slack: still fresh
    try:
        with FakeVllm(Reply(body=chat_body(good_items()).encode())) as fake:
            props = with_supervisor(probed(fake, KEY), sup)
            diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
            sent = fake.completion_requests()
    finally:
        sup.close()
    assert not diff.changes and not warnings, warnings
    assert sent == [], "the supervisor's probe stood in: no completion from the preview"
    assert sup.auth == [f"Bearer {TOKEN}"]
    assert any("supervisor: watching; its last probe healthy 80 s ago" in s for s in said), said
    assert not any(TOKEN in s for s in said)


@pytest.mark.parametrize(
    "found",
    [
        status(age_s=120.0),  # stale: older than probeSeconds + slack
        status(state="drift"),
        status(state="unverified"),
        status(paused=True),
        status(given_up="3 restarts in 6 h"),
        status(armed_generation=None),  # never verified: it acts on nothing yet
        {"now": 1.0},  # no probe yet
    ],
)
def test_anything_but_a_fresh_healthy_armed_supervisor_leaves_the_probe_to_the_preview(
    world: dict[int, Any], warnings: list[str], found: dict[str, Any]
) -> None:
    sup = FakeSupervisor(found)
    try:
        with FakeVllm(Reply(body=chat_body(good_items()).encode())) as fake:
            props = with_supervisor(probed(fake, KEY), sup)
            diff = live_ranks.LiveRanksProvider().diff("live-1", props, props)
            sent = fake.completion_requests()
    finally:
        sup.close()
    assert not diff.changes
    assert len(sent) == 1, "the preview probed the endpoint itself"
    assert sup.requests == 1


def test_an_unreachable_supervisor_is_reported_and_the_preview_probes() -> None:
    said: list[str] = []
    props = {**PROPS, "supervisor_url": "http://127.0.0.1:9", "supervisor_token": TOKEN, "supervisor_fresh_s": 60.0}
    assert live_ranks.supervisor_verdict(live_ranks.args_of(props), report=said.append) is None
    assert len(said) == 1 and "did not answer" in said[0] and TOKEN not in said[0]
    no_supervisor = live_ranks.args_of(PROPS)
    assert live_ranks.supervisor_verdict(no_supervisor, report=said.append) is None and len(said) == 1, "no ask"


# ---------------------------------------------------------------------------------------------
# The properties a deployed stack holds.

# The inputs the diff compared before LiveRanksArgs was a contract.
OLD_INPUT_KEYS = ("ranks", "ssh", "endpoint", "model", "api_key")
# The ranks as the program wires them (components/gates/wiring.py gate_ranks) for two Sparks under `share: nfs`.
PROGRAM_RANKS = (
    GateRank(rank=0, node="spark-0", host="10.0.0.1", user="me", container="dsv41-exl3-dev-spark-0"),
    GateRank(
        rank=1,
        node="spark-1",
        host="10.0.0.2",
        port=2222,
        user="me",
        container="dsv41-exl3-dev-spark-1",
        fabric_interface="enp1s0f0np0",
        nfs_server="192.168.100.1",
    ),
)
SSH_KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----"
# The properties LiveRanks registered before LiveRanksArgs was a contract (built by hand in LiveRanks.__init__), for
# the args of `program_args`, as the engine stores them: None left out at the top (kept inside `ssh`), numbers as
# floats, credentials secret.
RECORDED = {
    "ranks": [
        {
            "rank": 0.0,
            "node": "spark-0",
            "host": "10.0.0.1",
            "port": 22.0,
            "user": "me",
            "container": "dsv41-exl3-dev-spark-0",
            "fabric_interface": "",
            "nfs_server": "",
        },
        {
            "rank": 1.0,
            "node": "spark-1",
            "host": "10.0.0.2",
            "port": 2222.0,
            "user": "me",
            "container": "dsv41-exl3-dev-spark-1",
            "fabric_interface": "enp1s0f0np0",
            "nfs_server": "192.168.100.1",
        },
    ],
    "ssh": {"private_key": recording.wire_secret(SSH_KEY), "agent_socket": None, "known_hosts_file": "/home/me/kh"},
    "endpoint": "http://10.0.0.1:8888/v1",
    "model": "DeepSeek-v4.1-Flash-EXL3",
    "api_key": recording.wire_secret("sk-deploy-secret-0123456789abcde"),
    "supervisor_url": "http://10.0.0.1:8781",
    "supervisor_token": recording.wire_secret(TOKEN),
    "supervisor_fresh_s": 60.0,
}
# Every key that old code put in the properties, None ones included.
RECORDED_KEYS = {*RECORDED, "observed", "endpoint_observed"}
RECORDED_SECRET_OUTPUTS = ["ssh", "api_key", "supervisor_token"]


def program_args(supervisor: bool = True) -> live_ranks.LiveRanksArgs:
    """As components/gates/wiring.py builds them: the stack's ssh section, the serving API key, the supervisor."""
    import pulumi

    token = TOKEN if supervisor else None
    return live_ranks.LiveRanksArgs(
        ranks=PROGRAM_RANKS,
        ssh=SshAccess(private_key=pulumi.Output.secret(SSH_KEY), known_hosts_file="/home/me/kh"),
        endpoint="http://10.0.0.1:8888/v1",
        model="DeepSeek-v4.1-Flash-EXL3",
        api_key=pulumi.Output.secret("sk-deploy-secret-0123456789abcde"),
        supervisor_url="http://10.0.0.1:8781" if token else None,
        supervisor_token=pulumi.Output.secret(token) if token else None,
        supervisor_fresh_s=60.0 if token else None,
    )


def test_the_properties_keep_the_shape_deployed_stacks_hold() -> None:
    """A deployed stack's next `up` sees no diff: same keys, nesting, values and secrets as before the contract."""
    from components.dynamic import props_of

    assert {*props_of(program_args()), "observed", "endpoint_observed"} == RECORDED_KEYS
    assert live_ranks.INPUT_KEYS == OLD_INPUT_KEYS == live_ranks.LiveRanksProvider.input_keys

    def program() -> None:
        live_ranks.LiveRanks("live-ranks", program_args())
        live_ranks.LiveRanks("live-ranks-alone", program_args(supervisor=False))

    rec = recording.run(program)
    assert rec.named("live-ranks").stored() == RECORDED
    alone = {k: v for k, v in RECORDED.items() if not k.startswith("supervisor_")}
    assert rec.named("live-ranks-alone").stored() == alone, "no supervisor: none of its keys"
    for name in ("live-ranks", "live-ranks-alone"):
        assert rec.named(name).additional_secret_outputs == RECORDED_SECRET_OUTPUTS


def test_the_provider_reads_back_what_the_program_sent() -> None:
    props = {**RECORDED, "ssh": {**RECORDED["ssh"], "private_key": SSH_KEY}, "__provider": "pickled"}
    args = live_ranks.args_of({**props, "api_key": "sk-deploy-secret-0123456789abcde", "supervisor_token": TOKEN})
    assert args.ranks == PROGRAM_RANKS
    assert args.ssh == SshAccess(private_key=SSH_KEY, known_hosts_file="/home/me/kh")
    assert (args.endpoint, args.model, args.api_key) == (
        RECORDED["endpoint"],
        RECORDED["model"],
        "sk-deploy-secret-0123456789abcde",
    )
    assert (args.supervisor_url, args.supervisor_token, args.supervisor_fresh_s) == ("http://10.0.0.1:8781", TOKEN, 60)
    assert not any(secret in repr(args) for secret in (SSH_KEY, "sk-deploy-secret-0123456789abcde", TOKEN)), repr(args)


def test_state_from_before_the_ssh_object_and_the_probe_is_still_read(world: dict[int, Any]) -> None:
    """A stack deployed before `ssh` was one object and before LiveRanks probed: flat ssh keys, no endpoint."""
    old = {"ranks": PROPS["ranks"], "ssh_private_key": "KEY", "ssh_agent_socket": "/run/agent", "observed": {}}
    args = live_ranks.args_of(old)
    assert args.ssh == SshAccess(private_key="KEY", agent_socket="/run/agent")
    assert (args.endpoint, args.model, args.api_key, args.supervisor_url) == ("", "", None, None)
    assert live_ranks.LiveRanksProvider().read("live-1", old).outs["observed"] == {
        "head": "running",
        "worker": "running",
    }
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as configured:
        news = probed(configured)
        diff = live_ranks.LiveRanksProvider().diff("live-1", old, news)
        assert len(configured.completion_requests()) == 1, "nothing deployed to probe: the config's endpoint is"
    assert diff.changes and not diff.replaces, "the new properties are stored in place"
