"""The WeightStore component under the recording mock: what it registers per share mode, its edges, and
that secrets stay secret."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_docker as docker
import pytest
from pulumi_command import remote

from components.ssh import SshAccess
from components.weights import manifest as wm
from components.weights.staging.plan import MANIFEST_MARKER
from components.weights.weight_store import CopySettings, WeightNode, WeightStore, WeightStoreArgs
from tests.support import recording
from tests.support.recording import Recorded, Registration
from tests.support.scripts import header_value
from tests.support.staging import (
    ENGRAM_REPO,
    MODEL_REPO,
    PREFIX,
    TOKEN,
)

SIG_SECRET = "1b47061264138c4ac30d75fd1eb44270"
STAGED_ROOT = "/home/u/dsv41-exl3"
STAGED_FILES = {
    "model/config.json": 10,
    "model/a.safetensors": 20,
    "engram-src/config.json": 5,
    "engram-src/model.safetensors.index.json": 30,
    "engram-vllm/config.json": 5,
    "engram-vllm/model.safetensors.index.json": 7,
}
STAGED_DIGESTS = {p: hashlib.sha256(p.encode()).hexdigest() for p in STAGED_FILES}
# What a rank reads, so what a worker's share shows and its copy holds: never engram-src/.
SERVED_FILES = {p: size for p, size in STAGED_FILES.items() if not p.startswith("engram-src/")}
SERVED_DIGESTS = {p: STAGED_DIGESTS[p] for p in SERVED_FILES}


def _stage_outputs(args: pulumi.runtime.MockResourceArgs) -> dict[str, Any]:
    if not args.name.endswith("-stage"):
        return {}
    manifest = {"root": STAGED_ROOT, "files": STAGED_FILES, "sha256": STAGED_DIGESTS}
    return {"stdout": f"log\n{MANIFEST_MARKER} {json.dumps(manifest)}"}


def _copy_outputs(args: pulumi.runtime.MockResourceArgs) -> dict[str, Any]:
    root = f"/copies/{args.inputs['worker']}"  # what the copier reports back: also the id
    return {"root": root, "__id": root}


FIXTURES = {"command:remote:Command": _stage_outputs, "pulumi-python:dynamic/weights:WorkerCopy": _copy_outputs}


@dataclass
class Run:
    recorded: Recorded
    store: WeightStore
    values: list[Any]

    @property
    def requests(self) -> list[Registration]:
        return self.recorded.registrations


def _mocked_program(
    share: str, *, workers: int = 1, token: str | None = TOKEN, download_streams: int | None = None
) -> Run:
    built: dict[str, WeightStore] = {}

    def node(name: str, ip: str) -> WeightNode:
        provider = docker.Provider(f"{name}-docker", host=f"ssh://u@{ip}")
        conn = remote.ConnectionArgs(host=ip, user="u", private_key=pulumi.Output.secret("KEY"))
        copy_root = f"~/copies/{name}" if share == "copy" and name != "head" else None
        return WeightNode(
            name=name,
            connection=conn,
            fabric_ip=ip,
            host=ip,
            port=22,
            user="u",
            copy_root=copy_root,
            ready=[],
            docker_provider=provider,
            image=f"sha256:{name}",
        )

    def program() -> dict[str, Any]:
        copy = CopySettings(
            ssh=SshAccess(private_key=pulumi.Output.secret("KEY")),
            streams=4,
            timeout_s=3600,
        )
        streams = {"download_streams": 8 if download_streams is None else download_streams}
        store = WeightStore(
            "ws",
            WeightStoreArgs(
                **streams,
                head=node("head", "10.0.0.1"),
                workers=[node(f"w{i}", f"10.0.0.{i + 1}") for i in range(1, workers + 1)],
                root="~/dsv41-exl3",
                share=share,  # type: ignore[arg-type]
                staging_image="sha256:serving",
                model_repo=MODEL_REPO,
                engram_repo=ENGRAM_REPO,
                revision="main",
                hf_token=pulumi.Output.secret(token) if token else None,
                hf_endpoint="http://127.0.0.1:9",
                stage_timeout_s=3600,
                stack_prefix=PREFIX,
                copy=copy if share == "copy" else None,
            ),
        )
        built["store"] = store
        outs = [
            store.manifest,
            *store.model_source.values(),
            *store.engram_source.values(),
            *(getattr(r, "stdout", r.urn) for r in store.visible.values()),
        ]
        return {"values": pulumi.Output.all(*outs)}

    recorded = recording.run(program, FIXTURES)
    return Run(recorded, built["store"], recorded.outputs["values"])


def _by_name(run: Run) -> dict[str, Registration]:
    return {r.name: r for r in run.requests}


def _field(reg: Registration, key: str) -> Any:
    """An input as it went over the wire (a secret keeps its marker)."""
    return reg.raw_inputs.get(key)


def test_staging_command_is_retained_and_triggered_by_what_is_staged() -> None:
    run = _mocked_program("bind")
    reqs = _by_name(run)
    stage = reqs["ws-stage"]
    assert stage.typ == "command:remote:Command"
    assert stage.retain_on_delete is True, "destroying the stack must never delete the weights"
    assert not _field(stage, "delete"), "staging has no delete command"
    assert _field(stage, "triggers") == [MODEL_REPO, ENGRAM_REPO, "main", "~/dsv41-exl3"]
    assert stage.parent.endswith("::ws"), "children are parented to the component"


def test_staging_downloads_the_configured_streams_at_once_without_restaging_for_it() -> None:
    stage = _by_name(_mocked_program("bind", download_streams=3))["ws-stage"]
    plan = json.loads(header_value(_field(stage, "create"), "PLAN"))
    assert plan["download_streams"] == 3, "the plan the staging program reads carries weights.downloadStreams"
    assert 3 not in _field(stage, "triggers"), "how fast it downloads is not what is staged: no replacement"
    default = _by_name(_mocked_program("bind"))["ws-stage"]
    assert json.loads(header_value(_field(default, "create"), "PLAN"))["download_streams"] == 8, (
        "unset: the config's default (the launcher's 8)"
    )


def test_no_secret_in_any_command_text_and_token_only_in_secret_stdin() -> None:
    run = _mocked_program("nfs")
    for req in run.requests:
        if req.typ != "command:remote:Command":
            continue
        for key in ("create", "update", "delete", "triggers"):
            assert TOKEN not in json.dumps(_field(req, key)), f"{req.name}.{key} carries the token"
    stdin = _field(_by_name(run)["ws-stage"], "stdin")
    assert isinstance(stdin, dict) and TOKEN in json.dumps(stdin), "the token travels on stdin"
    assert SIG_SECRET in json.dumps(stdin), "stdin must stay a secret"


def test_anonymous_staging_sends_empty_token_line() -> None:
    run = _mocked_program("bind", token=None)
    stage = _by_name(run)["ws-stage"]
    stdin = _field(stage, "stdin")
    assert stdin == f"\n{wm.stage_program_text()}", "the empty token line, then the staging program (base64)"
    create = _field(stage, "create")
    assert header_value(create, "WITH_TOKEN") == "0" and "HF_TOKEN" not in create.split("\n", 1)[0], (
        "anonymous: stage.sh reads the empty line and passes no token to docker"
    )


def test_bind_share_gives_every_node_the_head_path() -> None:
    run = _mocked_program("bind", workers=2)
    store, reqs = run.store, _by_name(run)
    assert store.mount_type == {"head": "bind", "w1": "bind", "w2": "bind"}
    values = run.values
    assert json.loads(values[0]) == STAGED_FILES
    assert values[1:4] == [f"{STAGED_ROOT}/model"] * 3
    assert values[4:7] == [f"{STAGED_ROOT}/engram-vllm"] * 3, "every rank mounts the slim Engram directory"
    assert not [r for r in run.requests if r.typ == "docker:index/volume:Volume"]
    assert "ws-nfs-export" not in reqs
    for node in ("head", "w1", "w2"):
        check = reqs[f"ws-visible-{node}"]
        assert any(d.endswith("::ws-stage") for d in check.dependencies), f"{node} check must wait for staging"
        inner = header_value(_field(check, "create"), "SIZE_CHECK", as_text=True)
        assert header_value(_field(check, "create"), "MODE") == "bind"
        assert header_value(inner, "WEIGHTS_ROOT") == STAGED_ROOT
        assert "a.safetensors" in header_value(inner, "FILES", as_text=True)


def test_nfs_share_mounts_worker_volumes_with_options() -> None:
    run = _mocked_program("nfs", workers=2)
    store, reqs = run.store, _by_name(run)
    assert store.mount_type == {"head": "bind", "w1": "volume", "w2": "volume"}
    export = reqs["ws-nfs-export"]
    assert '"/home/u/dsv41-exl3" 10.0.0.2(ro,sync,no_subtree_check) 10.0.0.3(ro,sync,no_subtree_check)' in header_value(
        _field(export, "create"), "EXPORTS", as_text=True
    )
    assert any(d.endswith("::ws-stage") for d in export.dependencies)
    for w in ("w1", "w2"):
        for which in ("model", "engram-src"):
            vol = reqs[f"ws-{w}-{which}"]
            assert vol.typ == "docker:index/volume:Volume"
            assert f"pulumi:providers:docker::{w}-docker::" in vol.provider, "the volume lives on that worker's daemon"
            assert _field(vol, "driver") == "local"
            device = {"model": "model", "engram-src": "engram-vllm"}[which]  # the volume backing /engram-src
            assert _field(vol, "driverOpts") == {
                "type": "nfs",
                "device": f":{STAGED_ROOT}/{device}",
                "o": "addr=10.0.0.1,nfsvers=4.2,ro,nconnect=8,rsize=1048576,wsize=1048576,hard,timeo=600",
            }
            assert any(d.endswith("::ws-nfs-export") for d in vol.dependencies)
        check = reqs[f"ws-visible-{w}"]
        deps = check.dependencies
        for dep in ("ws-stage", "ws-nfs-export", f"ws-{w}-model", f"ws-{w}-engram-src"):
            assert any(d.endswith(f"::{dep}") for d in deps), f"{w} check must wait for {dep}"
        create = _field(check, "create")
        assert header_value(create, "IMAGE") == f"sha256:{w}", "the check runs the image pulled on that worker"
        assert header_value(create, "MODE") == "volume"
        assert header_value(create, "MODEL_VOLUME").startswith(f"ws-{w}-model-")
        assert (header_value(create, "MOUNT"), header_value(create, "MODEL_DIR")) == ("/w", "model")
        assert header_value(create, "ENGRAM_VLLM_DIR") == "engram-vllm"
        listing = header_value(header_value(create, "SIZE_CHECK", as_text=True), "FILES", as_text=True)
        assert listing == "".join(f"{size} {p}\n" for p, size in sorted(SERVED_FILES.items())), (
            "the worker checks what its rank reads through the volumes: model/ and the slim Engram directory"
        )
    values = run.values
    model_vols, engram_vols = values[2:4], values[5:7]
    assert values[1] == f"{STAGED_ROOT}/model" and values[4] == f"{STAGED_ROOT}/engram-vllm"
    assert all(v.startswith(f"ws-w{i}-model-") for i, v in enumerate(model_vols, 1))
    assert all(v.startswith(f"ws-w{i}-engram-src-") for i, v in enumerate(engram_vols, 1))
    assert "ws-visible-head" in reqs and reqs["ws-visible-head"].dependencies


def test_copy_share_gives_each_worker_its_own_verified_copy_after_staging() -> None:
    run = _mocked_program("copy", workers=2)
    store, reqs = run.store, _by_name(run)
    assert store.mount_type == {"head": "bind", "w1": "bind", "w2": "bind"}
    values = run.values
    assert values[1:4] == [f"{STAGED_ROOT}/model", "/copies/w1/model", "/copies/w2/model"]
    assert values[4:7] == [f"{STAGED_ROOT}/engram-vllm", "/copies/w1/engram-vllm", "/copies/w2/engram-vllm"]
    assert "ws-nfs-export" not in reqs and not [r for r in run.requests if r.typ == "docker:index/volume:Volume"]
    for i, w in enumerate(("w1", "w2"), 2):
        copy = reqs[f"ws-copy-{w}"]
        assert copy.typ == "pulumi-python:dynamic/weights:WorkerCopy"
        assert any(d.endswith("::ws-stage") for d in copy.dependencies), f"{w}'s copy waits for staging"
        assert store.visible[w] is not None and f"ws-visible-{w}" not in reqs, "the copy is the worker's check"
        fields = {
            k: _field(copy, k)
            for k in (
                "worker",
                "copy_root",
                "head_root",
                "files",
                "sha256",
                "worker_fabric_ip",
                "head_fabric_ip",
                "worker_image",
            )
        }
        assert fields == {
            "worker": w,
            "copy_root": f"~/copies/{w}",
            "head_root": STAGED_ROOT,
            "files": SERVED_FILES,
            "sha256": SERVED_DIGESTS,
            "worker_fabric_ip": f"10.0.0.{i}",
            "head_fabric_ip": "10.0.0.1",
            "worker_image": f"sha256:{w}",
        }
        assert SIG_SECRET in json.dumps(_field(copy, "ssh_private_key")), "the ssh key reaches the copy as a secret"
    assert "ws-visible-head" in reqs


def test_copy_without_a_workers_copy_root_is_rejected() -> None:
    conn = remote.ConnectionArgs(host="127.0.0.1", user="u")
    plain = {"connection": conn, "host": "127.0.0.1", "port": 22, "user": "u", "ready": []}
    settings = CopySettings(ssh=SshAccess(), streams=1, timeout_s=10)
    args = WeightStoreArgs(
        head=WeightNode(name="h", fabric_ip="10.0.0.1", copy_root=None, **plain),
        workers=[WeightNode(name="w", fabric_ip="10.0.0.2", copy_root=None, **plain)],
        root="~/x",
        share="copy",
        staging_image="i",
        model_repo=MODEL_REPO,
        engram_repo=ENGRAM_REPO,
        revision="main",
        hf_token=None,
        hf_endpoint=None,
        stage_timeout_s=10,
        download_streams=8,
        stack_prefix=PREFIX,
        copy=settings,
    )
    with pytest.raises(ValueError, match="worker w has no copy_root"):
        WeightStore._validate(args)
    with pytest.raises(ValueError, match="needs copy settings"):
        WeightStore._validate(WeightStoreArgs(**{**args.__dict__, "copy": None}))


def test_nfs_without_worker_docker_provider_is_rejected() -> None:
    conn = remote.ConnectionArgs(host="127.0.0.1", user="u")
    plain = {"connection": conn, "host": "127.0.0.1", "port": 22, "user": "u", "copy_root": None, "ready": []}
    args = WeightStoreArgs(
        head=WeightNode(name="h", fabric_ip="10.0.0.1", **plain),
        workers=[WeightNode(name="w", fabric_ip="10.0.0.2", **plain)],
        root="~/x",
        share="nfs",
        staging_image="i",
        model_repo=MODEL_REPO,
        engram_repo=ENGRAM_REPO,
        revision="main",
        hf_token=None,
        hf_endpoint=None,
        stage_timeout_s=10,
        download_streams=8,
        stack_prefix=PREFIX,
        copy=None,
    )
    with pytest.raises(ValueError, match="worker w has no docker_provider"):
        WeightStore._validate(args)
    bad_root = WeightStoreArgs(**{**args.__dict__, "root": "x", "share": "bind"})
    with pytest.raises(ValueError, match="weights root='x'"):
        WeightStore._validate(bad_root)
