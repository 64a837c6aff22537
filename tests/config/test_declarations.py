"""Each key is declared once; everything that repeats a key's facts is read from, or checked against, it.

The owned flags and variables, the README's table, the stack template and the stand-in's flags must agree
with the declarations: each test here fails on one difference.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from components.config import NAMESPACE, OWNED_ENV, OWNED_FLAGS, Declared, Serve, Settings, canonical_flag, parse
from components.config import declarations as declared_in
from components.config.flags import DECLARED, DERIVED_ENV, RANK_FLAGS, REFUSED_FLAGS
from components.config.table import BEGIN, END, config_table, with_table
from components.serving import spec
from tests.sim.test_standin import standin
from tests.support.configs import two_sparks

REPO = Path(__file__).resolve().parents[2]


def value_type(d: Declared) -> type:
    """The type of the key's value, without None."""
    members = [m for m in typing.get_args(d.info.annotation) or (d.info.annotation,) if m is not type(None)]
    return members[0]


def other_value(d: Declared) -> Any:
    """A valid value other than the key's default (the smallest above it for a number)."""
    kind, value = value_type(d), d.default
    if kind is bool:
        return not value
    if kind is int:
        return 1 if value is None else value + 1
    if kind is float:
        return 0.5 if value is None else round(value / 2, 3)
    return "other_name"


def settings_with(**serve: Any) -> Settings:
    return parse(two_sparks(serve=serve)).settings


# Every `serve` flag key that renders nothing by default (unset, empty or false) set, so that one render holds
# every flag the keys render, and eager mode (which drops CUDA graphs and speculation) in a second render.
SERVE_FLAG_KEYS = [d for d in declared_in(Serve, "serve.") if d.flag]
ALL_ON = {
    d.key.removeprefix("serve."): other_value(d)
    for d in SERVE_FLAG_KEYS
    if (d.default is None or d.default == "" or d.default is False) and d.name != "enforce_eager"
}
EAGER = {"enforceEager": True}


def settings(**overrides: Any) -> Settings:
    return parse(two_sparks(**overrides)).settings


def rendered_flags(s: Settings) -> set[str]:
    argv = [*spec.rank_command(s, 0), *spec.rank_command(s, 1)]
    return {name for arg in argv if (name := canonical_flag(arg)) and name.startswith("--")}


def fixed_flags() -> set[str]:
    fixed = {f for group in spec.FIXED_FLAGS_AFTER.values() for f in group if f.startswith("--")}
    return {canonical_flag(f) or f for f in fixed} | {"--cudagraph-capture-sizes", "--distributed-executor-backend"}


class TestOwnedNames:
    def test_every_flag_a_key_renders_is_owned_and_every_other_is_a_fixed_flag(self) -> None:
        for s in (settings_with(**ALL_ON), settings_with(**EAGER)):
            for name in rendered_flags(s):
                assert name in OWNED_FLAGS or name in fixed_flags(), name

    def test_every_owned_flag_is_rendered_by_some_setting_or_is_refused_outright(self) -> None:
        seen = rendered_flags(settings_with(**ALL_ON)) | rendered_flags(settings_with(**EAGER))
        assert set(OWNED_FLAGS) - set(REFUSED_FLAGS) <= seen
        assert not set(REFUSED_FLAGS) & seen

    def test_the_stand_in_knows_every_flag_the_program_renders(self) -> None:
        for s in (settings_with(**ALL_ON), settings_with(**EAGER)):
            unknown = {f for f in rendered_flags(s) if f not in standin.FLAGS}
            assert not unknown, f"sim/standin/vllm_standin.py FLAGS lacks {sorted(unknown)}"

    def test_every_variable_a_key_renders_is_owned(self) -> None:
        s = settings(serve={"apiKey": "sk-test-key-0123-0123456789abcde"})
        env = spec.node_env(s, s.head, 3)
        from_keys = set(env) - set(spec.NCCL_COMMON_ENV) - set(spec.LAUNCHER_ENV)
        # The API key is set on the head by the serving layer, which holds the secret.
        assert from_keys | {"VLLM_API_KEY"} == set(OWNED_ENV)

    def test_a_declared_flag_or_variable_is_owned_with_the_key_to_set_instead(self) -> None:
        for d in DECLARED:
            if d.flag:
                assert f"`{d.key}`" in OWNED_FLAGS[d.flag]
            for name in d.env:
                assert f"`{d.key}`" in OWNED_ENV[name]
        assert set(RANK_FLAGS) | set(REFUSED_FLAGS) <= set(OWNED_FLAGS) and set(DERIVED_ENV) <= set(OWNED_ENV)

    def test_a_hand_set_declared_flag_is_refused_naming_its_key(self) -> None:
        for d in declared_in(Serve, "serve."):
            if d.flag:
                with pytest.raises(ValueError, match=re.escape(f"`{d.key}`")):
                    parse(two_sparks(serve={"extraArgs": [d.flag, "1"]}))


class TestRendering:
    def test_each_plain_flag_key_renders_its_value_at_its_flag(self) -> None:
        plain = [d for d in spec.SERVE_FLAG_KEYS if d.name not in spec.CUSTOM_FLAG_RENDERERS]
        assert len(plain) >= 10
        for d in plain:
            value = other_value(d)
            s = Settings.model_validate({**two_sparks(), "serve": {d.key.split(".")[1]: value}})
            argv = spec.model_flags(s)
            if isinstance(value, bool):
                assert (d.flag in argv) is value, d.key
            else:
                assert argv[argv.index(d.flag) + 1] == str(value), d.key

    def test_each_serve_variable_key_renders_its_value(self) -> None:
        for d in spec.SERVE_ENV_KEYS:
            value = other_value(d)
            s = Settings.model_validate({**two_sparks(), "serve": {d.key.split(".")[1]: value}})
            if isinstance(value, bool):
                expect = "1" if value else "0"
            else:
                expect = f"{value:g}" if isinstance(value, float) else str(value)
            assert spec.common_env(s)[d.env[0]] == expect, d.key

    def test_fixed_flags_follow_keys_that_render_a_flag(self) -> None:
        assert set(spec.FIXED_FLAGS_AFTER) <= {d.name for d in spec.SERVE_FLAG_KEYS}


class TestDocuments:
    def test_the_readme_config_table_is_the_rendered_one(self) -> None:
        readme = (REPO / "README.md").read_text()
        assert readme.count(BEGIN) == 1 and readme.count(END) == 1
        assert with_table(readme) == readme, "README.md's config table is stale: run `make config-table`"

    def test_the_table_has_a_row_per_key_with_its_default(self) -> None:
        rows = {line.split(" | ")[0].strip("| `"): line for line in config_table().splitlines()[2:]}
        assert list(rows) == [d.key for d in DECLARED]
        assert "`2`" in rows["serve.maxNumSeqs"] and "`--max-num-seqs`" in rows["serve.maxNumSeqs"]
        assert "| yes |" in rows["serve.apiKey"] and "| yes |" not in rows["serve.port"]

    def test_a_change_to_a_declaration_shows_in_the_table(self, monkeypatch: pytest.MonkeyPatch) -> None:
        d = next(d for d in DECLARED if d.key == "serve.maxNumSeqs")
        monkeypatch.setattr(d.info, "description", "a new meaning")
        readme = (REPO / "README.md").read_text()
        assert with_table(readme) != readme and "a new meaning" in with_table(readme)

    def test_the_stack_template_writes_each_sections_defaults(self) -> None:
        stack = yaml.safe_load((REPO / "Pulumi.dev.yaml").read_text())["config"]
        defaults = {d.key: d.default for d in DECLARED if not d.required}
        checked = 0
        for full_key, value in stack.items():
            key = full_key.removeprefix(f"{NAMESPACE}:")
            if key == "nodes":
                # Per-node values differ by node (the worker's interface); the head's are the declared ones.
                for leaf, v in value[0].items():
                    if f"nodes[].{leaf}" in defaults:
                        assert v == defaults[f"nodes[].{leaf}"], f"nodes[0].{leaf}"
                        checked += 1
                continue
            for leaf, v in value.items() if isinstance(value, dict) else [("", value)]:
                path = f"{key}.{leaf}" if leaf else key
                assert path in defaults, f"Pulumi.dev.yaml sets {path}, which is not a declared key"
                assert v == defaults[path], f"Pulumi.dev.yaml: {path} = {v!r}, declared default {defaults[path]!r}"
                checked += 1
        assert checked >= 20


# Every key whose value is a container image, by its name (a new image key is caught by its name alone).
IMAGE_KEYS = [d for d in declared_in(Settings) if d.key.rsplit(".", 1)[-1].lower().endswith("image")]


def test_the_image_keys_are_found() -> None:
    keys = {d.key for d in IMAGE_KEYS}
    assert {"image", "observability.prometheusImage", "observability.nodeExporterImage"} <= keys, keys


@pytest.mark.parametrize("d", IMAGE_KEYS, ids=lambda d: d.key)
def test_every_default_image_is_pinned_by_digest(d: Declared) -> None:
    # A tag moves: two nodes pulling it minutes apart can run two builds, and a rebuilt tag changes what an
    # unchanged stack deploys. The tag stays beside the digest for the reader; docker pulls the digest.
    if not d.default:
        return  # a key whose default deploys no image
    assert re.fullmatch(r"[^@\s]+:[A-Za-z0-9_][A-Za-z0-9_.-]*@sha256:[0-9a-f]{64}", d.default), (
        f"{d.key} defaults to {d.default!r}: pin it as `name:tag@sha256:<digest of the multi-arch index>`"
    )
