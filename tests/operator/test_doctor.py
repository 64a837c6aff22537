"""`dsv41-exl3 doctor`: each node's preflight report, the image's platforms and the hub, with fake ssh, pinning
and hub; the rows, the table, the JSON shape, the exit codes, and no secret in the output."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import requests

from components import host_keys
from components.image.platforms import decide, decide_gpu_in_container, registry_on_loopback, render_gpu_check
from components.operator import doctor
from components.weights.hub_check import PLAIN_HTTP_CAP_BYTES, check_hub
from tests.discover.nodes import probe_text
from tests.operator import stacks
from tests.support.configs import two_sparks
from tests.support.host_keys import fake_host_key

pytestmark = pytest.mark.timeout(60)
HEAD, WORKER = "10.0.0.1", "10.0.0.2"
GIB = 1024**3


def report(node: str, *results: str) -> str:
    """preflight.sh's last line in report mode (tests/preflight proves the script prints this shape)."""
    return json.dumps({"node": node, "mem_available_gib": 120.0, "gid_index": 3, "stopped": [], "findings": [],
                       "results": list(results)})  # fmt: skip


HEALTHY = (
    "docker|ok|",
    "docker|ok|docker server 27.5.1",
    "rdma|ok|",
    "rdma|ok|RoCE v2 GID index 3 on rocep1s0f0",
    "memory|ok|",
    "memory|ok|MemAvailable 120.00 GiB (needs 111.5)",
)


def manifest(*platforms: str) -> str:
    builds = [{"Descriptor": {"platform": {"os": p.split("/")[0], "architecture": p.split("/")[1]}}} for p in platforms]
    return json.dumps(builds[0] if len(builds) == 1 else builds)


ARM64 = "platform linux/arm64\nmanifest\n" + manifest("linux/arm64", "linux/amd64")


def done(stdout: str = "", stderr: str = "", returncode: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["ssh"], returncode, stdout, stderr)


GPU_SEEN = "exit 0\nGPU 0: NVIDIA GB10 (UUID: GPU-5f0c)"


class FakeSsh:
    """Each node answers the preflight, discovery's probe, the image and the GPU checks as told (by SSH address)."""

    def __init__(
        self,
        preflight: dict[str, subprocess.CompletedProcess[str]],
        image: dict[str, str],
        probe: dict[str, str] | None = None,
        gpu: dict[str, str] | None = None,
    ) -> None:
        self.preflight, self.image = preflight, image
        self.probe, self.gpu = probe or {}, gpu or {}
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], timeout_s: int) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        host = argv[-2].split("@", 1)[1]
        if "image/manifest_check.sh" in argv[-1]:
            return done(self.image[host])
        if "discover/probe.sh" in argv[-1]:
            return done(self.probe.get(host, probe_text()))
        if "image/gpu_check.sh" in argv[-1]:
            return done(self.gpu.get(host, GPU_SEEN))
        assert "preflight/preflight.sh" in argv[-1] and "REPORT=1" in argv[-1] and "STOP=0" in argv[-1], argv[-1]
        return self.preflight[host]


class FakePin:
    def __init__(self, changed: Sequence[str] = ()) -> None:
        self.changed = set(changed)

    def __call__(self, nodes: Sequence[host_keys.NodeAddress], known: str | None) -> dict[str, host_keys.Pin]:
        pins = {}
        for n in nodes:
            key = fake_host_key(n.host, n.port)
            if n.host in self.changed:
                new = fake_host_key(n.host + ".new", n.port)
                raise host_keys.HostKeyError(host_keys.changed_message(n, known or "kh", [key], [new]))
            pins[n.node] = host_keys.Pin(key=key)
        return pins


class Response:
    def __init__(self, status: int, body: Any = None) -> None:
        self.status_code, self.body = status, body

    def json(self) -> Any:
        return self.body


def sibling(name: str, size: int) -> dict[str, Any]:
    return {"rfilename": name, "size": size, "blobId": "b" * 40}


MODEL_FILES = [sibling(f"model-{i:05d}-of-00039.safetensors", 9 * GIB) for i in range(1, 40)]
ENGRAM_FILES = [
    sibling("model-00047-of-00048.safetensors", 95 * GIB),
    sibling("model-00048-of-00048.safetensors", 94 * GIB),
    sibling("model.safetensors.index.json", 2_000_000),
    sibling("config.json", 2_000),
]


class FakeHub:
    """`get`: model info per repo, or a status for every repo."""

    def __init__(self, status: int = 200, model: list[dict[str, Any]] | None = None) -> None:
        self.status, self.model = status, MODEL_FILES if model is None else model
        self.calls: list[tuple[str, dict[str, str]]] = []

    def __call__(self, url: str, headers: dict[str, str], timeout: float) -> Response:
        self.calls.append((url, headers))
        if self.status != 200:
            return Response(self.status)
        files = ENGRAM_FILES if "DeepSeek-V4" in url and "EXL3" not in url else self.model
        return Response(200, {"sha": "c0ffee" * 6 + "abcd", "siblings": files})


def run_doctor(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *args: str,
    ssh: FakeSsh | None = None,
    pin: FakePin | None = None,
    hub: FakeHub | None = None,
    **config: Any,
) -> tuple[int, str, str]:
    monkeypatch.setattr(doctor, "read_stack", lambda name: stacks.view(**config))
    ssh = ssh or FakeSsh(
        {HEAD: done(report("spark-head", *HEALTHY)), WORKER: done(report("spark-worker", *HEALTHY))},
        {HEAD: ARM64, WORKER: ARM64},
    )
    code = doctor.main(list(args), run=ssh, pin=pin or FakePin(), get=hub or FakeHub())
    out, err = capsys.readouterr()
    return code, out, err


def test_a_healthy_cluster_passes_every_check_and_prints_one_row_each(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run_doctor(capsys, monkeypatch, "--json")
    assert code == 0, out + err
    result = json.loads(out)
    assert result["stack"] == stacks.STACK and result["ok"] is True
    rows = [(c["where"], c["check"], c["status"]) for c in result["checks"]]
    probed = ["login-shell", "storage-driver", "docker-runtime", "gpu", "memfree"]
    head = ["ssh", "docker", "rdma", "memory", *probed, "nfs-server", "image", "gpu-container"]
    worker = ["ssh", "docker", "rdma", "memory", *probed, "image", "gpu-container"]
    expected = [("spark-head", c, "ok") for c in head] + [("spark-worker", c, "ok") for c in worker]
    assert rows[: len(expected)] == expected
    assert [r[:2] for r in rows[len(expected) :]] == [
        ("hub", "Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw"),
        ("hub", stacks.view().settings.weights.engram_repo),
    ]
    assert set(result["checks"][0]) == {"where", "check", "status", "detail", "fix"}
    memory = next(c for c in result["checks"] if c["check"] == "memory")
    assert memory["detail"] == "MemAvailable 120.00 GiB (needs 111.5)"
    engram = result["checks"][-1]["detail"]
    assert "2 above 46.57 GiB (model-00047-of-00048.safetensors, model-00048-of-00048.safetensors)" in engram
    assert "Range resume" in engram

    code, table, _ = run_doctor(capsys, monkeypatch)
    assert code == 0 and table.splitlines()[-1] == f"{len(expected) + 2} checks, all ok", table


def test_each_failure_is_named_with_its_fix_and_every_other_check_still_reported(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    low_memory = (
        "memory|fail|MemAvailable is 60.00 GiB, below the required 111.5 GiB; fix: stop what holds memory on spark-head"
    )
    ssh = FakeSsh(
        {
            HEAD: done(report("spark-head", *HEALTHY[:4], "memory|ok|", low_memory)),
            WORKER: done(stderr="ssh: connect to host 10.0.0.2 port 22: No route to host\r\n", returncode=255),
        },
        {HEAD: "platform linux/arm64\nmanifest\n" + manifest("linux/amd64")},
    )
    code, out, _ = run_doctor(capsys, monkeypatch, "--json", ssh=ssh, hub=FakeHub(status=401))
    assert code == 1
    checks = {(c["where"], c["check"]): c for c in json.loads(out)["checks"]}
    failed = {k for k, c in checks.items() if c["status"] == "fail"}
    engram = stacks.view().settings.weights.engram_repo
    assert failed == {
        ("spark-head", "memory"),
        ("spark-head", "image"),
        ("spark-worker", "ssh"),
        ("hub", "Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw"),
        ("hub", engram),
    }, failed
    assert checks[("spark-head", "docker")]["status"] == "ok", "the head's other checks are still reported"
    memory = checks[("spark-head", "memory")]
    assert memory["detail"].startswith("MemAvailable is 60.00 GiB") and memory["fix"].startswith("stop what holds")
    image = checks[("spark-head", "image")]
    assert "no linux/arm64 build (builds: linux/amd64)" in image["detail"] and "arm64" in image["fix"]
    assert "No route to host" in checks[("spark-worker", "ssh")]["detail"]
    assert "weights.hfToken" in checks[("hub", engram)]["fix"]


def test_a_changed_host_key_fails_that_node_alone_before_any_command_runs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ssh = FakeSsh({HEAD: done(report("spark-head", *HEALTHY))}, {HEAD: ARM64})
    code, out, _ = run_doctor(capsys, monkeypatch, "--json", ssh=ssh, pin=FakePin(changed=[WORKER]))
    assert code == 1
    worker = [c for c in json.loads(out)["checks"] if c["where"] == "spark-worker"]
    assert [(c["check"], c["status"]) for c in worker] == [("ssh", "fail")]
    assert not [argv for argv in ssh.calls if WORKER in argv[-2]], "nothing runs on a node whose key changed"


def test_a_bad_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_doctor(capsys, monkeypatch, "--jsn")
    assert code == 2 and "--jsn" in err and not out


def test_no_credential_reaches_the_output_even_when_a_node_echoes_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    echoed = f"docker|fail|docker said {stacks.SSH_KEY_BODY} and {stacks.API_KEY}; fix: x"
    ssh = FakeSsh(
        {HEAD: done(report("spark-head", echoed)), WORKER: done(report("spark-worker", *HEALTHY))},
        {HEAD: ARM64, WORKER: ARM64},
    )
    code, out, _ = run_doctor(capsys, monkeypatch, ssh=ssh)
    assert code == 1
    assert stacks.SSH_KEY_BODY not in out and stacks.API_KEY not in out and "[secret]" in out


# --- the image's platforms -------------------------------------------------------------------------------------


def test_the_image_verdict_reads_a_single_build_a_manifest_list_and_an_unreadable_manifest() -> None:
    image = "ghcr.io/miaai-lab/x:2.9bpw"
    assert decide(image, "platform linux/arm64\nmanifest\n" + manifest("linux/arm64")).ok
    assert decide(image, ARM64).ok
    amd = decide(image, "platform linux/arm64\nmanifest\n" + manifest("linux/amd64"))
    assert not amd.ok and "its pull would fail here" in amd.detail
    unreadable = decide(image, "platform linux/arm64\nunreadable\nunauthorized: authentication required")
    assert not unreadable.ok and "unauthorized" in unreadable.detail and "docker login" in unreadable.fix


@pytest.mark.parametrize(
    ("image", "loopback"),
    [
        ("127.0.0.1:5000/dsv41-exl3/standin:2.9bpw", True),
        ("localhost:5000/x:1", True),
        ("ghcr.io/miaai-lab/x:2.9bpw", False),
        ("nvcr.io/nvidia/vllm:25.09", False),
        ("ubuntu:24.04", False),
    ],
)
def test_plain_http_only_for_a_registry_on_loopback(image: str, loopback: bool) -> None:
    assert registry_on_loopback(image) is loopback


# --- the hub ---------------------------------------------------------------------------------------------------


def test_the_hub_check_applies_the_staging_plans_rules() -> None:
    s = stacks.view().settings
    ok = check_hub(s, FakeHub())
    assert [v.ok for v in ok] == [True, True]
    assert "39 files, 351.0 GiB" in ok[0].detail
    short = check_hub(s, FakeHub(model=MODEL_FILES[:38]))[0]
    assert not short.ok and "has 38 *.safetensors shards, expected exactly 39" in short.detail
    missing = check_hub(s, FakeHub(status=404))[1]
    assert not missing.ok and "not found on the hub" in missing.detail and "weights.revision" in missing.fix


def test_the_hub_check_sends_the_token_only_in_a_header_and_names_a_dead_endpoint() -> None:
    hub = FakeHub()
    check_hub(stacks.view(weights={"hfToken": "hf_SECRETtoken123"}).settings, hub)
    assert all(h == {"Authorization": "Bearer hf_SECRETtoken123"} for _, h in hub.calls)
    assert all("hf_SECRET" not in url for url, _ in hub.calls)

    def dead(url: str, headers: dict[str, str], timeout: float) -> Response:
        raise requests.ConnectionError("refused")

    verdict = check_hub(stacks.view().settings, dead)[0]
    assert not verdict.ok and "did not answer (ConnectionError)" in verdict.detail
    assert PLAIN_HTTP_CAP_BYTES == 50 * 1000**3


# --- discovery's probe, shared with `dsv41-exl3 discover` ----------------------------------------------------------


def probe_checks(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, probe: str, **config: Any
) -> tuple[int, dict[str, dict[str, str]]]:
    ssh = FakeSsh(
        {HEAD: done(report("spark-head", *HEALTHY)), WORKER: done(report("spark-worker", *HEALTHY))},
        {HEAD: ARM64, WORKER: ARM64},
        probe={HEAD: probe},
    )
    code, out, _ = run_doctor(capsys, monkeypatch, "--json", ssh=ssh, **config)
    return code, {c["check"]: c for c in json.loads(out)["checks"] if c["where"] == "spark-head"}


@pytest.mark.parametrize(
    ("probe", "check", "status", "said", "fix"),
    [
        (probe_text(shell="/usr/sbin/nologin"), "login-shell", "fail", "ssh runs no command", "chsh -s /bin/bash"),
        (probe_text(nfs_server="inactive"), "nfs-server", "fail", "nfs-server is inactive", "enable --now nfs-server"),
        (probe_text(nfs="unknown ok not-installed"), "nfs-server", "fail", "not installed", "apt-get install"),
        (probe_text(sudo_l=1), "nfs-server", "fail", "`sudo -n` is refused for /usr/sbin/exportfs", "NOPASSWD"),
        (probe_text(meminfo="meminfo_busy.txt"), "memfree", "warn", "MemFree 36.9 GiB", ""),
        (probe_text(replace={"gpu": "exit 9\nNVIDIA-SMI has failed"}), "gpu", "fail", "NVIDIA-SMI has failed", ""),
    ],
)
def test_each_probe_decision_is_a_row_with_its_fix(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    probe: str,
    check: str,
    status: str,
    said: str,
    fix: str,
) -> None:
    code, checks = probe_checks(capsys, monkeypatch, probe)
    assert checks[check]["status"] == status and said in checks[check]["detail"], checks[check]
    assert fix in checks[check]["fix"] or fix in checks[check]["detail"], checks[check]
    assert code == (1 if status == "fail" else 0), "a warning alone exits 0"
    others = {c for c, row in checks.items() if row["status"] != "ok"}
    assert others == {check}, "every other check of the node still reported, and ok"


def test_a_vfs_storage_driver_warns_and_a_copy_mode_stack_without_gpus_skips_nfs_and_the_gpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    vfs = probe_text().replace('"Driver":"overlay2"', '"Driver":"vfs"', 1)
    assert '"Driver":"vfs"' in vfs
    code, checks = probe_checks(capsys, monkeypatch, vfs)
    assert code == 0 and checks["storage-driver"]["status"] == "warn" and "vfs" in checks["storage-driver"]["detail"]

    nodes = [{**n, "gpus": ""} for n in two_sparks()["nodes"]]
    no_gpus = probe_text(nfs_server="inactive")
    code, checks = probe_checks(capsys, monkeypatch, no_gpus, nodes=nodes, weights={"share": "copy"})
    assert code == 0, checks
    assert "nfs-server" not in checks and "docker-runtime" not in checks and "gpu-container" not in checks
    assert checks["gpu"]["status"] == "ok" and "not checked" in checks["gpu"]["detail"]


def test_the_gpu_in_a_container_is_judged_only_where_the_image_is_on_the_node() -> None:
    image = "ghcr.io/miaai-lab/x:2.9bpw"
    assert decide_gpu_in_container(image, "all", GPU_SEEN).ok
    absent = decide_gpu_in_container(image, "all", "absent\n")
    assert absent.ok and "not on the node yet" in absent.detail
    refused = decide_gpu_in_container(
        image, "all", "exit 125\ndocker: Error response from daemon: could not select device driver \"\" with "
        "capabilities: [[gpu]]."
    )  # fmt: skip
    assert not refused.ok and "could not select device driver" in refused.detail and "nvidia-ctk" in refused.fix
    assert not decide_gpu_in_container(image, "all", "exit 0\nNo devices were found").ok


@pytest.mark.parametrize(
    ("docker", "printed"),
    [
        ('[ "$1 $2" = "image inspect" ] && exit 1\nexit 9', "absent"),
        (
            '[ "$1 $2" = "image inspect" ] && exit 0\n[ "$*" = "run --rm --gpus all --entrypoint nvidia-smi IMG -L" ]'
            ' || exit 9\necho "GPU 0: NVIDIA GB10 (UUID: GPU-5f0c)"',
            GPU_SEEN,
        ),
    ],
)
def test_the_gpu_check_script_never_pulls_and_runs_nvidia_smi_in_the_image(
    tmp_path: Path, docker: str, printed: str
) -> None:
    (tmp_path / "docker").write_text(f"#!/bin/sh\n{docker}\n")
    (tmp_path / "docker").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    ran = subprocess.run(
        ["sh", "-c", render_gpu_check("IMG", "all")], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert ran.returncode == 0 and ran.stdout.strip() == printed, ran
