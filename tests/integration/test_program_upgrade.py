"""A stack deployed by an older program upgrades in place, from each layout a deployed stack may hold.

Two layouts came before this one: every layer hung off the stack (OLD_LAYOUT, until issue 13), and every layer
under one root `Deployment`, with a component of its own around each per-node command (PRE_MERGE, until issue
36 merged those wiring-only components). A stack is deployed with the oldest program, previewed with this
checkout's (the plan a user still on the oldest layout gets), updated with PRE_MERGE's, then previewed and
updated with this checkout's. Aliases must carry every resource over: nothing deleted but the merged components
(which hold nothing), and no replacement but the ranks' on the first upgrade. Those are replaced once, by design,
for two fields: what they mount at /engram-src (now the slim Engram directory staging builds) and their
entrypoint (which now checks the node's MemAvailable before vLLM starts), both issue 34; nothing else about them,
and nothing else, moves. The second upgrade changes nothing on any node: every container keeps its id.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from program_support import REPO, Deployment, assert_verified, docker_on, new_deployment, remove_deployment
from pulumi import automation as auto

pytestmark = [pytest.mark.sim, pytest.mark.engine]

# main before the layout move (issue 13): components flat, every layer a child of the stack.
OLD_LAYOUT = "2fb3e01f0658cd341488060fc67b0f3ca43ddf00"
# main before the wiring-only components were merged (issue 36): each per-node command under its own component.
PRE_MERGE = "7f8b83edb43878e83ab7f247119955f3c5547b6a"
# The components merged by issue 36, per node (each held one command, now under the root with aliases).
MERGED = ("precheck-{}", "preflight-{}", "watchdog-key-{}", "watchdog-{}")
# What the ranks' inputs may differ in, in either upgrade: the entrypoint (a MemAvailable check, issue 34; the key
# read from its file, issue 35), the mounts (the slim Engram directory, issue 34; the key file), the env (no key
# any more) and the labels (the generation: it no longer holds a hash of the key).
RANK_FIELDS = {"entrypoints", "mounts", "envs", "labels"}


def key_file_command(d: Deployment) -> str:
    """The head's API key file command (issue 35), new in this layout."""
    return f"serving-node-{d.sim['nodes'][0]['index']}-api-key"


# What an upgrade must never plan for a resource that existed.
DESTRUCTIVE = {"replace", "create-replacement", "delete-replaced", "delete", "discard"}


def old_program(dest: Path, commit: str) -> Path:
    """The program files at `commit`, with this checkout's venv (the dependencies did not change)."""
    archive = subprocess.run(
        [
            "git",
            "-C",
            str(REPO),
            "archive",
            "--format=tar",
            commit,
            "__main__.py",
            "components",
            "Pulumi.yaml",
            "pyproject.toml",
        ],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "venv").symlink_to(sys.prefix)  # the venv running these tests
    return dest


@pytest.fixture(scope="module")
def weights_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-upgrade-weights-", dir="/var/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def stack_at(d: Deployment, program: Path) -> auto.Stack:
    return auto.select_stack(
        d.name,
        work_dir=str(program),
        opts=auto.LocalWorkspaceOptions(
            work_dir=str(program), pulumi_command=auto.PulumiCommand(root=str(d.pulumi_root)), env_vars=d.env
        ),
    )


def merged_components(d: Deployment, *, since_old_layout: bool) -> set[str]:
    """The merged components a stack of that layout holds (the precheck phase came after OLD_LAYOUT)."""
    return {
        m.format(f"node-{n['index']}")
        for n in d.sim["nodes"]
        for m in MERGED
        if not (since_old_layout and m.startswith("precheck-"))
    }


def assert_carried_over(d: Deployment, ranks: set[str], merged: set[str]) -> None:
    """The last preview's plan: every resource the program still declares matched its old URN through an alias
    (a resource whose alias is missing is planned as a create plus a delete); nothing is deleted but the merged
    components, which hold nothing; nothing is replaced but the ranks and what re-runs with them."""
    unmatched = sorted(name for name, ops in d.ops.items() if {"create", "delete"} <= ops)
    assert not unmatched, f"no alias matched their old URN: {unmatched}\n" + "\n".join(d.lines[-60:])
    deleted = {name for name, ops in d.ops.items() if ops == {"delete"}}
    assert deleted == merged, f"only the merged components go: {sorted(deleted ^ merged)}"
    # Re-run whenever the ranks are replaced (docs/checks.md): each node's checks and its memory watchdog.
    with_ranks = ranks | {
        f"{kind}-node-{n['index']}-{part}"
        for n in d.sim["nodes"]
        for kind, part in (("precheck", "check"), ("preflight", "check"), ("watchdog", "install"))
    }
    destructive = {
        name: ops & DESTRUCTIVE
        for name, ops in d.ops.items()
        if ops & DESTRUCTIVE and name not in with_ranks and name not in merged
    }
    assert not destructive, f"the upgrade would replace or delete: {destructive}\n" + "\n".join(d.lines[-60:])


def container_ids(d: Deployment) -> dict[int, str]:
    return {
        n["index"]: docker_on(n["index"], "inspect", "--format", "{{.Id}}", d.container(n)).stdout.strip()
        for n in d.sim["nodes"]
    }


@pytest.mark.timeout(1500)
def test_a_stack_from_each_older_layout_upgrades_replacing_only_the_ranks_once(
    sim: dict[str, Any], program_env: dict[str, str], pulumi_root: Path, weights_root: Path, tmp_path: Path
) -> None:
    d = new_deployment(
        sim,
        f"upg-{uuid.uuid4().hex[:6]}",
        program_env,
        pulumi_root,
        weights_root=weights_root,
        port=18891,
        master_port=29624,
    )
    try:
        old_dir = old_program(tmp_path / "old", OLD_LAYOUT)
        # The old program mounts the base repo's native index at /engram-src, which the recipe's loader (and the
        # stand-in) refuses; the stand-in of its day took shards 47/48 out of any index.
        d.write_config(d.with_env(SIM_ENGRAM_INDEX="any"))
        # The old program served openly with no `serve.apiKey`; a later one generates a key. The oldest hop is
        # about the layout: both programs get the same key. From PRE_MERGE on the key is unset: PRE_MERGE derives
        # one from the SSH key, this program makes a random one once (issue 35).
        pre_merge_dir = old_program(tmp_path / "pre-merge", PRE_MERGE)
        (pre_merge_dir / f"Pulumi.{d.name}.yaml").write_text((REPO / f"Pulumi.{d.name}.yaml").read_text())
        d.stack.set_config(
            "dsv41-exl3:serve.apiKey",
            auto.ConfigValue(value="sk-upgrade-test-0123456789abcdef", secret=True),
            path=True,
        )
        stack_text = (REPO / f"Pulumi.{d.name}.yaml").read_text()
        # The old program knows no `supervisor` or `observability` key (the sim's tests set both off; off is
        # the old behaviour).
        stack_file = yaml.safe_load(stack_text)
        for newer in ("supervisor", "observability"):
            del stack_file["config"][f"dsv41-exl3:{newer}"]
        (old_dir / f"Pulumi.{d.name}.yaml").write_text(yaml.safe_dump(stack_file))
        lines: list[str] = []
        assert_verified(d, stack_at(d, old_dir).up(on_output=lines.append, color="never").outputs)
        assert "dsv41-exl3:index:Deployment" not in "\n".join(lines), "the old program has no root component"
        before = container_ids(d)
        assert all(before.values()), before

        # From the oldest layout straight to this one: the plan a user who skipped PRE_MERGE gets.
        d.preview()
        ranks = {f"serving-node-{n['index']}" for n in d.sim["nodes"]}
        # The ranks' mount sources come from staging's outputs, unknown to a preview, so the preview can only say
        # `update` where the up replaces them (asserted below); only these fields may differ.
        for rank in sorted(ranks):
            assert d.fields.get(rank) and d.fields[rank] <= RANK_FIELDS, (
                f"{rank}: only {sorted(RANK_FIELDS)} may differ, not {d.fields.get(rank)}\n" + "\n".join(d.lines[-60:])
            )
        assert_carried_over(d, ranks, merged_components(d, since_old_layout=True))
        created = sorted(name for name, ops in d.ops.items() if "create" in ops)
        # New since that layout: the root component, each node's check phase of the two-phase preflight (it runs
        # with the ranks serving and stops nothing), and the head's API key file (issue 35).
        prechecks = [f"precheck-node-{n['index']}-check" for n in d.sim["nodes"]]
        assert created == sorted(["deployment", *prechecks, key_file_command(d)]), (
            f"only the root component, the prechecks and the key file are new, not {created}"
        )

        # The layout every stack deployed between issues 13 and 36 holds, with its derived key.
        lines = []
        pre_merge = stack_at(d, pre_merge_dir).up(on_output=lines.append, color="never").outputs
        assert_verified(d, pre_merge)
        derived = str(pre_merge["apiKey"].value)
        d.stack.remove_config("dsv41-exl3:serve.apiKey", path=True)
        after = container_ids(d)
        assert all(after[i] and after[i] != before[i] for i in before), f"every rank replaced once: {before} {after}"
        head = d.sim["nodes"][0]
        mounts = docker_on(head["index"], "inspect", "--format", "{{json .Mounts}}", d.container(head))
        engram = {m["Destination"]: m["Source"] for m in json.loads(mounts.stdout)}["/engram-src"]
        assert engram == f"{weights_root.resolve()}/engram-vllm", engram

        d.preview()
        assert_carried_over(d, ranks, merged_components(d, since_old_layout=False))
        created = sorted(name for name, ops in d.ops.items() if "create" in ops)
        # The preview announces the one-time key change: a generated key to be made.
        assert created == sorted(["endpoint-key", key_file_command(d)]), (
            f"only the key file and the generated key are new since PRE_MERGE, not {created}"
        )
        upgraded = d.up().outputs
        assert_verified(d, upgraded)
        key = str(upgraded["apiKey"].value)
        assert re.fullmatch(r"sk-[0-9a-f]{48}", key) and key != derived, "a random key replaces the derived one"
        endpoint = str(upgraded["endpoint"].value)
        for sent, status in ((derived, 401), (key, 200)):
            answer = requests.get(f"{endpoint}/models", headers={"Authorization": f"Bearer {sent}"}, timeout=30)
            assert answer.status_code == status, (sent == key, answer.status_code, answer.text[:200])
        final = container_ids(d)
        # Once more, by design: the head's key moved from its env to a file (issue 35), which every rank's
        # generation follows.
        assert all(final[i] and final[i] != after[i] for i in after), f"every rank replaced: {after} {final}"
        env = docker_on(head["index"], "inspect", "--format", "{{json .Config.Env}}", d.container(head)).stdout
        assert key not in env and "VLLM_API_KEY" not in env, "the key left the head's configured env"
        again = d.preview()
        assert again.change_summary.get("same") and not {k for k in again.change_summary if k != "same"}, (
            f"after the upgrade a preview is a no-op: {again.change_summary}"
        )
        # Resources unchanged by the upgrade keep their providers pickled under the old module paths.
        d.stack.destroy(on_output=lambda _l: None, color="never")
        assert all(not ids for ids in container_ids(d).values()), "destroy after the upgrade removes every rank"
    finally:
        remove_deployment(d)
