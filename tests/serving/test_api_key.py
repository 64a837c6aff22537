"""The endpoint is never open by default: an unset `serve.apiKey` becomes a generated key, `none` opts out."""

from __future__ import annotations

import re
from typing import Any

import pytest

from components.config import ConfigError, parse
from components.serving.api_key import EndpointKeyProvider, make_key
from tests.support import graph
from tests.support.configs import two_sparks
from tests.support.graph import ENDPOINT_KEY, GENERATED_KEY

CONTAINER = "docker:index/container:Container"


def test_a_generated_key_is_random_made_once_and_kept_by_every_later_update() -> None:
    """EndpointKey: 192 random bits at create; no input changes it, so every later update keeps it."""
    provider = EndpointKeyProvider()
    first, second = provider.create({"key": None}), provider.create({"key": None})
    for made in (first, second):
        assert re.fullmatch(r"sk-[0-9a-f]{48}", made.outs["key"]), made.outs
    assert first.outs["key"] != second.outs["key"], "another stack gets another key"
    assert provider.diff(first.id, first.outs, {"key": None}).changes is False
    assert provider.update(first.id, first.outs, {"key": None}).outs == first.outs


def test_the_key_is_derived_from_nothing_the_program_holds() -> None:
    """Two stacks with the same SSH key and stack name (another cluster) get different keys: nothing is hashed."""
    keys = set()
    for _ in range(2):
        rec = graph.run(unset_key(graph.config()), fixtures={ENDPOINT_KEY: lambda _a: {"key": make_key()}})
        keys.add(rec.outputs["apiKey"])
    assert len(keys) == 2


def unset_key(raw: dict[str, Any]) -> dict[str, Any]:
    del raw["serve"]["apiKey"]
    return raw


def head_env(rec: Any) -> dict[str, str]:
    head = next(c for c in rec.of_type(CONTAINER) if c.name == "serving-spark-0")
    envs = head.inputs["envs"]
    return dict(e.split("=", 1) for e in (envs["value"] if isinstance(envs, dict) else envs))


def head_key(rec: Any) -> str | None:
    """The key the head serves with: what the program writes to its key file (serving.py), on stdin."""
    writer = next((r for r in rec.registrations if r.name == "serving-spark-0-api-key"), None)
    return None if writer is None else str(writer.inputs["stdin"]["value"])


def test_the_deployed_head_requires_the_generated_key_and_exports_it_as_a_secret() -> None:
    rec = graph.run(unset_key(graph.config()))
    (made,) = rec.of_type(ENDPOINT_KEY)
    assert made.additional_secret_outputs == ["key"], "the state keeps the key encrypted"
    key = head_key(rec)
    assert key == GENERATED_KEY
    assert "VLLM_API_KEY" not in head_env(rec)
    assert rec.outputs["apiKey"] == key
    assert "apiKey" in rec.secret_outputs
    # The gates, LiveRanks and the verifier send the same key.
    for kind in ("ReadyGate", "LiveRanks", "Verifier"):
        resource = next(r for r in rec.registrations if r.typ.endswith(kind))
        assert resource.inputs["api_key"]["value"] == key, kind


def test_none_deploys_an_open_head_with_no_key_output_and_warns() -> None:
    raw = graph.config()
    raw["serve"]["apiKey"] = "none"
    rec = graph.run(raw)
    assert "VLLM_API_KEY" not in head_env(rec) and head_key(rec) is None
    assert "apiKey" not in rec.outputs and not rec.of_type(ENDPOINT_KEY)
    warnings = parse({**two_sparks(), "serve": {"apiKey": "none"}}).warnings
    assert any("`serve.apiKey` = none" in w and "without a key" in w for w in warnings)
    assert not any("apiKey" in w for w in parse(two_sparks()).warnings)


def test_an_explicit_key_is_the_one_exported() -> None:
    rec = graph.run(graph.config())
    assert head_key(rec) == "sk-deploy-secret-0123456789abcde"
    assert rec.outputs["apiKey"] == "sk-deploy-secret-0123456789abcde" and "apiKey" in rec.secret_outputs
    assert not rec.of_type(ENDPOINT_KEY), "a user's key makes no generated one"


def test_none_may_stay_in_plain_text_but_a_key_may_not() -> None:
    opted_out = parse({**two_sparks(), "serve": {"apiKey": "none"}}, plaintext_keys=frozenset({"serve"}))
    assert opted_out.settings.serve.api_key is not None
    with pytest.raises(ConfigError, match="`serve.apiKey` is stored in plain text"):
        parse(
            {**two_sparks(), "serve": {"apiKey": "sk-plain-0123456789abcdef0123456"}},
            plaintext_keys=frozenset({"serve"}),
        )
