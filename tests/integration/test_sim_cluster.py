"""The simulated cluster (sim/): hub stand-in with the real huggingface_hub client, and, with the sim up, each
node's sshd -> its own dockerd, image pulls from the loopback registry, host-network containers per node, and
the program's own staging command against the hub.

The hub and pure-logic tests run everywhere (in-process server on 127.0.0.1, port 0). Tests marked `sim` need
the daemons: they skip unless DSV41_REQUIRE_SIM=1, which brings the sim up (`python -m sim.cluster up`,
idempotent) and turns any failure to do so into a test failure. Needs root (dockerd, sshd, apt).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sim_support import STAGING_PREFIX, STEP_TIMEOUT, on_node, sim_ready_or_skip, stage_on_head

from components.weights import manifest as wm
from sim import checkpoint, cluster, hub

REPO = Path(__file__).resolve().parents[2]
MODEL_REPO, BASE_REPO = checkpoint.MODEL_REPO, checkpoint.BASE_REPO
# Every URL here is a loopback address: never through a proxy.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# --- the hub stand-in, in process ------------------------------------------------------------------


@pytest.fixture
def local_hub(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(url, faults file) of a hub stand-in on an ephemeral loopback port."""
    faults = tmp_path / "missing"
    server = hub.serve("127.0.0.1", 0, hub.Hub(repos=checkpoint.build(), faults_file=faults))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", faults
    server.shutdown()
    server.server_close()


def client_env(url: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k != "HF_TOKEN"}
    env.update(
        {
            "HF_ENDPOINT": url,
            "HF_HOME": str(home),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "NO_PROXY": "*",
            "HF_HUB_ETAG_TIMEOUT": "5",
            "HF_HUB_DOWNLOAD_TIMEOUT": "10",
        }
    )
    return env


def run_client(url: str, tmp_path: Path, code: str) -> Any:
    """Run `code` with the real huggingface_hub client (fresh process, so HF_ENDPOINT applies); JSON result."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=client_env(url, tmp_path / "hf-home"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_checkpoint_has_the_names_and_counts_staging_expects() -> None:
    repos = checkpoint.build()
    model, base = repos[MODEL_REPO], repos[BASE_REPO]
    assert sorted(n for n in model if n.endswith(".safetensors")) == [
        f"model-{i:05d}-of-00039.safetensors" for i in range(1, 40)
    ]
    assert sorted(n for n in base if n.endswith(".safetensors")) == [wm.engram_shard_name(i) for i in range(1, 49)]
    index = json.loads(base[wm.ENGRAM_INDEX])
    assert set(index["weight_map"].values()) == {wm.engram_shard_name(i) for i in range(1, 49)}
    assert {"config.json", wm.ENGRAM_INDEX, "tokenizer.json"} <= set(model)
    assert all(1024 <= len(d) <= 8192 for n, d in base.items() if n.endswith(".safetensors"))
    assert checkpoint.build() == repos, "the checkpoint must be the same on every build"
    # Each shard is a parseable safetensors file: u64 header length, then a JSON header.
    shard = base["model-00001-of-00048.safetensors"]
    header = json.loads(shard[8 : 8 + int.from_bytes(shard[:8], "little")])
    assert header["model.layers.0.weight"]["data_offsets"][1] == len(shard) - 8 - int.from_bytes(shard[:8], "little")
    # As in the real repo, shards 47 and 48 also hold the Engram embed tables, which the index maps there: what
    # staging's slim Engram directory lists (and the stand-in loads).
    for i in wm.ENGRAM_SHARDS:
        shard = base[wm.engram_shard_name(i)]
        names = set(json.loads(shard[8 : 8 + int.from_bytes(shard[:8], "little")])) - {"__metadata__"}
        tables = checkpoint.engram_tensors(i)
        assert len(tables) == 2 and all(t.endswith(wm.ENGRAM_EMBED_SUFFIXES) for t in tables)
        assert names == {f"model.layers.{i - 1}.weight", *tables}
        assert {t: index["weight_map"][t] for t in tables} == dict.fromkeys(tables, wm.engram_shard_name(i))


def test_the_model_repo_is_a_real_tiny_llama_one_tensor_per_shard() -> None:
    # Real vLLM serves it: every Llama parameter once, F32, with the shape config.json implies, and the index
    # naming the shard that holds it.
    model = checkpoint.build()[MODEL_REPO]
    config = json.loads(model["config.json"])
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] >= 32  # vLLM CPU's minimum
    index = json.loads(model[wm.ENGRAM_INDEX])["weight_map"]
    expected = dict(checkpoint.tiny_tensors())
    assert set(index) == set(expected) and len(set(index.values())) == 39
    for tensor, name in index.items():
        shard = model[name]
        size = int.from_bytes(shard[:8], "little")
        header = json.loads(shard[8 : 8 + size])
        entry = header[tensor]
        count = 1
        for d in entry["shape"]:
            count *= d
        assert entry["dtype"] == "F32" and entry["shape"] == expected[tensor]
        assert entry["data_offsets"] == [0, 4 * count] and len(shard) == 8 + size + 4 * count
    assert expected["model.embed_tokens.weight"] == [config["vocab_size"], config["hidden_size"]]
    tokenizer = json.loads(model["tokenizer.json"])
    assert len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"]) == config["vocab_size"]
    assert "chat_template" in json.loads(model["tokenizer_config.json"])


def test_hub_listing_and_download_with_the_real_client(local_hub: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = local_hub
    got = run_client(
        url,
        tmp_path,
        f"""
import json
from huggingface_hub import HfApi, hf_hub_download
api = HfApi()
tree = {{f.path: f.size for f in api.list_repo_tree({BASE_REPO!r}, recursive=True)}}
path = hf_hub_download({MODEL_REPO!r}, "model-00007-of-00039.safetensors", local_dir={str(tmp_path / "d")!r})
info = api.model_info({MODEL_REPO!r})
print(json.dumps({{"tree": tree, "path": path, "sha": info.sha}}))
""",
    )
    base = checkpoint.build()[BASE_REPO]
    assert got["tree"] == {n: len(d) for n, d in base.items()}
    assert Path(got["path"]).read_bytes() == checkpoint.build()[MODEL_REPO]["model-00007-of-00039.safetensors"]
    assert got["sha"] == checkpoint.repo_commit(checkpoint.build()[MODEL_REPO])


def test_hub_lists_lfs_sha256_and_blob_ids_the_real_client_reads(local_hub: tuple[str, Path], tmp_path: Path) -> None:
    """The content ids staging verifies against, served in the real API's shape (tree: `lfs.oid`; model info
    with files_metadata: `lfs.sha256`, `blobId`) and read through the real client's own objects."""
    url, _ = local_hub
    got = run_client(
        url,
        tmp_path,
        f"""
import json
from huggingface_hub import HfApi
api = HfApi()
tree = {{f.path: [f.size, f.blob_id, f.lfs.sha256 if f.lfs else None]
         for f in api.list_repo_tree({MODEL_REPO!r}, recursive=True, expand=True)}}
info = api.model_info({MODEL_REPO!r}, files_metadata=True)
sib = {{s.rfilename: [s.size, s.blob_id, s.lfs.sha256 if s.lfs else None] for s in info.siblings}}
print(json.dumps({{"tree": tree, "siblings": sib}}))
""",
    )
    files = checkpoint.build()[MODEL_REPO]
    for name, data in files.items():
        if name.endswith(".safetensors"):
            expected = [len(data), checkpoint.blob_oid(checkpoint.lfs_pointer(data)), hashlib.sha256(data).hexdigest()]
        else:
            expected = [len(data), checkpoint.blob_oid(data), None]
        assert got["tree"][name] == expected == got["siblings"][name], name


def test_staging_script_verifies_every_file_against_the_hub_stand_in(
    local_hub: tuple[str, Path], tmp_path: Path
) -> None:
    """The program's staging script with the real client against the stand-in the simulated cluster uses."""
    url, _ = local_hub
    plan = wm.staging_plan(model_repo=MODEL_REPO, engram_repo=BASE_REPO, revision="main")
    root = tmp_path / "root"
    script = tmp_path / "stage_weights.pyz"  # as stage.sh writes it on the head
    script.write_bytes(base64.b64decode(wm.stage_program_text()))
    proc = subprocess.run(
        [sys.executable, str(script), "--plan", json.dumps(plan), "--dest-root", str(root), "--host-root", str(root)],
        env=client_env(url, tmp_path / "hf-home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged = wm.parse_stage_output(proc.stdout)
    record = json.loads((root / "dsv41-weights-manifest.json").read_text())["files"]
    # The slim Engram directory's files are derived from staged ones (hardlinks, its own index): no record.
    fetched = [r for r in staged.files if not r.startswith(f"{wm.ENGRAM_VLLM_DIR}/")]
    assert set(record) == set(fetched) and len(staged.files) == len(fetched) + 4
    shards = [r for r in fetched if r.endswith(".safetensors")]
    assert len(shards) == 41 and all(record[r]["verified_by"] == "lfs-sha256" for r in shards)
    assert all(record[r]["verified_by"] == "git-blob-id" for r in fetched if r not in shards)
    assert record["model/config.json"]["revision"] == checkpoint.repo_commit(checkpoint.build()[MODEL_REPO])


def test_hub_fault_file_hides_a_file_and_listed_fault_404s(local_hub: tuple[str, Path], tmp_path: Path) -> None:
    url, faults = local_hub
    shard47, shard3 = wm.engram_shard_name(47), "model-00003-of-00039.safetensors"
    faults.write_text(f"{BASE_REPO}/{shard47}\nlisted:{MODEL_REPO}/{shard3}\n")
    got = run_client(
        url,
        tmp_path,
        f"""
import json
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
api = HfApi()
out = {{"base": [f.path for f in api.list_repo_tree({BASE_REPO!r}, recursive=True)],
        "model": [f.path for f in api.list_repo_tree({MODEL_REPO!r}, recursive=True)]}}
for repo, name in (({BASE_REPO!r}, {shard47!r}), ({MODEL_REPO!r}, {shard3!r})):
    try:
        hf_hub_download(repo, name, local_dir={str(tmp_path / "d")!r})
        out[name] = "downloaded"
    except EntryNotFoundError:
        out[name] = "EntryNotFound"
print(json.dumps(out))
""",
    )
    assert shard47 not in got["base"] and shard3 in got["model"]
    assert got[shard47] == got[shard3] == "EntryNotFound"
    faults.write_text("")  # re-read on every request: the fault is gone at once
    with OPENER.open(f"{url}/{BASE_REPO}/resolve/main/{shard47}", timeout=5) as resp:
        assert resp.status == 200 and resp.headers["X-Repo-Commit"] == checkpoint.repo_commit(
            checkpoint.build()[BASE_REPO]
        )


def test_hub_resolve_headers_range_and_errors(local_hub: tuple[str, Path]) -> None:
    url, _ = local_hub
    data = checkpoint.build()[MODEL_REPO]["config.json"]
    with OPENER.open(
        urllib.request.Request(f"{url}/{MODEL_REPO}/resolve/main/config.json", method="HEAD"), timeout=5
    ) as resp:
        assert resp.headers["Content-Length"] == str(len(data))
        assert resp.headers["ETag"] == f'"{checkpoint.blob_oid(data)}"'
        assert len(resp.headers["X-Repo-Commit"]) == 40
    req = urllib.request.Request(f"{url}/{MODEL_REPO}/resolve/main/config.json", headers={"Range": "bytes=10-"})
    with OPENER.open(req, timeout=5) as resp:
        assert resp.status == 206 and resp.read() == data[10:]
        assert resp.headers["Content-Range"] == f"bytes 10-{len(data) - 1}/{len(data)}"
    for path, code in (
        (f"/{MODEL_REPO}/resolve/main/nope.bin", "EntryNotFound"),
        (f"/{MODEL_REPO}/resolve/v9/config.json", "RevisionNotFound"),
        ("/org/none/resolve/main/config.json", "RepoNotFound"),
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            OPENER.open(f"{url}{path}", timeout=5)
        assert err.value.code == 404 and err.value.headers["X-Error-Code"] == code, path


def test_hub_env_switch_hides_a_file(tmp_path: Path) -> None:
    shard = wm.engram_shard_name(48)
    served = hub.Hub(repos=checkpoint.build(), env_missing=(f"{BASE_REPO}/{shard}",), faults_file=tmp_path / "none")
    assert shard not in served.visible(BASE_REPO) and served.resolvable(BASE_REPO, shard) is None
    assert served.resolvable(BASE_REPO, wm.engram_shard_name(47)) is not None


def test_hub_refuses_a_non_loopback_address() -> None:
    with pytest.raises(ValueError, match="not a loopback address"):
        hub.serve("0.0.0.0", 0, hub.Hub(repos={}))


def test_sshd_config_points_sessions_at_the_nodes_own_daemon(tmp_path: Path) -> None:
    layout = cluster.Layout(state=tmp_path)
    text = cluster.sshd_config(layout, 3)
    assert f"ListenAddress 127.0.0.4:{cluster.SSH_PORT}\n" in text
    assert (
        f"SetEnv DOCKER_HOST=unix://{tmp_path}/node-3/docker.sock {cluster.NODE_TAG}={tmp_path}/node-3 "
        f"DSV41_MOUNTSTATS={tmp_path}/node-3/mountstats\n"
    ) in text, "each node's NFS client counters are a file of its own (the nodes share one kernel)"
    for line in (
        "PasswordAuthentication no",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "Subsystem sftp internal-sftp",
        "MaxStartups 100:30:200",
        f"AuthorizedKeysFile {tmp_path}/ssh/",
    ):
        assert line in text


def test_a_nodes_own_name_is_127_0_1_1_on_it_and_its_address_on_this_machine() -> None:
    # Ubuntu's /etc/hosts: a machine's own name on 127.0.1.1; the operator's side resolves it to the node
    own = cluster.node_hosts(2)
    assert f"127.0.1.1 {socket.gethostname()} dsv41-sim-node-2\n" in own
    assert "127.0.0.2 dsv41-sim-node-1\n" in own and "127.0.0.3 dsv41-sim-node-2\n" not in own
    machine = "127.0.0.1 localhost\n127.0.0.1 vm"
    with_nodes = cluster.machine_hosts(machine, True)
    assert with_nodes.startswith("127.0.0.1 localhost\n127.0.0.1 vm\n" + cluster.HOSTS_BEGIN + "\n")
    assert "127.0.0.3 dsv41-sim-node-2\n" in with_nodes and with_nodes.endswith(cluster.HOSTS_END + "\n")
    assert cluster.machine_hosts(with_nodes + "10.0.0.9 other\n", True).count(cluster.HOSTS_BEGIN) == 1
    assert cluster.machine_hosts(with_nodes + "10.0.0.9 other\n", False) == machine + "\n10.0.0.9 other\n"


def test_a_node_is_named_by_index_or_node_dash_index(tmp_path: Path) -> None:
    assert cluster.node_index("13") == cluster.node_index("node-13") == 13
    for bad in ("0", "node-", "n-3", "201", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            cluster.node_index(bad)
    a, b = cluster.Layout(state=tmp_path / "a"), cluster.Layout(state=tmp_path / "b")
    assert a.cgroup_name(3) != b.cgroup_name(3) != b.cgroup_name(4), "one cgroup per state dir and node"


def test_liveness_needs_the_named_process_not_just_a_pid(tmp_path: Path) -> None:
    pidfile = tmp_path / "x.pid"
    pidfile.write_text(f"{os.getpid()}\n")
    assert cluster.running_pid(pidfile, "python") == os.getpid()
    assert cluster.running_pid(pidfile, "dockerd") is None, "a recycled pid of another program is not the daemon"
    proc = subprocess.Popen(["sleep", "0"])
    proc.wait()
    pidfile.write_text(f"{proc.pid}\n")
    assert cluster.running_pid(pidfile, "sleep") is None
    assert cluster.stop_pid(pidfile, "sleep") is False and not pidfile.exists()


def test_stopping_a_node_daemon_with_its_sessions_ends_what_it_forked(tmp_path: Path) -> None:
    """An sshd's sessions (multiplexed masters' remote ends) must go down with the node: otherwise a
    client's ControlMaster keeps reaching the old node's docker socket."""
    parent = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(cluster.descendants(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        children = cluster.descendants(parent.pid)
        assert len(children) == 2
        pidfile = tmp_path / "sh.pid"
        pidfile.write_text(f"{parent.pid}\n")
        assert cluster.stop_pid(pidfile, "sh", 5, with_sessions=True)
        parent.wait(timeout=5)
        deadline = time.monotonic() + 5
        while any(cluster.pid_alive(c, "sleep") for c in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(cluster.pid_alive(c, "sleep") for c in children), "a session outlived its daemon"
    finally:
        parent.kill()


# --- the running sim -------------------------------------------------------------------------------


def docker_over_ssh(sim: dict[str, Any], ip: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The docker CLI with `-H ssh://` (what pulumi_docker's provider does), through the sim's ssh config."""
    env = {**os.environ, "PATH": f"{sim['ssh']['bin']}:{os.environ['PATH']}"}
    env.pop("DOCKER_HOST", None)
    return subprocess.run(
        ["docker", "-H", f"ssh://root@{ip}:{sim['ssh']['port']}", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )


def ips(sim: dict[str, Any]) -> list[str]:
    return [n["ip"] for n in sim["nodes"]]


@pytest.mark.sim
@pytest.mark.timeout(300)
def test_each_sshd_reaches_its_own_dockerd(sim: dict[str, Any]) -> None:
    roots = []
    for node in sim["nodes"]:
        proc = on_node(sim, node["ip"], "docker info --format '{{json .}}'")
        assert proc.returncode == 0, f"node {node['ip']}: {proc.stderr[-1000:]}"
        info = json.loads(proc.stdout)
        # Outside the work tree, kept across clones: a node keeps the images it pulled (cluster_layout.data_root).
        assert info["DockerRootDir"] == str(cluster.Layout.data_root(node["index"]))
        assert f"dsv41.sim.node=node-{node['index']}" in info["Labels"]
        assert "127.0.0.0/8" in info["RegistryConfig"]["InsecureRegistryCIDRs"]
        roots.append(info["DockerRootDir"])
    assert len(set(roots)) == len(roots) >= 2


@pytest.mark.sim
@pytest.mark.timeout(300)
def test_sshd_takes_many_parallel_connections_and_sftp(sim: dict[str, Any], tmp_path: Path) -> None:
    """docker over ssh opens one connection per API call: 24 at once must all get in (MaxStartups)."""
    ip = ips(sim)[0]
    with ThreadPoolExecutor(max_workers=24) as pool:
        codes = list(pool.map(lambda _: on_node(sim, ip, "true", timeout=60).returncode, range(24)))
    assert codes == [0] * 24
    src = tmp_path / "payload"
    src.write_text("over sftp\n")
    dest = f"/tmp/dsv41-sim-sftp-{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        ["sftp", "-F", sim["ssh"]["config"], "-b", "-", f"root@{ip}"],
        input=f"put {src} {dest}\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert proc.returncode == 0, proc.stderr
        assert Path(dest).read_text() == "over sftp\n", "a node's filesystem is the host's"
    finally:
        Path(dest).unlink(missing_ok=True)


@pytest.mark.sim
@pytest.mark.timeout(600)
def test_image_pulls_from_the_registry_on_every_node(sim: dict[str, Any]) -> None:
    image = sim["image"]
    registry = sim["registry"]
    name, tag = image[len(registry) + 1 :].rsplit(":", 1)
    req = urllib.request.Request(
        f"http://{registry}/v2/{name}/manifests/{tag}",
        method="HEAD",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    with OPENER.open(req, timeout=10) as resp:
        digest = resp.headers["Docker-Content-Digest"]
    for ip in ips(sim):
        proc = on_node(
            sim,
            ip,
            f"docker image rm {image} >/dev/null 2>&1 || true; docker pull -q {image} && "
            f"docker image inspect --format '{{{{json .RepoDigests}}}}' {image}",
            timeout=300,
        )
        assert proc.returncode == 0, f"{ip}: {proc.stderr[-1000:]}"
        assert f"{registry}/{name}@{digest}" in json.loads(proc.stdout.strip().splitlines()[-1]), ip
        run = on_node(
            sim,
            ip,
            f"docker run --rm --network host --entrypoint python3 {image} -c "
            "'import huggingface_hub, http.server; print(huggingface_hub.__version__)'",
        )
        assert run.returncode == 0 and run.stdout.strip() == "2.4.0", run.stderr[-1000:]
        which = on_node(
            sim, ip, f"docker run --rm --network none --entrypoint sh {image} -c 'command -v vllm; command -v ps'"
        )
        assert which.stdout.split() == ["/usr/local/bin/vllm", "/usr/bin/ps"], which.stderr
    inspect = on_node(sim, ips(sim)[0], f"docker image inspect --format '{{{{json .Config.Entrypoint}}}}' {image}")
    assert json.loads(inspect.stdout) == ["vllm"]


@pytest.mark.sim
@pytest.mark.timeout(300)
def test_host_network_container_on_node_2_is_invisible_on_node_1(sim: dict[str, Any], test_label: str) -> None:
    node1, node2 = ips(sim)[:2]
    port = 18000 + uuid.uuid4().int % 2000
    name = f"dsv41-sim-test-{uuid.uuid4().hex[:8]}"
    proc = on_node(
        sim,
        node2,
        f"docker run -d --name {name} --label {test_label} --network host "
        f"--entrypoint python3 {sim['image']} -m http.server --bind {node2} {port}",
    )
    assert proc.returncode == 0, proc.stderr[-1000:]
    deadline = time.monotonic() + 30
    body = b""
    while time.monotonic() < deadline and not body:
        try:
            with OPENER.open(f"http://{node2}:{port}/", timeout=2) as resp:
                body = resp.read()
        except OSError:
            time.sleep(0.3)
    assert b"Directory listing" in body, f"the container on node 2 must serve on {node2}:{port} (host network)"
    on2 = docker_over_ssh(sim, node2, "ps", "--filter", f"label={test_label}", "--format", "{{.Names}}")
    on1 = docker_over_ssh(sim, node1, "ps", "-a", "--filter", f"label={test_label}", "--format", "{{.Names}}")
    assert on2.returncode == 0 and on1.returncode == 0, on2.stderr + on1.stderr
    assert on2.stdout.split() == [name]
    assert on1.stdout.split() == [], "node 1's daemon must not see node 2's containers"
    rm = docker_over_ssh(sim, node2, "rm", "-f", name)
    assert rm.returncode == 0, rm.stderr


@pytest.fixture
def stage_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-sim-stage-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.sim
@pytest.mark.timeout(300)
def test_hub_checkpoint_stages_fully_on_the_head(sim: dict[str, Any], stage_root: Path) -> None:
    proc = stage_on_head(sim, stage_root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged = wm.parse_stage_output(proc.stdout)
    assert staged.root == str(stage_root)
    repos = checkpoint.build()
    expected = {f"model/{n}": len(d) for n, d in repos[MODEL_REPO].items()}
    expected.update(
        {
            f"engram-src/{n}": len(repos[BASE_REPO][n])
            for n in (wm.engram_shard_name(47), wm.engram_shard_name(48), wm.ENGRAM_INDEX, "config.json")
        }
    )
    # The slim Engram directory, built by the image's python3: hardlinks of the shards and config, its own index.
    linked = (wm.engram_shard_name(47), wm.engram_shard_name(48), "config.json")
    slim = stage_root / wm.ENGRAM_VLLM_DIR
    expected.update({f"{wm.ENGRAM_VLLM_DIR}/{n}": len(repos[BASE_REPO][n]) for n in linked})
    expected[f"{wm.ENGRAM_VLLM_DIR}/{wm.ENGRAM_INDEX}"] = (slim / wm.ENGRAM_INDEX).stat().st_size
    assert staged.files == expected
    assert len(list((stage_root / "model").glob("*.safetensors"))) == 39
    for rel, size in staged.files.items():
        assert (stage_root / rel).stat().st_size == size, rel
    assert (stage_root / "model" / "model-00039-of-00039.safetensors").read_bytes() == repos[MODEL_REPO][
        "model-00039-of-00039.safetensors"
    ]
    for n in linked:
        assert (slim / n).stat().st_ino == (stage_root / wm.ENGRAM_DIR / n).stat().st_ino, f"{n} is a hardlink"
    tables = {t: wm.engram_shard_name(s) for s in checkpoint.ENGRAM_TABLES for t in checkpoint.engram_tensors(s)}
    assert json.loads((slim / wm.ENGRAM_INDEX).read_text())["weight_map"] == tables


@pytest.mark.sim
@pytest.mark.timeout(300)
def test_the_hf_token_never_shows_in_the_staging_containers_docker_inspect(
    sim: dict[str, Any], stage_root: Path
) -> None:
    """Issue 22 item 1: the token reaches the staging program on stdin, so the container's Config.Env (what
    `docker inspect` shows to anyone with the docker socket, for the whole staging run) never holds it."""
    token = f"hf_SimStagingToken{uuid.uuid4().hex}"
    container = wm.stage_container(STAGING_PREFIX)
    docker_host = cluster.default_layout().docker_host(sim["nodes"][0]["index"])
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            done = subprocess.run(
                ["docker", "-H", docker_host, "inspect", container],
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT,
            )
            if done.returncode == 0:
                seen.append(done.stdout)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc = stage_on_head(sim, stage_root, token=token)
    finally:
        stop.set()
        watcher.join(timeout=STEP_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert seen, f"the staging container {container} was never seen while staging ran"
    for inspected in seen:
        env = json.loads(inspected)[0]["Config"]["Env"] or []
        assert not [e for e in env if e.startswith("HF_TOKEN=")], f"HF_TOKEN in Config.Env: {env}"
        assert token not in inspected, "the token shows in `docker inspect` of the staging container"
    assert token not in proc.stdout + proc.stderr


@pytest.mark.sim
@pytest.mark.timeout(300)
def test_missing_engram_shard_on_the_hub_fails_staging(sim: dict[str, Any], stage_root: Path) -> None:
    faults = Path(sim["hub_faults"])
    shard = wm.engram_shard_name(47)
    faults.write_text(f"{BASE_REPO}/{shard}\n")
    try:
        proc = stage_on_head(sim, stage_root)
    finally:
        faults.unlink(missing_ok=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("stage_weights: error:")]
    assert errors and BASE_REPO in errors[-1] and shard in errors[-1], proc.stderr[-2000:]
    assert not (stage_root / "engram-src" / shard).exists()


@pytest.mark.sim
@pytest.mark.timeout(300)
def test_second_sim_up_starts_nothing(sim: dict[str, Any]) -> None:
    layout = cluster.default_layout()
    pidfiles = [layout.registry_dir / "registry.pid", layout.hub_dir / "hub.pid"]
    for node in sim["nodes"]:
        pidfiles += [layout.node_dir(node["index"]) / "dockerd.pid", layout.node_dir(node["index"]) / "sshd.pid"]
    before = {p: p.read_text() for p in pidfiles}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sim.cluster", "up"], cwd=REPO, capture_output=True, text=True, timeout=STEP_TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "starting" not in proc.stderr and "pushed" not in proc.stderr, proc.stderr
    assert {p: p.read_text() for p in pidfiles} == before
    assert time.monotonic() - started < 30


def test_a_real_image_that_cannot_fit_fails_at_once_naming_the_shortfall(tmp_path: Path) -> None:
    # `make demo` / `make sim-up` build the real-vLLM image first: a disk without room for it fails before any
    # download, naming how much is free and how much is needed, and touches no daemon (docker is never called).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "df").write_text(
        "#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted'\n"
        "echo '/dev/x 100000000 99000000 3145728 99% /'\n"
    )
    (bin_dir / "docker").write_text("#!/bin/sh\necho docker was called >&2\nexit 99\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SIM_DOCKER_HOST": "unix:///nonexistent",
        "SIM_FLAVOR": "real",
        "SIM_STAMP_DIR": str(tmp_path / "stamps"),
        "DSV41_CACHE": str(tmp_path / "cache"),
        "SIM_REGISTRY": "127.0.0.1:9",
    }
    proc = subprocess.run(
        ["bash", str(Path(__file__).resolve().parents[2] / "sim" / "image" / "build.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "needs 16 GiB free" in proc.stderr and "3 GiB free" in proc.stderr, proc.stderr
    assert "docker was called" not in proc.stderr
    assert not list((tmp_path / "cache").rglob("*.tar"))


# --- a simulated reboot, on a node of its own --------------------------------------------------------------

# Outside the default nodes (1, 2) and the bench's (5..12): the test starts it, power-cuts it and stops it.
REBOOT_NODE = int(os.environ.get("DSV41_SIM_REBOOT_NODE") or 13)


@pytest.fixture
def reboot_node() -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, sim-like description) of a node this test starts alone and stops afterwards; never one that
    already runs (it would be someone else's to power-cut)."""
    if os.environ.get("DSV41_REQUIRE_SIM") != "1":
        pytest.skip("simulated cluster tests need root and start daemons; set DSV41_REQUIRE_SIM=1 to run them")
    layout = cluster.default_layout()
    states = cluster.status(layout)
    if states.get(f"node-{REBOOT_NODE}/dockerd") or states.get(f"node-{REBOOT_NODE}/sshd"):
        pytest.fail(f"node {REBOOT_NODE} already runs; set DSV41_SIM_REBOOT_NODE to an index no one uses")
    if cluster.registry_digest() is None:  # no image to run yet: bring the whole sim up (builds and pushes it)
        sim_ready_or_skip()
    started = subprocess.run(
        [sys.executable, "-m", "sim.cluster", "up", "--node", str(REBOOT_NODE)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        yield REBOOT_NODE, {"ssh": {"config": str(layout.ssh_config)}, "image": cluster.image_ref()}
    finally:
        subprocess.run(
            [sys.executable, "-m", "sim.cluster", "down", "--node", str(REBOOT_NODE)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT,
        )


def inspect_state(node: dict[str, Any], ip: str, name: str) -> dict[str, Any]:
    proc = on_node(node, ip, f"docker inspect --format '{{{{json .State}}}}' {name}")
    assert proc.returncode == 0, proc.stderr[-1000:]
    state: dict[str, Any] = json.loads(proc.stdout)
    return state


def process_start(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


@pytest.mark.sim
@pytest.mark.timeout(300)
def test_reboot_is_a_power_cut_then_docker_restart_policies(reboot_node: tuple[int, dict[str, Any]]) -> None:
    """Issue 21 item 7: `reboot` kills everything the node holds (containers, sshd, what its sessions started
    with nohup or setsid, dockerd/containerd) and boots it: `unless-stopped` runs again, `no` stays exited."""
    index, node = reboot_node
    ip = cluster.Layout.node_ip(index)
    image = node["image"]
    pull = on_node(node, ip, f"docker pull -q {image}", timeout=300)
    assert pull.returncode == 0, pull.stderr[-1000:]
    for name, policy in (("dsv41-reboot-unless", "unless-stopped"), ("dsv41-reboot-no", "no")):
        run = on_node(
            node, ip, f"docker run -d --name {name} --restart {policy} --network host --entrypoint sleep {image} 1000"
        )
        assert run.returncode == 0, run.stderr[-1000:]
    before = inspect_state(node, ip, "dsv41-reboot-unless")
    # What a watchdog installed over ssh looks like: nohup'd, re-parented to init once the session ends; and one
    # that also left its session and its environment behind (only the node's cgroup still holds it).
    spawned = on_node(
        node,
        ip,
        "nohup sleep 1000 >/dev/null 2>&1 & echo $!; setsid env -i sleep 1000 </dev/null >/dev/null 2>&1 & echo $!",
    )
    assert spawned.returncode == 0, spawned.stderr
    nohup_pid, setsid_pid = map(int, spawned.stdout.split())
    starts = {pid: process_start(pid) for pid in (nohup_pid, setsid_pid)}
    assert None not in starts.values(), "the sleeps started over ssh must run before the reboot"

    proc = subprocess.run(
        [sys.executable, "-m", "sim.cluster", "reboot", f"node-{index}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"node {index} rebooted in" in proc.stdout and "2 running container(s)" in proc.stdout, proc.stdout

    # Back at once: reboot returns only when docker answers and sshd greets.
    assert on_node(node, ip, "true", timeout=30).returncode == 0
    assert process_start(nohup_pid) != starts[nohup_pid], "the nohup'd sleep outlived the power cut"
    if cluster.cgroup2_root() is not None:
        assert process_start(setsid_pid) != starts[setsid_pid], "the setsid'd env -i sleep outlived the power cut"
    deadline = time.monotonic() + 30
    after = inspect_state(node, ip, "dsv41-reboot-unless")
    while not after["Running"] and time.monotonic() < deadline:
        time.sleep(0.5)
        after = inspect_state(node, ip, "dsv41-reboot-unless")
    assert after["Running"], f"restart: unless-stopped must run again after the boot: {after}"
    assert after["Pid"] != before["Pid"] and after["StartedAt"] != before["StartedAt"], "it was never killed"
    stopped = inspect_state(node, ip, "dsv41-reboot-no")
    assert stopped["Status"] == "exited" and stopped["ExitCode"] in (137, 255), stopped
    ps = on_node(node, ip, "docker ps --format '{{.Names}}'")
    assert ps.returncode == 0 and ps.stdout.split() == ["dsv41-reboot-unless"], ps.stdout + ps.stderr

    # The node's data root is cached across clones: a run that ended with a power cut (a killed CI) leaves its
    # containers, which come back with the daemon; the next `up` starts a fresh node that keeps only the images.
    assert on_node(node, ip, "docker volume create dsv41-reboot-left >/dev/null").returncode == 0
    cluster.power_cut(cluster.default_layout(), index)
    again = subprocess.run(
        [sys.executable, "-m", "sim.cluster", "up", "--node", str(index)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    left = on_node(node, ip, "docker ps -aq | wc -l; docker volume ls -q | wc -l; docker image inspect -f ok " + image)
    assert left.returncode == 0 and left.stdout.split() == ["0", "0", "ok"], (
        "after `up`: no container, no volume, the pulled image kept: " + left.stdout + left.stderr
    )


def test_the_sim_daemons_get_no_runtime_directory_of_their_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    # A test session's XDG_RUNTIME_DIR (tests/conftest.py) inherited by a rebooted dockerd broke every later
    # `docker exec` once that session's directory was gone (runc keeps its exec files there).
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/tmp/gone-with-the-caller")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    env = cluster.daemon_env()
    assert not [k for k in env if k.startswith("XDG_") or "proxy" in k.lower()], env


def test_a_node_data_root_another_dockerd_holds_is_refused_naming_the_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The data roots are cached outside the clone, so two checkouts' sims could reach for the same one.
    monkeypatch.setenv("DSV41_CACHE", str(tmp_path / "cache"))
    layout = cluster.Layout(state=tmp_path / "state")
    root = layout.data_root(1)
    other = subprocess.Popen(
        ["bash", "-c", f'exec -a dockerd {sys.executable} -c "import time; time.sleep(60)" --data-root {root}']
    )
    try:
        deadline = time.monotonic() + 10
        while cluster.data_root_holder(root) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster.data_root_holder(root) == other.pid
        assert cluster.data_root_holder(layout.data_root(2)) is None
        with pytest.raises(cluster.SimError, match=rf"{root} is in use by dockerd pid {other.pid}.*make sim-down"):
            cluster.start_dockerd(layout, 1)
    finally:
        other.kill()
        other.wait()
