"""The whole graph under the recording mock: configs of N Sparks and what their nodes print back."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pulumi

from components.config import parse
from components.deployment import deploy
from components.weights import manifest as wm
from tests.support import recording
from tests.support.configs import two_sparks

COMMAND = "command:remote:Command"
CONTAINER = "docker:index/container:Container"


def fake_stdout(args: pulumi.runtime.MockResourceArgs) -> dict[str, Any]:
    """What the nodes would print: the preflight's JSON line, the staging manifest."""
    if args.name.startswith(("preflight-", "precheck-")):
        node = args.name.removeprefix("preflight-").removeprefix("precheck-").removesuffix("-check")
        # RDMA nodes as on hardware: each resolves its own RoCE v2 GID, and they differ.
        return {
            "stdout": json.dumps(
                {"node": node, "mem_available_gib": 115.0, "gid_index": GIDS[node], "stopped": [], "findings": []}
            )
        }
    if args.name.endswith("-api-key"):
        return {"stdout": "/home/me/.local/state/dsv41-exl3-test/api-key\n"}
    if args.name.endswith("-keygen"):
        key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFake" + args.name.replace("-", "")
        return {"stdout": f"DSV41_WATCHDOG_PUBKEY {key}"}
    if args.name.startswith("supervisor-") and args.name.endswith("-files"):
        node = args.name.removeprefix("supervisor-").removesuffix("-files")
        return {
            "stdout": json.dumps(
                {
                    "dir": f"/home/me/.local/share/dsv41-exl3-test/supervisor-{node}",
                    "state": f"/home/me/.local/state/dsv41-exl3-test/supervisor-{node}",
                    "socket": "/var/run/docker.sock",
                }
            )
        }
    if "stage" in args.name:
        return {
            "stdout": "DSV41_WEIGHTS_MANIFEST "
            + json.dumps(
                {
                    "root": "/home/me/dsv41-exl3",
                    "files": FULL_MANIFEST,
                    "sha256": FULL_DIGESTS,
                    "manifest_file": "/home/me/dsv41-exl3/dsv41-weights-manifest.json",
                }
            )
        }
    return {"stdout": ""}


def full_manifest() -> dict[str, int]:
    """What staging reports on hardware: 39 EXL3 shards plus their metadata, the two Engram shards of 48 with the
    index and config (sizes as the recipe's repos list them, to the order of magnitude), and the slim Engram
    directory built from them (the shards and config again, as hardlinks, and an embed-only index)."""
    files = {
        f"{wm.MODEL_DIR}/model-{i:05d}-of-{wm.MODEL_SHARD_COUNT:05d}.safetensors": 5_300_000_000 + i
        for i in range(1, wm.MODEL_SHARD_COUNT + 1)
    }
    files.update(
        {
            f"{wm.MODEL_DIR}/{name}": 4096
            for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")
        }
    )
    files.update({f"{wm.ENGRAM_DIR}/{wm.engram_shard_name(i)}": 4_900_000_000 + i for i in wm.ENGRAM_SHARDS})
    files.update({f"{wm.ENGRAM_DIR}/{name}": 2048 for name in wm.ENGRAM_EXTRA_FILES})
    linked = [*(wm.engram_shard_name(i) for i in wm.ENGRAM_SHARDS), wm.ENGRAM_CONFIG]
    files.update({f"{wm.ENGRAM_VLLM_DIR}/{name}": files[f"{wm.ENGRAM_DIR}/{name}"] for name in linked})
    files[f"{wm.ENGRAM_VLLM_DIR}/{wm.ENGRAM_INDEX}"] = 512
    return files


FULL_MANIFEST = full_manifest()
FULL_DIGESTS = {path: hashlib.sha256(path.encode()).hexdigest() for path in FULL_MANIFEST}


WORKER_COPY = "pulumi-python:dynamic/weights:WorkerCopy"


def copied_root(args: pulumi.runtime.MockResourceArgs) -> dict[str, Any]:
    """What a worker's copier reports: the copy root, absolute (also the resource's id)."""
    root = str(args.inputs["copy_root"]).replace("~", "/home/me", 1)
    return {"root": root, "__id": root}


ENDPOINT_KEY = "pulumi-python:dynamic/keys:EndpointKey"
GENERATED_KEY = "sk-" + "0a" * 24  # what EndpointKey's create returns, in the mock


def generated_key(_args: pulumi.runtime.MockResourceArgs) -> dict[str, Any]:
    return {"key": GENERATED_KEY}


FIXTURES = {COMMAND: fake_stdout, WORKER_COPY: copied_root, ENDPOINT_KEY: generated_key}
GIDS = {f"spark-{i}": 3 + (i % 2) * 2 for i in range(8)}


def config(count: int = 2, **overrides: Any) -> dict[str, Any]:
    raw = two_sparks(**overrides)
    # The defaults of a Spark: GPU, /dev/infiniband, the CX-7 HCA, `gidIndex: auto`.
    raw["nodes"] = [
        {"name": f"spark-{i}", "host": f"10.0.0.{i + 1}", "user": "me", "fabricIp": f"192.168.100.{i + 1}"}
        for i in range(count)
    ]
    raw["weights"] = {"share": "bind", "hfToken": "hf_token_secret"}
    raw.setdefault("serve", {})
    raw["serve"] = {**raw["serve"], "apiKey": "sk-deploy-secret-0123456789abcde"}
    return raw


def run(raw: dict[str, Any], fixtures: dict[str, Any] | None = None) -> recording.Recorded:
    loaded = parse(raw)
    return recording.run(lambda: deploy(loaded, "dev"), {**FIXTURES, **(fixtures or {})})
