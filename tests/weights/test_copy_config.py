"""The worker copy's two boundaries (components/weights/copy_config.py): the config line the program builds for the
head's source and for the worker's copier, read back in the container by `from_json`, every default in its field,
a malformed payload refused naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from components.contract import ContractError
from components.weights import local_copy as lc
from components.weights import manifest as wm
from components.weights.copy_config import CopierConfig, ExpectedFile, Limits, SourceConfig

TOKEN = "copy-token-7f3a9c"


def source_config() -> SourceConfig:
    return lc.source_config(token=TOKEN, worker_fabric_ip="192.168.100.2", timeout_s=3600)


def copier_config() -> CopierConfig:
    return lc.copier_config(
        token=TOKEN, files={"model/b": 7, "model/a": 5}, sha256={"model/a": "a" * 64, "model/b": "b" * 64}
    )


def test_the_source_config_round_trips_as_one_line() -> None:
    config = source_config()
    line = config.to_line()
    assert "\n" not in line, "the first line of the source's stdin: the heartbeats follow"
    again = SourceConfig.from_json(line)
    assert again == config and isinstance(again.allow, tuple) and isinstance(again.limits, Limits)
    assert (again.allow, again.dirs, again.max_lifetime_s) == (("192.168.100.2",), wm.SERVED_DIRS, 4200.0)
    assert SourceConfig.from_json(config.to_json()) == config, "the indented form reads the same"


def test_the_source_configs_defaults_live_in_its_fields() -> None:
    least = SourceConfig.from_json(json.dumps({"token": TOKEN, "allow": ["10.0.0.2"], "dirs": ["model"]}))
    assert least.limits == Limits() and least.max_lifetime_s == 86400.0
    assert Limits() == Limits(max_connections=72, request_timeout_s=10.0, io_timeout_s=60.0, silence_s=40.0)
    partial = SourceConfig.from_json(
        json.dumps({"token": TOKEN, "allow": ["10.0.0.2"], "dirs": [], "limits": {"silence_s": 1}})
    )
    assert partial.limits == Limits(silence_s=1.0), "a limit left out is its field's default"


def test_the_copier_config_round_trips_with_every_expected_file_typed() -> None:
    config = copier_config()
    assert [e.path for e in config.expected] == ["model/a", "model/b"], "sorted: the same line for the same files"
    again = CopierConfig.from_json(config.to_line())
    assert again == config and isinstance(again.expected, tuple)
    assert again.expected[1] == ExpectedFile(path="model/b", size=7, sha256="b" * 64)


def test_the_token_stays_out_of_reprs_and_is_declared_secret() -> None:
    for config in (source_config(), copier_config()):
        assert TOKEN not in repr(config) and TOKEN in config.to_line()
        assert type(config).secret_fields() == ["token"]


GOOD_SOURCE: dict[str, Any] = {"token": TOKEN, "allow": ["10.0.0.2"], "dirs": ["model"]}
GOOD_COPIER: dict[str, Any] = {"token": TOKEN, "expected": [{"path": "model/a", "size": 5, "sha256": "a" * 64}]}


@pytest.mark.parametrize(
    "payload, said",
    [
        ({**GOOD_SOURCE, "token": None}, "SourceConfig.token is missing"),
        ({k: v for k, v in GOOD_SOURCE.items() if k != "allow"}, "SourceConfig.allow is missing"),
        ({**GOOD_SOURCE, "allow": "10.0.0.2"}, "SourceConfig.allow must be a list, got str"),
        ({**GOOD_SOURCE, "dirs": [7]}, r"SourceConfig.dirs\[0\] must be str, got 7"),
        ({**GOOD_SOURCE, "max_lifetime_s": "1h"}, "SourceConfig.max_lifetime_s must be float, got '1h'"),
        ({**GOOD_SOURCE, "limits": {"max_connections": 6.5}}, "SourceConfig.limits.max_connections must be int"),
        ({**GOOD_SOURCE, "limits": 5}, "SourceConfig.limits must be an object, got int"),
        ({**GOOD_SOURCE, "limits": {"silence_s": 0}}, r"SourceConfig.limits: silence_s=0.0 must be > 0"),
        ({**GOOD_SOURCE, "token": ""}, "SourceConfig: the token and the workers' addresses are required"),
        ({**GOOD_SOURCE, "allow": []}, "SourceConfig: the token and the workers' addresses are required"),
    ],
)
def test_a_malformed_source_config_is_refused_naming_the_field(payload: dict[str, Any], said: str) -> None:
    with pytest.raises(ContractError, match=said):
        SourceConfig.from_json(json.dumps(payload))


@pytest.mark.parametrize(
    "payload, said",
    [
        ({"expected": []}, "CopierConfig.token is missing"),
        ({"token": TOKEN}, "CopierConfig.expected is missing"),
        ({**GOOD_COPIER, "expected": {"model/a": 5}}, "CopierConfig.expected must be a list, got dict"),
        (
            {**GOOD_COPIER, "expected": [{"path": "model/a", "size": "5", "sha256": "a" * 64}]},
            r"CopierConfig.expected\[0\].size must be int, got '5'",
        ),
        (
            {**GOOD_COPIER, "expected": [{"path": "model/a", "size": 5}]},
            r"CopierConfig.expected\[0\].sha256 is missing",
        ),
        ({**GOOD_COPIER, "token": ""}, "CopierConfig: no copy token"),
        ({**GOOD_COPIER, "expected": GOOD_COPIER["expected"] * 2}, r"a file is expected twice: \['model/a'\]"),
    ],
)
def test_a_malformed_copier_config_is_refused_naming_the_field(payload: dict[str, Any], said: str) -> None:
    with pytest.raises(ContractError, match=said):
        CopierConfig.from_json(json.dumps(payload))


@pytest.mark.parametrize("text, said", [("", "is not JSON"), ("[1]", "must be an object, got list")])
def test_a_line_that_is_no_json_object_is_refused_naming_the_contract(text: str, said: str) -> None:
    for cls in (SourceConfig, CopierConfig):
        with pytest.raises(ContractError, match=f"{cls.__name__} {said}"):
            cls.from_json(text)


def test_the_program_refuses_to_build_a_copy_it_could_not_verify() -> None:
    with pytest.raises(ValueError, match=r"staging recorded no sha256 for \['model/b'\]"):
        lc.copier_config(token=TOKEN, files={"model/a": 5, "model/b": 7}, sha256={"model/a": "a" * 64})
    with pytest.raises(ValueError, match="no copy token"):
        lc.copier_config(token="", files={}, sha256={})
