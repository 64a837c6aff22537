"""`python -m components.discover`: the nodes end to end with fake ssh and pinning, the exit codes, and bad input
reported one line each while the other nodes are still reported."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from components import host_keys
from components.config import parse
from components.discover.discover import main
from tests.discover.nodes import probe_text
from tests.support.host_keys import fake_host_key

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = "ssh: connect to host 10.0.0.2 port 22: No route to host\r\n"
KEY_BODY = "DISCOVERKEYb9Xq2Lm7"
KEY = f"-----BEGIN OPENSSH PRIVATE KEY-----\n{KEY_BODY}\n-----END OPENSSH PRIVATE KEY-----\n"
pytestmark = pytest.mark.timeout(60)


def done(stdout: str = "", stderr: str = "", returncode: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["ssh"], returncode, stdout, stderr)


class FakeSsh:
    """`run`: answers each node (by its SSH address) as told, and records every argv."""

    def __init__(self, by_host: dict[str, subprocess.CompletedProcess[str] | BaseException]) -> None:
        self.by_host = by_host
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        answer = self.by_host[argv[-2].split("@", 1)[1]]
        if isinstance(answer, BaseException):
            raise answer
        return answer


class FakePin:
    """`pin`: every node's key is the fixed fake one; the hosts in `changed` were reinstalled (a new key)."""

    def __init__(self, changed: Sequence[str] = ()) -> None:
        self.changed = set(changed)
        self.calls: list[tuple[list[host_keys.NodeAddress], str | None]] = []

    def __call__(
        self, nodes: Sequence[host_keys.NodeAddress], known_hosts_file: str | None
    ) -> dict[str, host_keys.Pin]:
        self.calls.append((list(nodes), known_hosts_file))
        pins = {}
        for n in nodes:
            key = fake_host_key(n.host, n.port)
            if n.host in self.changed:
                new = fake_host_key(n.host + ".new", n.port)
                raise host_keys.HostKeyError(host_keys.changed_message(n, known_hosts_file or "kh", [key], [new]))
            pins[n.node] = host_keys.Pin(key=key)
        return pins


@pytest.fixture(autouse=True)
def no_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


HEAD = done(probe_text())
WORKER = done(probe_text(ip="ip_worker.json", ib="ib_worker.txt"))


def _run(
    capsys: pytest.CaptureFixture[str], *args: str, ssh: FakeSsh | None = None, pin: FakePin | None = None
) -> tuple[int, str, str]:
    code = main(list(args), run=ssh or FakeSsh({"10.0.0.1": HEAD, "10.0.0.2": WORKER}), pin=pin or FakePin())
    out, err = capsys.readouterr()
    return code, out, err


def _pasted(out: str) -> dict[str, object]:
    """The block the output says to paste, read as the stack file would be."""
    lines = out.splitlines()
    start = lines.index("  dsv41-exl3:nodes:")
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("#"))
    loaded = yaml.safe_load("config:\n" + "\n".join(lines[start:end]))["config"]
    assert isinstance(loaded, dict)
    return {k.removeprefix("dsv41-exl3:"): v for k, v in loaded.items()}


def test_one_good_one_unreachable_one_changed_key_two_error_lines_the_good_one_in_full_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ssh = FakeSsh({"10.0.0.1": HEAD, "10.0.0.2": done(stderr=UNREACHABLE, returncode=255)})
    code, out, err = _run(
        capsys, "nvidia@10.0.0.1", "nvidia@10.0.0.2", "nvidia@10.0.0.3", ssh=ssh, pin=FakePin(changed=["10.0.0.3"])
    )
    assert code == 1
    unreachable, changed = err.splitlines()
    assert unreachable == (
        "error: node 2 (worker) nvidia@10.0.0.2: ssh: connect to host 10.0.0.2 port 22: No route to host; "
        "check the address, port and that your key is in the node's authorized_keys"
    )
    assert changed.startswith(
        "error: node 3 (worker) nvidia@10.0.0.3: host key of node spark-worker-2 (10.0.0.3:22) changed from"
    )
    assert "no connection was opened" in changed and "ssh-keygen -R '10.0.0.3'" in changed
    assert sorted(argv[-2] for argv in ssh.calls) == ["nvidia@10.0.0.1", "nvidia@10.0.0.2"], "no ssh to a changed key"
    head = out[out.index("# node 1 (head): nvidia@10.0.0.1") : out.index("# node 2 (worker)")]
    for line in (
        "fabric: enp1s0f1np1 192.168.100.1/24 on rocep1s0f1",
        "RoCE v2 GID index 3 holds 192.168.100.1",
        "memory: MemAvailable 118.1 GiB",
        "weights.root: /srv/dsv41-exl3; create it first: sudo install -d -o nvidia -m 0755 /srv/dsv41-exl3",
        "docker: server 28.3.3, usable by nvidia",
        "gpu: GPU 0: NVIDIA GB10",
        "nfs: nfs-kernel-server installed",
        "leftovers: no container of any stack",
    ):
        assert line in head, line
    assert "could not decide" not in head
    assert "#   not reached: ssh: connect to host 10.0.0.2 port 22: No route to host" in out
    nodes = _pasted(out)["nodes"]
    assert isinstance(nodes, list) and [n["name"] for n in nodes] == ["spark-head", "spark-worker", "spark-worker-2"]
    assert nodes[0]["fabricIp"] == "192.168.100.1" and nodes[2]["fabricIp"] == "<not decided: see below>"
    tail = out[out.index("# could not decide:") :]
    assert "spark-worker (nvidia@10.0.0.2) node: not reached" in tail
    assert "spark-worker-2 (nvidia@10.0.0.3) node: not reached: host key of node" in tail


def test_a_healthy_pair_exits_0_and_pastes_as_a_config_the_program_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "nvidia@10.0.0.1", "nvidia@10.0.0.2")
    assert (code, err) == (0, "")
    assert out.rstrip().endswith("# could not decide: nothing")
    pasted = _pasted(out)
    loaded = parse({**pasted, "ssh": {"privateKey": KEY}})
    head, worker = loaded.settings.nodes
    assert (head.fabric_ip, head.fabric_interface, head.ib_hcas, head.gid_index) == (
        "192.168.100.1",
        "enp1s0f1np1",
        ["rocep1s0f1"],
        "auto",
    )
    assert (worker.fabric_ip, worker.fabric_interface, worker.ib_hcas) == (
        "192.168.100.2",
        "enp1s0f0np0",
        ["rocep1s0f0"],
    )
    assert loaded.settings.weights.root == "/srv/dsv41-exl3"


def test_something_undecided_on_a_reached_node_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    ssh = FakeSsh({"10.0.0.1": done(probe_text(nfs="unknown ok not-installed")), "10.0.0.2": WORKER})
    code, out, err = _run(capsys, "nvidia@10.0.0.1", "nvidia@10.0.0.2", ssh=ssh)
    assert (code, err) == (1, "")
    assert "spark-head (nvidia@10.0.0.1) weights.share: nfs-kernel-server is not installed" in out
    assert "`sudo apt-get install nfs-kernel-server`" in out


def test_a_host_with_no_docker_is_one_line_and_the_others_are_still_reported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    no_docker = probe_text(
        ip="ip_worker.json",
        ib="ib_worker.txt",
        replace={
            "docker": "unavailable: no docker command on PATH",
            "leftovers": "unavailable: no docker command on PATH",
        },
    )
    code, out, _ = _run(
        capsys, "nvidia@10.0.0.1", "nvidia@10.0.0.2", ssh=FakeSsh({"10.0.0.1": HEAD, "10.0.0.2": done(no_docker)})
    )
    assert code == 1
    tail = out[out.index("# could not decide:") :].splitlines()[1:]
    assert tail == [
        "#   - spark-worker (nvidia@10.0.0.2) user: docker is not usable on this node (no docker command on PATH); "
        "fix: install Docker and the NVIDIA Container Toolkit (DGX OS ships both)"
    ]
    assert "RoCE v2 GID index 1 holds 192.168.100.2" in out


def test_json_is_one_object_with_every_node(capsys: pytest.CaptureFixture[str]) -> None:
    ssh = FakeSsh({"10.0.0.1": HEAD, "10.0.0.2": done(stderr=UNREACHABLE, returncode=255)})
    code, out, err = _run(capsys, "--json", "nvidia@10.0.0.1", "nvidia@10.0.0.2", ssh=ssh)
    data = json.loads(out)
    assert code == 1 and data["ok"] is False and len(err.splitlines()) == 1
    head, worker = data["nodes"]
    assert head["config"] == {
        "name": "spark-head",
        "host": "10.0.0.1",
        "user": "nvidia",
        "fabricIp": "192.168.100.1",
        "fabricInterface": "enp1s0f1np1",
        "ibHcas": ["rocep1s0f1"],
        "gidIndex": "auto",
    }
    assert head["gidIndexFound"] == 3 and head["weightsRoot"] == "/srv/dsv41-exl3"
    assert head["createWeightsRoot"] == "sudo install -d -o nvidia -m 0755 /srv/dsv41-exl3"
    assert worker["reached"] is False and worker["error"].startswith("ssh: connect to host 10.0.0.2")
    assert [(u["node"], u["key"]) for u in data["couldNotDecide"]] == [("spark-worker", "node")]
    assert "dsv41-exl3:nodes:" in data["yaml"]


def test_the_first_connection_records_the_key_and_a_changed_key_is_refused_by_the_real_pinning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    known = tmp_path / "known_hosts"
    other = fake_host_key("somewhere-else", 22)
    known.write_text(host_keys.known_hosts_line("10.0.0.2", 22, other))
    ssh = FakeSsh({"10.0.0.1": HEAD, "10.0.0.2": WORKER})
    code = main(["--known-hosts", str(known), "nvidia@10.0.0.1", "nvidia@10.0.0.2"], run=ssh)
    out, err = capsys.readouterr()
    assert code == 1
    (line,) = err.splitlines()
    assert line.startswith(
        "error: node 2 (worker) nvidia@10.0.0.2: host key of node spark-worker (10.0.0.2:22) changed"
    )
    assert f"ssh-keygen -R '10.0.0.2' -f {known}" in line
    assert [argv[-2] for argv in ssh.calls] == ["nvidia@10.0.0.1"]
    assert f"UserKnownHostsFile={known}" in ssh.calls[0]
    assert "host key: node spark-head (10.0.0.1:22): first connection, recorded host key ssh-ed25519" in out
    assert host_keys.lookup(known.read_text(), "10.0.0.1", 22)[0] == [fake_host_key("10.0.0.1", 22)]
    assert f"# pulumi config set --path ssh.knownHostsFile {known}" in out


def test_the_identity_file_becomes_a_private_key_file_never_argv_or_output(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text(KEY)
    ssh = FakeSsh({"10.0.0.1": HEAD})
    code, out, _ = _run(capsys, "--identity", str(key), "nvidia@10.0.0.1", ssh=ssh)
    assert code == 0
    (argv,) = ssh.calls
    key_file = Path(argv[argv.index("-i") + 1])
    assert key_file.read_text() == KEY and key_file != key
    assert KEY_BODY not in " ".join(argv) and KEY_BODY not in out
    assert f"# pulumi config set --secret --path ssh.privateKey < {key}" in out


def test_the_agent_socket_and_the_port_reach_ssh(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSH_AUTH_SOCK", "/run/user/1000/agent.sock")
    ssh, pin = FakeSsh({"10.0.0.1": HEAD}), FakePin()
    code, out, _ = _run(capsys, "nvidia@10.0.0.1:2222", ssh=ssh, pin=pin)
    assert code == 0
    (argv,) = ssh.calls
    assert argv[argv.index("-p") + 1] == "2222" and "IdentityAgent=/run/user/1000/agent.sock" in argv
    assert pin.calls == [([host_keys.NodeAddress(node="spark-head", host="10.0.0.1", port=2222)], None)]
    assert "# node 1 (head): nvidia@10.0.0.1:2222" in out and "      port: 2222" in out
    assert '# pulumi config set --path ssh.agentSocket "/run/user/1000/agent.sock"' in out


@pytest.mark.parametrize(
    "answer, said",
    [
        (subprocess.TimeoutExpired(["ssh"], 90), "no answer within 90 s; check the address, port"),
        (FileNotFoundError(2, "No such file or directory", "ssh"), "cannot run ssh (No such file or directory)"),
        (done(probe_text().replace("==end==\n", "")), "the node's report was cut short (no `==end==`)"),
        (
            done(stderr="sh: 1: exec: sh: not found\n", returncode=127),
            "the probe exited 127: sh: 1: exec: sh: not found",
        ),
    ],
)
def test_every_other_failure_to_reach_a_node_is_one_line(
    capsys: pytest.CaptureFixture[str], answer: subprocess.CompletedProcess[str] | BaseException, said: str
) -> None:
    code, out, err = _run(
        capsys, "nvidia@10.0.0.1", "nvidia@10.0.0.2", ssh=FakeSsh({"10.0.0.1": HEAD, "10.0.0.2": answer})
    )
    assert code == 1
    (line,) = err.splitlines()
    assert line.startswith(f"error: node 2 (worker) nvidia@10.0.0.2: {said}")
    assert "Traceback" not in out + err and "fabric: enp1s0f1np1" in out


@pytest.mark.parametrize(
    "args, said",
    [
        ([], "the following arguments are required: user@host[:port]"),
        (["10.0.0.1"], "'10.0.0.1' has no user: use the form user@host[:port]"),
        (["nvidia@10.0.0.1:0"], "'nvidia@10.0.0.1:0' has a bad port '0': use the form user@host[:port]"),
        (["nvidia@10.0.0.1", "admin@10.0.0.1"], "'admin@10.0.0.1' names the same node as 'nvidia@10.0.0.1'"),
        (["--identity", "/nonexistent/id", "nvidia@10.0.0.1"], "--identity /nonexistent/id: cannot read it"),
        (["--bogus", "nvidia@10.0.0.1"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_exit_2_naming_the_argument_and_reach_no_node(
    capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    ssh, pin = FakeSsh({}), FakePin()
    code, out, err = _run(capsys, *args, ssh=ssh, pin=pin)
    assert (code, out) == (2, "")
    assert err.startswith("error: ") and said in err and len(err.splitlines()) == 1
    assert ssh.calls == [] and pin.calls == []


def test_a_public_key_given_as_identity_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pub = tmp_path / "id_ed25519.pub"
    pub.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB me@laptop\n")
    code, _, err = _run(capsys, "--identity", str(pub), "nvidia@10.0.0.1")
    assert code == 2 and "is not a private key file" in err


def test_a_hostile_nodes_text_is_shown_escaped_one_line_and_never_becomes_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hostile = "unavailable: \x1b[2J\x1b]0;owned\x07gone\nweights:\n  root: /tmp/evil\r"
    worker = probe_text(ip="ip_worker.json", ib="ib_worker.txt", replace={"docker": hostile, "leftovers": hostile})
    code, out, _ = _run(
        capsys, "nvidia@10.0.0.1", "nvidia@10.0.0.2", ssh=FakeSsh({"10.0.0.1": HEAD, "10.0.0.2": done(worker)})
    )
    assert code == 1
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out, "no escape sequence reaches the terminal"
    assert "\\x1b[2J" in out, "what the node said is still shown, escaped"
    assert not [line for line in out.splitlines() if line.startswith("weights:") or line.startswith("  root:")], (
        "a node's newline never starts a line of the config to paste"
    )
