"""Which update a rollback restores, and the config leaves it writes back."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import pytest

from components.config.paths import config_paths, secure_leaves
from components.rollback.history import (
    Change,
    RollbackError,
    Update,
    Value,
    changes,
    choose,
    leaves,
    rollback_command,
    verified_updates,
)

NS = "dsv41-exl3"


def update(version: int, result: str = "succeeded", kind: str = "update", **config: Value) -> Update:
    return Update(version, kind, result, datetime(2026, 12, 1, 12, version), "", config)


def test_the_newest_succeeded_update_is_chosen_not_the_newest_update() -> None:
    history = [update(1), update(2), update(3, "failed"), update(4, kind="refresh"), update(5, kind="preview")]
    assert choose(history, "dev", None).version == 2
    assert [u.version for u in verified_updates(history)] == [2, 1]


def test_to_names_a_verified_version_and_gets_it() -> None:
    assert choose([update(1), update(2), update(3)], "dev", 1).version == 1


def test_to_a_failed_version_is_refused_naming_the_verified_ones() -> None:
    history = [update(1), update(2, "failed"), update(3)]
    with pytest.raises(RollbackError) as error:
        choose(history, "dev", 2)
    text = str(error.value)
    assert "--to 2: stack 'dev' version 2 was not verified (update failed)" in text
    assert "verified versions (newest first): 3, 1" in text and "nothing was changed" in text


def test_to_a_version_not_in_history_is_refused() -> None:
    with pytest.raises(RollbackError, match=r"--to 9: stack 'dev' has no version 9; .*: 1;"):
        choose([update(1)], "dev", 9)


def test_no_verified_update_says_so() -> None:
    with pytest.raises(RollbackError, match=r"no verified update in its history \(2 update\(s\), none succeeded\)"):
        choose([update(1, "failed"), update(2, "failed"), update(3, kind="destroy")], "dev", None)


def test_the_verification_hint_names_the_stack() -> None:
    assert rollback_command("prod") == "dsv41-exl3 rollback --stack prod"


def test_a_section_becomes_path_leaves_and_its_credential_stays_encrypted() -> None:
    ssh = {"user": "me", "privateKey": "-----BEGIN KEY-----\nabc\n"}
    restored = leaves({f"{NS}:ssh": Value(json.dumps(ssh), secret=True), f"{NS}:image": Value("img:1", False)})
    assert restored == {
        f"{NS}:ssh.user": Value("me", False),
        f"{NS}:ssh.privateKey": Value(ssh["privateKey"], True),
        f"{NS}:image": Value("img:1", False),
    }


def test_a_leaf_encrypted_in_the_stack_file_now_stays_encrypted() -> None:
    serve = {"port": 8888, "extraEnv": {"TOKEN_X": "t"}}
    secure = secure_leaves({f"{NS}:serve": {"port": 8888, "extraEnv": {"TOKEN_X": {"secure": "v1:abc"}}}})
    assert secure == {f"{NS}:serve.extraEnv.TOKEN_X"}
    restored = leaves({f"{NS}:serve": Value(json.dumps(serve), True)}, secure)
    assert restored[f"{NS}:serve.extraEnv.TOKEN_X"].secret and not restored[f"{NS}:serve.port"].secret


def test_another_namespaces_secret_object_keeps_every_leaf_encrypted() -> None:
    restored = leaves({"aws:creds": Value(json.dumps({"id": "a", "key": "b"}), True)})
    assert all(v.secret for v in restored.values()) and set(restored) == {"aws:creds.id", "aws:creds.key"}


def test_odd_map_keys_go_in_brackets_so_the_path_names_them() -> None:
    assert config_paths("ns.serve", {"extraEnv": {"A.B": "1", "ok_key": "2"}}) == {
        'ns.serve.extraEnv["A.B"]': "1",
        "ns.serve.extraEnv.ok_key": "2",
    }


def test_the_node_list_stays_one_json_value() -> None:
    nodes = [{"name": "a", "ibHcas": []}]
    assert leaves({f"{NS}:nodes": Value(json.dumps(nodes), False)}) == {f"{NS}:nodes": Value(json.dumps(nodes), False)}


def test_changes_show_plain_values_and_hide_secrets() -> None:
    current = {
        f"{NS}:image": Value("img:2", False),
        f"{NS}:ssh.privateKey": Value("k2", True),
        "x:y": Value("1", False),
    }
    restored = {
        f"{NS}:image": Value("img:1", False),
        f"{NS}:ssh.privateKey": Value("k1", True),
        "x:y": Value("1.0", False),
    }
    found = changes(current, restored)
    assert [c.describe() for c in found] == [f"{NS}:image: img:2 -> img:1", f"{NS}:ssh.privateKey: (secret, changed)"]
    assert all("k1" not in c.describe() and "k2" not in c.describe() for c in found)


def test_a_key_only_one_side_has_is_added_or_unset() -> None:
    found = changes({"a:b": Value("1", False)}, {"a:c": Value("2", False), "a:s": Value("z", True)})
    assert [c.describe() for c in found] == ["a:b: 1 -> (unset)", "a:c: (unset) -> 2", "a:s: (secret, added)"]
    assert Change("a:s", "z", None, True).describe() == "a:s: (secret, removed)"


def test_a_leaf_of_a_secret_section_goes_back_plain_only_where_the_file_holds_it_plain_now() -> None:
    supervisor = {"probeSeconds": 30, "notifyCommand": "curl -d @- https://ntfy.sh/tok-9f3a"}
    plain_now = {f"{NS}:supervisor.probeSeconds": "30"}  # notifyCommand has since been removed from the file
    restored = leaves({f"{NS}:supervisor": Value(json.dumps(supervisor), True)}, frozenset(), plain_now=plain_now)
    assert restored[f"{NS}:supervisor.notifyCommand"].secret, "the webhook's token goes back encrypted"
    assert not restored[f"{NS}:supervisor.probeSeconds"].secret, "a leaf the file holds in plain stays plain"
    changed = leaves(
        {f"{NS}:supervisor": Value(json.dumps({**supervisor, "probeSeconds": 60}), True)}, plain_now=plain_now
    )
    assert changed[f"{NS}:supervisor.probeSeconds"].secret, "another value than the plain one now: on the safe side"


def test_the_saved_stack_file_is_private_from_its_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from components.operator.rollback import save_copy

    stack_file = tmp_path / "Pulumi.s.yaml"
    stack_file.write_text("config: {}\n")
    # No later chmod may be what makes it private: between a copy and a chmod, others could open it.
    monkeypatch.setattr(Path, "chmod", lambda self, mode: None)
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    old = os.umask(0o022)
    try:
        copy = save_copy(stack_file, tmp_path / "rollback")
    finally:
        os.umask(old)
    assert copy.read_text() == "config: {}\n" and copy.stat().st_mode & 0o077 == 0
