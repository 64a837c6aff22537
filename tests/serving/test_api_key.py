"""The endpoint is never open by default: an unset `serve.apiKey` becomes a generated key, `none` opts out."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from components.config import ConfigError, parse
from components.serving.api_key import KEY_FILE, generated_key, with_endpoint_key
from tests.support import graph
from tests.support.configs import two_sparks

CONTAINER = "docker:index/container:Container"


def settings(api_key: str | None = None, *, private_key: bool = True) -> Any:
    raw = two_sparks()
    if not private_key:
        raw["ssh"] = {"agentSocket": "/run/agent.sock"}
    if api_key is not None:
        raw["serve"] = {"apiKey": api_key}
    return parse(raw).settings


def keys_dir(tmp_path: Path) -> str:
    path = tmp_path / "keys"
    path.mkdir(parents=True)
    path.chmod(0o700)
    return str(path)


def test_an_unset_key_is_generated_from_the_stacks_ssh_key_the_same_on_every_run(tmp_path: Path) -> None:
    first = with_endpoint_key(settings(), "dev", keys_dir(tmp_path)).serve.api_key
    again = with_endpoint_key(settings(), "dev", keys_dir(tmp_path / "other-machine")).serve.api_key
    assert first is not None and again is not None
    key = first.get_secret_value()
    assert key.startswith("sk-") and len(key) == 51
    assert key == again.get_secret_value(), "a second operator's machine derives the same key"
    other_stack = with_endpoint_key(settings(), "prod", keys_dir(tmp_path / "p")).serve.api_key
    assert other_stack is not None and other_stack.get_secret_value() != key
    assert "abc" not in key and "PRIVATE" not in key


def test_without_an_ssh_key_the_generated_key_is_kept_private_in_the_stack_directory(tmp_path: Path) -> None:
    directory = keys_dir(tmp_path)
    key = generated_key(settings(private_key=False), "dev", directory)
    path = Path(directory) / KEY_FILE
    assert path.read_text() == key
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert generated_key(settings(private_key=False), "dev", directory) == key
    assert key != generated_key(settings(private_key=False), "dev", keys_dir(tmp_path / "fresh"))


def test_a_users_key_is_kept_and_none_serves_openly_with_a_warning(tmp_path: Path) -> None:
    mine = with_endpoint_key(settings("sk-mine"), "dev", keys_dir(tmp_path)).serve.api_key
    assert mine is not None and mine.get_secret_value() == "sk-mine"
    assert with_endpoint_key(settings("none"), "dev", keys_dir(tmp_path / "n")).serve.api_key is None
    warnings = parse({**two_sparks(), "serve": {"apiKey": "none"}}).warnings
    assert any("`serve.apiKey` = none" in w and "without a key" in w for w in warnings)
    assert not any("apiKey" in w for w in parse(two_sparks()).warnings)


def head_env(rec: Any) -> dict[str, str]:
    head = next(c for c in rec.of_type(CONTAINER) if c.name == "serving-spark-0")
    envs = head.inputs["envs"]
    return dict(e.split("=", 1) for e in (envs["value"] if isinstance(envs, dict) else envs))


def head_key(rec: Any) -> str | None:
    """The key the head serves with: what the program writes to its key file (serving.py), on stdin."""
    writer = next((r for r in rec.registrations if r.name == "serving-spark-0-api-key"), None)
    return None if writer is None else str(writer.inputs["stdin"]["value"])


def test_the_deployed_head_requires_the_generated_key_and_exports_it_as_a_secret() -> None:
    raw = graph.config()
    del raw["serve"]["apiKey"]
    rec = graph.run(raw)
    key = head_key(rec)
    assert key is not None and key.startswith("sk-")
    assert "VLLM_API_KEY" not in head_env(rec)
    assert rec.outputs["apiKey"] == key
    assert "apiKey" in rec.secret_outputs
    # The gates, LiveRanks and the verifier send the same key.
    for kind in ("ReadyGate", "LiveRanks", "Verifier"):
        resource = next(r for r in rec.registrations if r.typ.endswith(kind))
        assert resource.inputs["api_key"]["value"] == key, kind


def test_none_deploys_an_open_head_with_no_key_output() -> None:
    raw = graph.config()
    raw["serve"]["apiKey"] = "none"
    rec = graph.run(raw)
    assert "VLLM_API_KEY" not in head_env(rec) and head_key(rec) is None
    assert "apiKey" not in rec.outputs


def test_an_explicit_key_is_the_one_exported() -> None:
    rec = graph.run(graph.config())
    assert head_key(rec) == "sk-deploy-secret"
    assert rec.outputs["apiKey"] == "sk-deploy-secret"


def test_none_may_stay_in_plain_text_but_a_key_may_not() -> None:
    opted_out = parse({**two_sparks(), "serve": {"apiKey": "none"}}, plaintext_keys=frozenset({"serve"}))
    assert opted_out.settings.serve.api_key is not None
    with pytest.raises(ConfigError, match="`serve.apiKey` is stored in plain text"):
        parse({**two_sparks(), "serve": {"apiKey": "sk-plain"}}, plaintext_keys=frozenset({"serve"}))
