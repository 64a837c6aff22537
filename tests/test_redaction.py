"""One redaction for config errors, gate failures and verifier diagnoses."""

from __future__ import annotations

from components.redaction import redact

L_ARGS_WITH_KEY = (
    "(APIServer pid=1) INFO 09-22 10:00:00 [utils.py:250] non-default args: {'model': '/model', "
    "'api_key': 'sk-live-very-secret-0123456789ab', 'port': 8888}"
)


def test_redact_removes_known_values_and_key_shapes() -> None:
    out = redact(L_ARGS_WITH_KEY, key_shapes=True)
    assert "sk-live-very-secret-0123456789ab" not in out and "'api_key': '***'" in out
    assert redact("token hf_abcdefghijklmnopqrstu here", key_shapes=True) == "token *** here"
    assert redact("curl -H 'Authorization: Bearer abc123'", key_shapes=True) == "curl -H 'Authorization: Bearer ***"
    assert redact("oops MYSECRET leaked", ["MYSECRET"], key_shapes=True) == "oops *** leaked"


def test_known_values_only_leave_key_shaped_text_alone() -> None:
    # A diagnosis quoting `max_tokens=5` must keep it: only the known values go.
    assert redact("max_tokens=5 with key k-9", ["k-9"]) == "max_tokens=5 with key ***"
    assert redact("no secret here", [None, ""]) == "no secret here"


def test_the_longest_secret_goes_first_so_none_is_half_shown() -> None:
    assert redact("key abcdef", ["abc", "abcdef"], mask="[secret]") == "key [secret]"
