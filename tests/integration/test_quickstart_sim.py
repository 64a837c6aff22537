"""The README's hardware quick start, typed as a user types it, against the simulated nodes as if they were Sparks.

`make stack` with the nodes' addresses (discovery fills in the stack file), the user's edit (what a loopback
node cannot have: RDMA, NFS, the recipe's memory and disk, the public image), `pulumi preview`, `pulumi up`,
`status`, `logs`, and a client request with the generated key. The environment is the README's: `toolchain/env.sh`
with the state home outside the clone, no backend or passphrase of the test harness.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from program_support import REPO

from sim import stack as sim_stack

pytestmark = [pytest.mark.sim, pytest.mark.engine]

NS = "dsv41-exl3"
NOT_DECIDED = "<not decided: see below>"
# A loopback node has no CX-7: the user sets these by hand, as discovery's fix says.
LOOPBACK_CANNOT_HAVE = {"fabricInterface", "fabricIp", "ibHcas", "gidIndex", "gpus", "rdmaDevices"}
HARNESS_ONLY = ("PULUMI_BACKEND_URL", "PULUMI_CONFIG_PASSPHRASE", "PULUMI_CONFIG_PASSPHRASE_FILE", "PULUMI_HOME")


@pytest.fixture
def user_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HARNESS_ONLY and not k.startswith("DSV41_")}
    return {**env, "DSV41_STATE_HOME": str(tmp_path / "state")}


def shell(env: dict[str, str], command: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """One line as the user types it in the clone, after `eval "$(make -s env)"`."""
    return subprocess.run(
        ["bash", "-c", f'eval "$(make -s env)" && {command}'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def request_cleanup() -> Iterator[list[Callable[[], None]]]:
    """Run after the stack's destroy (fixtures end in reverse order): the weights it staged."""
    after: list[Callable[[], None]] = []
    yield after
    for step in after:
        step()


@pytest.fixture
def stack_name(user_env: dict[str, str]) -> Iterator[str]:
    name = f"qs-{uuid.uuid4().hex[:6]}"
    yield name
    shell(user_env, f"pulumi destroy --yes --stack {name} --non-interactive --skip-preview")
    shell(user_env, f"pulumi stack rm --yes --force --stack {name} --non-interactive")
    (REPO / f"Pulumi.{name}.yaml").unlink(missing_ok=True)


def the_users_edit(discovered: dict[str, Any], sim_keys: dict[str, Any]) -> dict[str, Any]:
    """What the user fills in by hand: each placeholder discovery left, and the sections a simulated node needs."""
    nodes = []
    for found, wanted in zip(discovered[f"{NS}:nodes"], sim_keys["nodes"], strict=True):
        left = {k for k, v in found.items() if v == NOT_DECIDED} | LOOPBACK_CANNOT_HAVE
        kept = {k: v for k, v in found.items() if k not in left}  # a key the sim leaves unset goes too
        nodes.append({**kept, **{k: v for k, v in wanted.items() if k in left or k not in found}})
    edited = {**discovered, f"{NS}:nodes": nodes}
    for section in ("weights", "image", "imagePullTimeoutMinutes", "serve", "container", "preflight", "gates"):
        edited[f"{NS}:{section}"] = sim_keys[section]
    edited[f"{NS}:supervisor"] = {"enabled": False}
    edited[f"{NS}:watchdog"] = sim_keys["watchdog"]
    return edited


@pytest.mark.timeout(1500)
def test_the_quick_start_from_make_stack_to_a_client_request(
    sim: dict[str, Any],
    request_cleanup: list[Callable[[], None]],
    user_env: dict[str, str],
    stack_name: str,
    tmp_path: Path,
) -> None:
    key, known_hosts = sim["ssh"]["key"], tmp_path / "known_hosts"
    hosts = " ".join(f"{sim['ssh']['user']}@{n['ip']}:{sim['ssh']['port']}" for n in sim["nodes"][:2])
    made = shell(user_env, f"make -s stack STACK={stack_name} HOSTS='{hosts}' IDENTITY={key} KNOWN_HOSTS={known_hosts}")
    assert made.returncode == 0, made.stdout + made.stderr
    assert f"wrote Pulumi.{stack_name}.yaml from discovery of 2 node(s)" in made.stdout, made.stdout
    assert "ssh.privateKey set from" in made.stdout and Path(key).read_text().splitlines()[1] not in made.stdout

    path = REPO / f"Pulumi.{stack_name}.yaml"
    data = yaml.safe_load(path.read_text())
    discovered = data["config"]
    for found, n in zip(discovered[f"{NS}:nodes"], sim["nodes"], strict=False):
        assert (found["host"], found["port"], found["user"]) == (n["ip"], sim["ssh"]["port"], sim["ssh"]["user"])
        assert found["fabricIp"] == NOT_DECIDED, found  # a placeholder the first preview would refuse
    assert "could not decide fabricInterface, fabricIp, ibHcas, gidIndex: no RDMA devices" in made.stderr
    assert discovered[f"{NS}:ssh"]["knownHostsFile"] == str(known_hosts)
    assert "secure" in discovered[f"{NS}:ssh"]["privateKey"], "make stack stores the key encrypted"

    weights = Path(tempfile.mkdtemp(prefix="dsv41-quickstart-weights-", dir="/var/tmp"))
    request_cleanup.append(lambda: shutil.rmtree(weights, ignore_errors=True))
    sim_keys = sim_stack.sim_config(sim, weights_root=str(weights), port=18896, master_port=29641)
    data["config"] = the_users_edit(discovered, sim_keys)
    path.write_text(yaml.safe_dump(data, sort_keys=False))

    preview = shell(user_env, f"pulumi preview --stack {stack_name} --non-interactive")
    assert preview.returncode == 0, preview.stdout[-3000:] + preview.stderr[-3000:]
    up = shell(user_env, f"pulumi up --yes --skip-preview --stack {stack_name} --non-interactive", timeout=1200)
    assert up.returncode == 0, up.stdout[-5000:] + up.stderr[-3000:]

    status = shell(user_env, "dsv41-exl3 status --json --interval 1")  # the stack `make stack` selected
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["healthy"] is True
    logs = shell(user_env, "dsv41-exl3 logs worker --tail 20")
    assert logs.returncode == 0 and logs.stdout.strip(), logs.stderr

    endpoint = shell(user_env, f"pulumi stack output --stack {stack_name} endpoint").stdout.strip()
    api_key = shell(user_env, f"pulumi stack output --stack {stack_name} --show-secrets apiKey").stdout.strip()
    assert endpoint == f"http://{sim['nodes'][0]['ip']}:18896/v1" and len(api_key) >= 32
    request = {"model": sim_keys["serve"].get("servedModelName", "DeepSeek-v4.1-Flash-EXL3"), "max_tokens": 8}
    request["messages"] = [{"role": "user", "content": "What is the capital of France?"}]
    refused = requests.post(f"{endpoint}/chat/completions", json=request, timeout=60)
    assert refused.status_code == 401, "the endpoint is never open by default"
    answered = requests.post(
        f"{endpoint}/chat/completions", json=request, headers={"Authorization": f"Bearer {api_key}"}, timeout=120
    )
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["message"]["content"], answered.text
