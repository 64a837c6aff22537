"""Host keys: looked up as ssh does, recorded on first use, a changed key refused with the fix."""

from __future__ import annotations

import stat
import subprocess
import time
from pathlib import Path

import pytest

from components import host_keys
from components.host_keys import HostKey, HostKeyError, NodeAddress, lookup, pin_all

# Bound at import (collection), before tests/conftest.py replaces host_keys.keyscan with a stand-in.
from components.host_keys import keyscan as real_keyscan  # isort: skip

ED = HostKey(kind="ssh-ed25519", blob="AAAAC3NzaC1lZDI1NTE5AAAAIBt2Oq3nMXcpl0yoSX3MmBC8K7bRdpJdFzPIy9cZ0bQ7")
ED2 = HostKey(kind="ssh-ed25519", blob="AAAAC3NzaC1lZDI1NTE5AAAAIHcT6XU9pm1d3O0p4S0nF9bX9Zc4X0yP3bVvS1i8C2Qk")
RSA = HostKey(kind="ssh-rsa", blob="AAAAB3NzaC1yc2EAAAADAQABAAABAQC7")
SPARK = NodeAddress(node="spark-1", host="10.0.0.2", port=2222)


def scans(*keys: HostKey) -> host_keys.Scan:
    return lambda _h, _p: list(keys)


def unreachable(host: str, port: int) -> list[HostKey]:
    raise HostKeyError(f"ssh-keyscan got no key from {host}:{port} within 5 s (connection refused)")


def test_port_22_is_looked_up_by_name_and_other_ports_by_bracket_form() -> None:
    text = f"10.0.0.2 {ED.line()}\n[10.0.0.2]:2222 {ED2.line()}\n"
    assert lookup(text, "10.0.0.2", 22)[0] == [ED]
    assert lookup(text, "10.0.0.2", 2222)[0] == [ED2]
    assert lookup(text, "10.0.0.2", 2200)[0] == []


def test_brackets_are_literal_text_and_patterns_follow_ssh() -> None:
    # fnmatch would read "[10.0.0.2]" as a character class and match "1:2222"
    assert lookup(f"[10.0.0.2]:2222 {ED.line()}\n", "1", 2222)[0] == []
    text = f"spark-*,!spark-9 {ED.line()}\n# comment\n\n@cert-authority * {ED2.line()}\n"
    assert lookup(text, "SPARK-1", 22)[0] == [ED]
    assert lookup(text, "spark-9", 22)[0] == [], "a negated pattern excludes the host"


def test_hashed_entries_written_by_ssh_keygen_are_found(tmp_path: Path) -> None:
    file = tmp_path / "known_hosts"
    file.write_text(f"[10.0.0.2]:2222 {ED.line()}\n10.0.0.3 {ED2.line()}\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(file)], check=True, capture_output=True)
    text = file.read_text()
    assert "10.0.0.2" not in text and text.startswith("|1|")
    assert lookup(text, "10.0.0.2", 2222)[0] == [ED]
    assert lookup(text, "10.0.0.3", 22)[0] == [ED2]
    assert lookup(text, "10.0.0.3", 2222)[0] == []


def test_first_use_records_the_preferred_key_where_ssh_finds_it(tmp_path: Path) -> None:
    file = tmp_path / "ssh" / "known_hosts"
    pins = pin_all([SPARK], str(file), scans(RSA, ED))
    assert pins["spark-1"].key == ED and pins["spark-1"].recorded
    assert "first connection" in (pins["spark-1"].note or "")
    assert file.read_text() == f"[10.0.0.2]:2222 {ED.line()}\n"
    assert stat.S_IMODE(file.stat().st_mode) == 0o600 and stat.S_IMODE(file.parent.stat().st_mode) == 0o700
    found = subprocess.run(["ssh-keygen", "-F", "[10.0.0.2]:2222", "-f", str(file)], capture_output=True, text=True)
    assert found.returncode == 0 and ED.blob in found.stdout, "ssh must read the line the program wrote"
    again = pin_all([SPARK], str(file), scans(RSA, ED))
    assert again["spark-1"].key == ED and not again["spark-1"].recorded
    assert file.read_text().count("\n") == 1, "a known key is never appended twice"


def test_a_changed_key_is_refused_with_the_removal_command_and_the_file_is_kept(tmp_path: Path) -> None:
    file = tmp_path / "known_hosts"
    file.write_text(f"[10.0.0.2]:2222 {ED.line()}")  # no final newline, as editors leave it
    with pytest.raises(HostKeyError) as err:
        pin_all([SPARK], str(file), scans(ED2))
    text = str(err.value)
    assert "host key of node spark-1 (10.0.0.2:2222) changed from" in text
    assert ED.fingerprint() in text and ED2.fingerprint() in text
    assert f"ssh-keygen -R '[10.0.0.2]:2222' -f {file}" in text
    assert file.read_text() == f"[10.0.0.2]:2222 {ED.line()}", "a refused key is never recorded"


def test_a_node_now_offering_only_another_key_type_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "known_hosts"
    file.write_text(f"[10.0.0.2]:2222 {RSA.line()}\n")
    with pytest.raises(HostKeyError, match="changed from ssh-rsa"):
        pin_all([SPARK], str(file), scans(ED))


def test_an_unreachable_new_node_names_node_host_port_and_the_fix(tmp_path: Path) -> None:
    file = tmp_path / "known_hosts"
    other = NodeAddress(node="spark-0", host="10.0.0.1", port=22)
    with pytest.raises(HostKeyError) as err:
        pin_all([other, SPARK], str(file), unreachable)
    text = str(err.value)
    for node in ("spark-0 (10.0.0.1:22)", "spark-1 (10.0.0.2:2222)"):
        assert f"node {node}: no host key" in text, "every node's refusal is reported together"
    assert f"ssh-keyscan -p 2222 10.0.0.2 >> {file}" in text
    assert not file.exists()


def test_an_unreachable_known_node_keeps_its_recorded_key_with_a_warning(tmp_path: Path) -> None:
    file = tmp_path / "known_hosts"
    file.write_text(f"[10.0.0.2]:2222 {RSA.line()}\n[10.0.0.2]:2222 {ED.line()}\n")
    pin = pin_all([SPARK], str(file), unreachable)["spark-1"]
    assert pin.key == ED and not pin.recorded and "using the recorded one" in (pin.note or "")


def test_a_revoked_key_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "known_hosts"
    file.write_text(f"@revoked * {ED2.line()}\n")
    with pytest.raises(HostKeyError, match="@revoked"):
        pin_all([SPARK], str(file), scans(ED2))


def test_keyscan_of_a_closed_port_fails_fast_and_says_where() -> None:
    start = time.monotonic()
    with pytest.raises(HostKeyError) as err:
        real_keyscan("127.0.0.1", 1, timeout_s=2)
    assert time.monotonic() - start < 10
    assert "127.0.0.1:1" in str(err.value)
