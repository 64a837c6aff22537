"""ssh option rendering: key by 0600 file never argv, multiplexing, agent and known-hosts choices."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from components.ssh import SshTarget, materialize_key, ssh_argv, ssh_options

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----"


def test_key_reaches_ssh_as_a_private_file_never_as_argv() -> None:
    argv = ssh_argv(SshTarget(host="127.0.0.2", port=2222, user="root", private_key=KEY), "docker ps")
    assert not any("PRIVATE KEY" in a for a in argv)
    path = argv[argv.index("-i") + 1]
    assert Path(path).read_text().strip() == KEY.strip()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert argv[-2:] == ["root@127.0.0.2", "docker ps"] and argv[argv.index("-p") + 1] == "2222"


def test_same_key_same_file_and_a_changed_file_is_rewritten() -> None:
    path = materialize_key(KEY)
    path.write_text("tampered")
    assert materialize_key(KEY) == path and path.read_text().strip() == KEY.strip()


def test_every_node_multiplexes_one_master_and_never_prompts() -> None:
    opts = " ".join(ssh_options(SshTarget(host="h", user="u", private_key=KEY)))
    for option in ("BatchMode=yes", "ControlMaster=auto", "ControlPersist=", "ConnectTimeout=", "IdentitiesOnly=yes"):
        assert option in opts


def test_agent_socket_and_known_hosts_file_are_passed_as_options() -> None:
    opts = ssh_options(SshTarget(host="h", user="u", agent_socket="/run/agent.sock", known_hosts_file="/k/hosts"))
    assert "IdentityAgent=/run/agent.sock" in opts and "UserKnownHostsFile=/k/hosts" in opts
    assert "-i" not in opts


def test_repr_never_shows_the_key() -> None:
    assert "PRIVATE" not in repr(SshTarget(host="h", user="u", private_key=KEY))
