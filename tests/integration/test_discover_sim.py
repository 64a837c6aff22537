"""Discovery against the simulated nodes, as an operator runs it before the first up: each node is reached over
its own sshd (host key pinned on first use), what a loopback node can tell is reported, what it cannot (no RoCE
here) is named with its fix, and an unreachable host is one line while the others are still reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from program_support import REPO

pytestmark = [pytest.mark.sim]


def discover(sim: dict[str, Any], known_hosts: Path, *targets: str, json_out: bool = False) -> Any:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "components",
            "discover",
            *(["--json"] if json_out else []),
            "--identity",
            sim["ssh"]["key"],
            "--known-hosts",
            str(known_hosts),
            *targets,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(300)
def test_discovery_reports_each_sim_node_and_one_line_for_an_unreachable_one(
    sim: dict[str, Any], tmp_path: Path
) -> None:
    user, port = sim["ssh"]["user"], sim["ssh"]["port"]
    nodes = [f"{user}@{n['ip']}:{port}" for n in sim["nodes"][:2]]
    known_hosts = tmp_path / "known_hosts"
    done = discover(sim, known_hosts, *nodes, "root@127.0.0.99:2222", json_out=True)
    assert done.returncode == 1, done.stderr  # no RoCE on a loopback node, and one host down
    report = json.loads(done.stdout)
    head, worker, down = report["nodes"]
    for node in (head, worker):
        assert node["reached"] and node["error"] is None, node
        assert any(f.startswith("docker: server ") and "usable by" in f for f in node["found"]), node["found"]
        assert any(f.startswith("memory: MemAvailable ") for f in node["found"]), node["found"]
        assert any("no RDMA devices" in c["reason"] and "ibHcas: []" in c["fix"] for c in node["couldNotDecide"])
    assert not down["reached"] and "127.0.0.99" in down["error"]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: node 3 (worker) root@127.0.0.99:2222"), errors
    # Host keys were pinned on first use: the next run checks them instead of recording.
    recorded = known_hosts.read_text()
    assert all(f"[{n['ip']}]:{port}" in recorded for n in sim["nodes"][:2])
    again = discover(sim, known_hosts, *nodes)
    assert again.returncode == 1 and "first connection" not in again.stdout, again.stdout
    assert "# paste under `config:`" in again.stdout and "host: " + sim["nodes"][0]["ip"] in again.stdout
    assert Path(sim["ssh"]["key"]).read_text().splitlines()[1] not in again.stdout + again.stderr
