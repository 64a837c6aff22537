"""The gates' dynamic providers: create/update/diff against a fake `ssh` and a loopback /v1/models, pickling,
and what the program registers."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import dill
import pulumi
import pytest
from pulumi.dynamic.dynamic import serialize_provider
from pulumi.runtime import rpc

from components.gates import gates
from components.gates.decisions import GateBounds
from components.gates.gates import (
    GateRank,
    ReadyGate,
    ReadyGateArgs,
    ReadyGateProvider,
    RendezvousGate,
    RendezvousGateArgs,
    RendezvousGateProvider,
)
from components.gates.observations import GateFailure
from components.ssh import SshAccess
from tests.support import recording
from tests.support.bounds import bounds
from tests.support.fake_ssh import KEY, canned, install_fake_ssh, serve_models
from tests.support.imports import import_side_effects

REPO = Path(__file__).resolve().parents[2]
MODEL = "DeepSeek-v4.1-Flash-EXL3"
API_KEY = "sk-gate-test-0123456789-01234567"

RANKS = [
    GateRank(rank=0, node="spark-a", host="127.0.0.2", port=2222, user="root", container="dsv41-rank0"),
    GateRank(rank=1, node="spark-b", host="127.0.0.3", port=2222, user="root", container="dsv41-rank1"),
]


def _rdv_args(**over: Any) -> RendezvousGateArgs:
    """What the program wires, with config's default timeout."""
    args: dict[str, Any] = {
        "ranks": tuple(RANKS),
        "rerun_on": [],
        "ssh": SshAccess(),
        "bounds": bounds(rendezvous_timeout_s=720.0),
        "poll_interval_s": gates.POLL_INTERVAL_S,
        "progress_interval_s": gates.PROGRESS_INTERVAL_S,
    }
    return RendezvousGateArgs(**{**args, **over})


def _ready_args(**over: Any) -> ReadyGateArgs:
    """What the program wires, with config's default timeouts."""
    args: dict[str, Any] = {
        "ranks": tuple(RANKS),
        "rerun_on": [],
        "api_base": "http://127.0.0.1:8888",
        "model_name": MODEL,
        "api_key": None,
        "ssh": SshAccess(),
        "bounds": bounds(ready_timeout_s=2700.0, stall_s=600.0),
        "poll_interval_s": gates.POLL_INTERVAL_S,
        "progress_interval_s": gates.PROGRESS_INTERVAL_S,
        "models_timeout_s": gates.MODELS_TIMEOUT_S,
    }
    return ReadyGateArgs(**{**args, **over})


def _props(limits: dict[str, float], over: dict[str, Any]) -> dict[str, Any]:
    """As the engine hands them to the provider: `bounds` given by its changed values."""
    props: dict[str, Any] = {
        "ranks": [r.to_props() for r in RANKS],
        "ssh": {"private_key": KEY, "agent_socket": None, "known_hosts_file": None},
        "poll_interval_s": 0.05,
        "progress_interval_s": 30,
        "rerun_on": ["cid-head-1", "cid-worker-1"],
        "__provider": "pickled-code-v1",
    }
    given = {k: over.pop(k) for k in list(over) if k in GateBounds.field_names()}
    props["bounds"] = bounds(**{**limits, **given}).to_props()
    return {**props, **over}


def _rdv_props(**over: Any) -> dict[str, Any]:
    return _props({"rendezvous_timeout_s": 5}, over)


def _ready_props(api_base: str, **over: Any) -> dict[str, Any]:
    base = {"api_base": api_base, "model_name": MODEL, "api_key": API_KEY, "models_timeout_s": 2}
    return _props({"ready_timeout_s": 5, "stall_s": 5}, {**base, **over})


# --- args -----------------------------------------------------------------------------------------------


class TestArgs:
    def test_ranks_must_be_0_to_n_minus_1(self) -> None:
        with pytest.raises(ValueError, match=r"gate ranks \[0, 2\] must be 0..N-1"):
            _rdv_args(ranks=[RANKS[0], GateRank(rank=2, node="c", host="127.0.0.4", user="u", container="x")])
        with pytest.raises(ValueError, match=r"gate ranks \[1\]"):
            _rdv_args(ranks=[RANKS[1]])

    def test_container_name_and_timeouts_are_checked(self) -> None:
        with pytest.raises(ValueError, match="'bad name;rm' on node 'a' is not a valid docker container name"):
            GateRank(rank=0, node="a", host="h", user="u", container="bad name;rm")
        with pytest.raises(ValueError, match="poll_interval_s=30"):
            _ready_args(poll_interval_s=30)
        with pytest.raises(ValueError, match="stall_s=0"):
            _ready_args(bounds=bounds(stall_s=0))

    def test_a_missing_setting_is_an_error_not_a_default(self) -> None:
        props = _rdv_props()
        del props["bounds"]["rendezvous_timeout_s"]
        with pytest.raises(ValueError, match=r"RendezvousGateArgs.bounds.rendezvous_timeout_s is missing"):
            RendezvousGateProvider().create(props)


# --- diff -----------------------------------------------------------------------------------------------


class TestDiff:
    def test_equal_inputs_are_no_change_even_when_the_provider_code_changed(self) -> None:
        olds = {**_rdv_props(), "passed_at": "2026-09-22T10:00:00Z", "elapsed_s": 3.2}
        news = _rdv_props(__provider="pickled-code-v2")
        assert RendezvousGateProvider().diff("id", olds, news).changes is False

    def test_numbers_round_tripped_as_floats_and_rerun_order_are_no_change(self) -> None:
        olds = _rdv_props(
            rendezvous_timeout_s=5.0, ranks=[{**r.to_props(), "port": 2222.0, "rank": float(r.rank)} for r in RANKS]
        )
        olds["bounds"] = {k: float(v) for k, v in olds["bounds"].items()}
        news = _rdv_props(rerun_on=["cid-worker-1", "cid-head-1"])
        assert RendezvousGateProvider().diff("id", olds, news).changes is False

    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("rerun_on", ["cid-head-2", "cid-worker-1"]),
            ("rerun_on", rpc.UNKNOWN),  # a container being replaced, seen in preview
            ("rendezvous_timeout_s", 900),
            ("ssh", {"private_key": "another key", "agent_socket": None, "known_hosts_file": None}),
            ("ranks", [RANKS[0].to_props(), {**RANKS[1].to_props(), "host": "127.0.0.9"}]),
        ],
    )
    def test_any_input_change_is_an_update_never_a_replace(self, key: str, value: Any) -> None:
        diff = RendezvousGateProvider().diff("id", _rdv_props(), _rdv_props(**{key: value}))
        assert diff.changes is True and diff.replaces == []

    def test_ready_gate_diff_covers_its_own_inputs(self) -> None:
        base = _ready_props("http://127.0.0.1:8888")
        assert ReadyGateProvider().diff("id", base, {**base, "__provider": "x"}).changes is False
        for key, value in (
            ("api_base", "http://127.0.0.1:9999"),
            ("model_name", "other"),
            ("api_key", "k2"),
            ("bounds", {**base["bounds"], "stall_s": 900}),
        ):
            assert ReadyGateProvider().diff("id", base, {**base, key: value}).changes is True, key


# --- create / update through the fake ssh --------------------------------------------------------------

JOINED_HEAD = (
    "2026-09-22T10:00:01Z (Worker_TP0 pid=1) INFO [parallel_state.py:1] world_size=2 rank=0 local_rank=0 "
    "distributed_init_method=tcp://127.0.0.2:29521 backend=nccl\n"
    "2026-09-22T10:00:30Z (Worker_TP0 pid=1) INFO [parallel_state.py:2] rank 0 in world size 2 is "
    "assigned as DP rank 0, PP rank 0, TP rank 0, EP rank 0\n"
)
BOOTED_HEAD = JOINED_HEAD + (
    f"2026-09-22T10:00:31Z (APIServer pid=1) INFO non-default args: {{'api_key': '{API_KEY}'}}\n"
    "2026-09-22T10:01:00Z (Worker_TP0 pid=1) INFO [gpu_model_runner.py:1] Starting to load model /model...\n"
    "2026-09-22T10:05:00Z (Worker_TP0 pid=1) INFO [gpu_worker.py:1] Available KV cache memory: 2.5 GiB\n"
    "2026-09-22T10:06:00Z (APIServer pid=1) INFO [api_server.py:1] Starting vLLM server on http://0.0.0.0:8888\n"
    "2026-09-22T10:06:01Z (APIServer pid=1) INFO:     Application startup complete.\n"
)
JOINED_WORKER = (
    "2026-09-22T10:00:02Z (Worker_TP1 pid=1) INFO [parallel_state.py:1] world_size=2 rank=1 "
    "local_rank=0 distributed_init_method=tcp://127.0.0.2:29521 backend=nccl\n"
    "2026-09-22T10:00:30Z (Worker_TP1 pid=1) INFO [pynccl.py:1] vLLM is using nccl==2.27.7\n"
)


def _cluster(d: Path, head: str, worker: str, worker_state: str = "running 0 2026-09-22T10:00:00Z") -> None:
    """Canned answers keyed by the container name in the remote command."""
    script = d.parent / "bin" / "ssh"
    # route by container: answers live in per-container subdirectories
    text = script.read_text().replace(
        'd="$FAKE_SSH_DIR"',
        'd="$FAKE_SSH_DIR"; for a in "$@"; do :; done; '
        'case "$a" in *dsv41-rank1*) d="$d/rank1";; *) d="$d/rank0";; esac',
    )
    script.write_text(text)
    for sub, logs, state in (("rank0", head, "running 0 2026-09-22T10:00:00Z"), ("rank1", worker, worker_state)):
        (d / sub).mkdir(exist_ok=True)
        canned(d / sub, "inspect", state + "\n")
        canned(d / sub, "logs.1", logs)
        canned(d / sub, "logs", "")


@pytest.fixture
def ssh_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return install_fake_ssh(tmp_path, monkeypatch)


class TestRendezvousProvider:
    def test_create_passes_and_returns_inputs_and_verdict(self, ssh_dir: Path) -> None:
        _cluster(ssh_dir, JOINED_HEAD, JOINED_WORKER)
        res = RendezvousGateProvider().create(_rdv_props())
        assert res.id.startswith("rendezvous-")
        outs = res.outs or {}
        assert outs["world_size"] == 2 and outs["joined_at"] == {
            "0": "2026-09-22T10:00:30Z",
            "1": "2026-09-22T10:00:30Z",
        }
        assert outs["rerun_on"] == ["cid-head-1", "cid-worker-1"] and outs["ranks"] == [r.to_props() for r in RANKS]
        assert outs["elapsed_s"] < 2 and outs["passed_at"].endswith("Z")
        assert "__provider" not in outs
        # ssh ran with the key file, never the key
        argv = (ssh_dir / "rank0" / "argv.log").read_text()
        assert "SECRETKEYMATERIAL" not in argv and "-i\n" in argv

    def test_update_reruns_and_returns_full_outputs_from_news(self, ssh_dir: Path) -> None:
        _cluster(ssh_dir, JOINED_HEAD, JOINED_WORKER)
        olds = {**_rdv_props(), "passed_at": "old", "elapsed_s": 1.0, "world_size": 2, "joined_at": {}}
        news = _rdv_props(rerun_on=["cid-head-2", "cid-worker-1"])
        outs = RendezvousGateProvider().update("id", olds, news).outs or {}
        assert outs["rerun_on"] == ["cid-head-2", "cid-worker-1"]
        assert outs["passed_at"] != "old" and set(outs) >= {
            *RendezvousGateArgs.field_names(),
            "passed_at",
            "elapsed_s",
            "world_size",
            "joined_at",
        }
        assert (ssh_dir / "rank1" / "logs.n").read_text().strip() == "1"  # the worker was read again

    def test_exited_worker_fails_create_at_once(self, ssh_dir: Path) -> None:
        _cluster(
            ssh_dir,
            JOINED_HEAD,
            "2026-09-22T10:00:02Z RuntimeError: NCCL error\n",
            worker_state="exited 1 2026-09-22T10:00:00Z",
        )
        t0 = time.monotonic()
        with pytest.raises(GateFailure) as err:
            RendezvousGateProvider().create(_rdv_props(rendezvous_timeout_s=60))
        assert time.monotonic() - t0 < 2
        msg = str(err.value)
        assert msg.startswith("rank 1 (node spark-b, container dsv41-rank1) is exited with exit code 1")
        assert "RuntimeError: NCCL error" in msg and "SECRETKEYMATERIAL" not in msg

    def test_deadline_is_enforced_in_real_time(self, ssh_dir: Path) -> None:
        _cluster(ssh_dir, JOINED_HEAD, "2026-09-22T10:00:02Z waiting\n")
        t0 = time.monotonic()
        with pytest.raises(GateFailure, match=r"within 0.6 s: rank 1 \(node spark-b"):
            RendezvousGateProvider().create(_rdv_props(rendezvous_timeout_s=0.6))
        assert 0.6 <= time.monotonic() - t0 < 3


class TestReadyProvider:
    def test_create_passes_with_phases_and_sends_the_key(self, ssh_dir: Path) -> None:
        _cluster(ssh_dir, BOOTED_HEAD, JOINED_WORKER)
        with serve_models([MODEL], api_key=API_KEY) as server:
            res = ReadyGateProvider().create(_ready_props(server.base))
        outs = res.outs or {}
        assert res.id.startswith("ready-")
        assert outs["phases"]["loading weights"] == "2026-09-22T10:01:00Z"
        assert outs["phases"]["API starting"] == "2026-09-22T10:06:00Z"
        assert outs["phases"]["ready"] == "2026-09-22T10:06:01Z"
        assert outs["api_key"] == API_KEY and outs["model_name"] == MODEL  # stored, marked secret by the resource
        assert server.seen[-1]["auth"] == f"Bearer {API_KEY}"

    def test_wrong_key_fails_without_showing_it(self, ssh_dir: Path) -> None:
        _cluster(ssh_dir, BOOTED_HEAD, JOINED_WORKER)
        with serve_models([MODEL], api_key="the-right-key") as server, pytest.raises(GateFailure) as err:
            ReadyGateProvider().create(_ready_props(server.base))
        msg = str(err.value)
        assert "refused the API key" in msg and API_KEY not in msg and "non-default args" in msg

    def test_stall_in_real_time(self, ssh_dir: Path) -> None:
        _cluster(ssh_dir, JOINED_HEAD, JOINED_WORKER)
        t0 = time.monotonic()
        with pytest.raises(GateFailure, match="stall limit 0.5 s"):
            ReadyGateProvider().create(_ready_props("http://127.0.0.1:9", stall_s=0.5))
        assert 0.5 <= time.monotonic() - t0 < 3

    def test_bad_api_base_is_rejected(self, ssh_dir: Path) -> None:
        with pytest.raises(ValueError, match="api_base='127.0.0.1:8888'"):
            ReadyGateProvider().create(_ready_props("127.0.0.1:8888"))


# --- pickling and import ------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", [RendezvousGateProvider(), ReadyGateProvider()])
def test_providers_pickle_by_reference(provider: pulumi.dynamic.ResourceProvider) -> None:
    blob = base64.b64decode(serialize_provider(provider))
    assert b"components.gates.gates" in blob and len(blob) < 400, "pickled by value: the class body went into the state"
    again = dill.loads(blob)
    assert type(again) is type(provider) and vars(again) == {}


def test_module_imports_without_side_effects() -> None:
    assert import_side_effects("components.gates.gates", "components.gates.rank_watch") == []


# --- what the program registers ------------------------------------------------------------------------


class _SecretOutputsMonitor(recording.RecordingMonitor):
    seen: dict[str, list[str]] = {}

    def RegisterResource(self, request: Any) -> Any:  # noqa: N802 - gRPC method name
        type(self).seen[request.name] = list(request.additionalSecretOutputs)
        return super().RegisterResource(request)


def test_gates_register_with_secrets_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recording, "RecordingMonitor", _SecretOutputsMonitor)

    def program() -> None:
        rdv = RendezvousGate("rdv", _rdv_args(rerun_on=["c0", "c1"], ssh=SshAccess(private_key="KEYTEXT")))
        ReadyGate(
            "ready", _ready_args(rerun_on=["c0", "c1"], api_key="APIKEY"), pulumi.ResourceOptions(depends_on=[rdv])
        )

    rec = recording.run(program)
    rdv, ready = rec.named("rdv"), rec.named("ready")
    assert rdv.typ == "pulumi-python:dynamic/gates:RendezvousGate"
    assert ready.typ == "pulumi-python:dynamic/gates:ReadyGate"
    assert {"ssh"} <= rdv.secret_paths() and {"api_key"} <= ready.secret_paths()
    assert "ssh" not in ready.secret_paths()  # no key given: nothing to hide, nothing sent
    # Whatever holds a credential is secret in the state, as declared (components/contract.py `secret()`).
    assert _SecretOutputsMonitor.seen["rdv"] == ["ssh"] and _SecretOutputsMonitor.seen["ready"] == ["ssh", "api_key"]
    assert ready.inputs["rerun_on"] == ["c0", "c1"] and ready.inputs["bounds"]["ready_timeout_s"] == 2700
    assert ready.inputs["bounds"] == {"rendezvous_timeout_s": 120, "ready_timeout_s": 2700, "stall_s": 600}
    assert rec.depends_on(ready, rdv)
