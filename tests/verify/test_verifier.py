"""The Verifier resource: its provider's CRUD, pickling, and what the program registers."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import dill
import pytest

from components.dynamic import props_of, unwrap_secret
from components.verify import client
from components.verify import verifier as verify
from components.verify.verdict import VERIFY_EXPECTED
from components.verify.verifier import VerificationFailed, VerifierArgs, VerifierProvider
from tests.support import recording
from tests.support.fake_vllm import (
    GOOD_TOKENS,
    NAN_STREAM_ERROR,
    FakeVllm,
    Reply,
    chat_body,
    error_body,
    good_items,
    items_with,
)
from tests.support.imports import import_side_effects

ROOT = Path(__file__).resolve().parents[2]
MODEL = "fake-model"
pytestmark = pytest.mark.timeout(10)


# --- Pulumi dynamic provider --------------------------------------------------------------------


def _props(url: str, **overrides: Any) -> dict[str, Any]:
    props: dict[str, Any] = {
        "endpoint": url,
        "model": MODEL,
        "api_key": None,
        "timeout_s": 2,
        "retry_window_s": 0,
        "min_decode_tokens_per_second": None,
        "rerun_on": ["head-id-1", "worker-id-1"],
        "rollback_command": "",
        "__provider": "pickled-provider-v1",
    }
    return {**props, **overrides}


def test_provider_create_verifies_and_returns_outputs() -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as server:
        result = VerifierProvider().create(_props(server.url, api_key="k-1"))
        assert server.completion_requests()[0].headers["Authorization"] == "Bearer k-1"
    assert result.id.startswith("verifier-")
    outs = result.outs
    assert outs is not None
    assert outs["answer"] == "Paris."
    assert outs["logprobs"] == [{"token": t, "logprob": v} for t, v in GOOD_TOKENS]
    assert outs["decode_tokens_per_second"] is None and outs["latency_s"] >= 0
    assert outs["verified_at"].endswith("Z") and "T" in outs["verified_at"]
    assert outs["rerun_on"] == ["head-id-1", "worker-id-1"] and outs["endpoint"] == server.url
    assert "__provider" not in outs
    # The outputs a deployed stack holds: the compared inputs and the verdict; never the rollback command.
    assert set(outs) == {*OLD_INPUT_KEYS, *verify.OUTPUT_KEYS}


def test_provider_create_raises_the_one_line_diagnosis() -> None:
    with (
        FakeVllm(Reply(status=400, body=error_body(NAN_STREAM_ERROR, "BadRequestError", 400))) as server,
        pytest.raises(VerificationFailed) as raised,
    ):
        VerifierProvider().create(_props(server.url, api_key="k-secret"))
    message = str(raised.value)
    assert message.startswith("verification failed (nan): ")
    assert "the model produced NaN" in message and "\n" not in message and "k-secret" not in message


def test_a_failed_verification_ends_with_the_rollback_command() -> None:
    command = "dsv41-exl3 rollback --stack prod"
    with (
        FakeVllm(Reply(status=400, body=error_body(NAN_STREAM_ERROR, "BadRequestError", 400))) as server,
        pytest.raises(VerificationFailed) as raised,
    ):
        VerifierProvider().create(_props(server.url, rollback_command=command))
    assert str(raised.value).endswith(f"To go back to the last verified deployment: {command}")
    assert str(raised.value).startswith("verification failed (nan): ")


def test_the_rollback_command_is_not_an_input_the_diff_compares() -> None:
    """A program version that adds it (or a renamed command) must not re-verify a serving deployment."""
    olds = _props("http://127.0.0.1:1/v1", answer="Paris.")
    news = _props("http://127.0.0.1:1/v1", rollback_command="dsv41-exl3 rollback --stack dev")
    assert not VerifierProvider().diff("verifier-1", olds, news).changes


def test_diff_with_equal_inputs_reports_no_changes() -> None:
    olds = _props("http://127.0.0.1:1/v1", timeout_s=2.0, answer="Paris.", latency_s=0.4)
    # a new pickled provider (any code edit), int vs float and container order are not changes
    news = _props("http://127.0.0.1:1/v1/", __provider="pickled-provider-v2", rerun_on=["worker-id-1", "head-id-1"])
    result = VerifierProvider().diff("verifier-1", olds, news)
    assert result.changes is False
    assert not result.replaces


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("rerun_on", ["head-id-2", "worker-id-1"]),
        ("rerun_on", ["head-id-1"]),
        ("endpoint", "http://127.0.0.1:2/v1"),
        ("model", "other-model"),
        ("api_key", "k-2"),
        ("min_decode_tokens_per_second", 15.0),
        ("timeout_s", 30.0),
        ("rerun_on", "04da6b54-80e4-46f7-96ec-b56ff0331ba9"),  # unknown during preview
    ],
)
def test_diff_with_a_changed_input_reruns_the_verification(key: str, value: Any) -> None:
    olds = _props("http://127.0.0.1:1/v1")
    result = VerifierProvider().diff("verifier-1", olds, {**olds, key: value})
    assert result.changes is True, f"a change of {key} must re-verify"
    assert not result.replaces, "re-verification is an in-place update"


def test_update_reverifies_and_returns_full_outputs() -> None:
    with FakeVllm(Reply(body=chat_body(good_items()).encode())) as server:
        olds = {**_props(server.url), "answer": "old", "verified_at": "2020-01-01T00:00:00Z"}
        news = _props(server.url, rerun_on=["head-id-2", "worker-id-2"])
        result = VerifierProvider().update("verifier-1", olds, news)
        assert len(server.completion_requests()) == 1, "update runs the verification again"
    outs = result.outs
    assert outs is not None
    assert set(verify.OUTPUT_KEYS) | set(verify.INPUT_KEYS) <= set(outs)
    assert outs["answer"] == "Paris." and outs["verified_at"] != "2020-01-01T00:00:00Z"
    assert outs["rerun_on"] == ["head-id-2", "worker-id-2"]


def test_update_that_fails_raises_instead_of_keeping_stale_outputs() -> None:
    with (
        FakeVllm(Reply(body=chat_body(items_with(None)).encode())) as server,
        pytest.raises(VerificationFailed, match=r"\(nan\)"),
    ):
        VerifierProvider().update("verifier-1", _props(server.url), _props(server.url, rerun_on=["new"]))


def test_provider_pickles_by_reference_as_the_sdk_does() -> None:
    from pulumi.dynamic.dynamic import serialize_provider

    encoded = serialize_provider(VerifierProvider())
    raw = base64.b64decode(encoded)
    restored = dill.loads(raw)
    assert type(restored) is VerifierProvider, "the class must be the importable one, not a copy"
    # By reference: the module path is recorded, the code is not.
    assert b"components.verify.verifier" in raw
    assert b"verify_endpoint" not in raw and b"co_code" not in raw
    assert len(raw) < 500


def test_module_imports_without_side_effects() -> None:
    assert import_side_effects("components.verify.verifier") == []
    assert VerifierProvider.__module__ == "components.verify.verifier"


def test_verifier_resource_registers_inputs_and_a_pickled_provider() -> None:
    import pulumi

    registered: list[tuple[str, dict[str, Any]]] = []

    class Mocks(pulumi.runtime.Mocks):
        def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
            registered.append((args.typ, dict(args.inputs)))
            outs = {**args.inputs, "answer": "Paris.", "logprobs": [], "latency_s": 0.1}
            return f"{args.name}-id", outs

        def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
            return {}, None

    pulumi.runtime.set_mocks(Mocks(), preview=False)
    resource = verify.Verifier(
        "verify",
        verify.VerifierArgs(
            endpoint="http://10.0.0.1:8888/v1",
            model=MODEL,
            rerun_on=["h", "w"],
            api_key="k-9",
            timeout_s=120,
            retry_window_s=1800,
            min_decode_tokens_per_second=None,
            warmup_timeout_s=None,
            expected_answer="Paris",
            rollback_command="dsv41-exl3 rollback --stack dev",
        ),
    )

    @pulumi.runtime.test
    def check() -> pulumi.Output[Any]:
        def assert_registered(answer: str) -> None:
            ((typ, inputs),) = registered
            assert typ == "pulumi-python:dynamic/verify:Verifier"
            assert inputs["rerun_on"] == ["h", "w"] and inputs["endpoint"] == "http://10.0.0.1:8888/v1"
            assert unwrap_secret(inputs["api_key"]) == "k-9"
            assert inputs["api_key"] != "k-9", "the API key must travel as a secret"
            assert inputs["__provider"]
            assert answer == "Paris."

        return resource.answer.apply(assert_registered)

    check()


def test_verifier_resource_carries_the_warm_up_bound() -> None:
    props = _props("http://127.0.0.1:9/v1", warmup_timeout_s=300)
    inputs = verify.read_inputs(props)
    assert inputs.warmup_timeout_s == 300.0 and inputs.to_props()["warmup_timeout_s"] == 300.0
    assert client.worst_case_seconds(120, 300, 0, 300) == 300 + 300 + 120 + client.HEALTH_TIMEOUT_S


@pytest.mark.parametrize("key", ["timeout_s", "retry_window_s"])
def test_a_missing_setting_is_an_error_not_a_default(key: str) -> None:
    props = _props("http://127.0.0.1:9/v1")
    del props[key]
    with pytest.raises(ValueError, match=f"VerifierArgs.{key} is missing"):
        verify.read_inputs(props)


# --- the properties a deployed stack holds ------------------------------------------------------------

# The inputs the diff compared before VerifierArgs was a contract: a change of any re-verifies.
OLD_INPUT_KEYS = (
    "endpoint",
    "model",
    "api_key",
    "timeout_s",
    "retry_window_s",
    "min_decode_tokens_per_second",
    "warmup_timeout_s",
    "expected_answer",
    "rerun_on",
)
# The properties Verifier registered before VerifierArgs was a contract (built by hand in Verifier.__init__), for
# the args of `_program_args`, as the engine stores them: None left out, numbers as floats, the key a secret.
RECORDED = {
    "endpoint": "http://10.0.0.1:8888/v1",
    "model": "DeepSeek-v4.1-Flash-EXL3",
    "rerun_on": ["serving-spark-0-id", "serving-spark-1-id"],
    "api_key": recording.wire_secret("sk-deploy-secret-0123456789abcde"),
    "timeout_s": 120.0,
    "retry_window_s": 300.0,
    "warmup_timeout_s": 300.0,
    "expected_answer": "Paris",
    "rollback_command": "dsv41-exl3 rollback --stack dev",
}
# Every key that old code put in the properties, None ones included (the outputs, and no decode threshold).
RECORDED_KEYS = {*RECORDED, "min_decode_tokens_per_second", *verify.OUTPUT_KEYS}


def _program_args() -> VerifierArgs:
    """As components/verify/wiring.py builds them, for the default `gates` settings."""
    import pulumi

    return VerifierArgs(
        endpoint="http://10.0.0.1:8888/v1",
        model="DeepSeek-v4.1-Flash-EXL3",
        rerun_on=pulumi.Output.from_input(["serving-spark-0-id", "serving-spark-1-id"]),
        api_key=pulumi.Output.secret("sk-deploy-secret-0123456789abcde"),
        timeout_s=min(client.DEFAULT_TIMEOUT_S, 300.0),
        retry_window_s=300.0,
        warmup_timeout_s=300.0,
        min_decode_tokens_per_second=None,
        expected_answer="Paris",
        rollback_command="dsv41-exl3 rollback --stack dev",
    )


def test_the_properties_keep_the_shape_deployed_stacks_hold() -> None:
    """A deployed stack's next `up` sees no diff: same keys, values and secrets as before the contract."""
    assert {*props_of(_program_args()), *verify.OUTPUT_KEYS} == RECORDED_KEYS
    assert verify.INPUT_KEYS == OLD_INPUT_KEYS
    assert VerifierProvider.input_keys == OLD_INPUT_KEYS

    def program() -> None:
        verify.Verifier("verify", _program_args())

    registered = recording.run(program).named("verify")
    assert registered.stored() == RECORDED
    assert registered.additional_secret_outputs == ["api_key"]


def test_the_provider_reads_back_what_the_program_sent() -> None:
    props = {**RECORDED, "api_key": "sk-deploy-secret-0123456789abcde", "__provider": "pickled"}
    inputs = verify.read_inputs(props)
    assert (inputs.endpoint, inputs.model) == (RECORDED["endpoint"], RECORDED["model"])
    assert inputs.api_key == "sk-deploy-secret-0123456789abcde"
    assert inputs.rerun_on == ("serving-spark-0-id", "serving-spark-1-id")
    assert (inputs.timeout_s, inputs.retry_window_s, inputs.warmup_timeout_s) == (120.0, 300.0, 300.0)
    assert inputs.min_decode_tokens_per_second is None, "absent: no decode threshold"
    assert (inputs.expected_answer, inputs.rollback_command) == ("Paris", "dsv41-exl3 rollback --stack dev")
    assert "sk-deploy-secret-0123456789abcde" not in repr(inputs), "the key stays out of tracebacks"


def test_state_from_before_the_expected_answer_reads_the_recipes_answer() -> None:
    props = _props("http://127.0.0.1:9/v1")
    assert "expected_answer" not in props
    assert verify.read_inputs(props).expected_answer == VERIFY_EXPECTED
