"""The programs shipped as zip applications (the staging program, the worker copy's source and copier): each one
zip of its imports, the same bytes for the same files, and each runs with nothing of this checkout on sys.path (no
pulumi, no pydantic); the copy programs read back the config line the program built."""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from components import shipped
from components.weights import local_copy as lc
from components.weights import manifest as wm
from components.weights.copy_weights import REPORT_MARKER

ENTRY = "components.weights.staging.main"


def test_the_zipapp_is_the_entrys_files_and_a_main_and_the_same_bytes_every_time() -> None:
    first, again = shipped.zipapp(ENTRY), shipped.zipapp(ENTRY)
    assert first == again, "the payload is a Pulumi input: a byte of difference would show at every preview"
    with zipfile.ZipFile(io.BytesIO(first)) as zf:
        names = zf.namelist()
        assert names == sorted(names)
        assert set(names) == {*shipped.module_files(ENTRY), "__main__.py"} and len(names) == len(set(names))
        assert "components/weights/staging/plan.py" in names and "components/weights/manifest.py" not in names
        for info in zf.infolist():
            assert info.date_time == (1980, 1, 1, 0, 0, 0) and info.external_attr >> 16 == 0o100644, info
            assert info.compress_type == zipfile.ZIP_STORED and info.create_system == 3, info
            if info.filename != "__main__.py":
                assert zf.read(info) == (shipped.REPO / info.filename).read_bytes(), info.filename
        main = zf.read("__main__.py").decode()
    assert f"from {ENTRY} import main\n" in main and "sys.exit(main())" in main
    assert base64.b64decode(wm.stage_program_text(), validate=True) == first
    assert "\n" not in wm.stage_program_text(), "one line of base64, after the token line"


def test_the_staging_program_runs_from_its_zipapp_alone(tmp_path: Path) -> None:
    pyz = tmp_path / "stage_weights.pyz"
    pyz.write_bytes(base64.b64decode(wm.stage_program_text()))
    # -I: no PYTHONPATH, no user site, not the current directory; -v names where every module came from.
    proc = subprocess.run(
        [sys.executable, "-I", "-v", str(pyz), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--plan PLAN" in proc.stdout and "--dest-root DEST_ROOT" in proc.stdout
    assert_imported_from_the_zip_alone(proc.stderr, pyz, "components.weights.staging.main")


def assert_imported_from_the_zip_alone(verbose: str, pyz: Path, entry: str) -> None:
    """`python -v`'s stderr: `entry` ran, every project module came from `pyz`, neither pulumi nor pydantic."""
    imported = [ln.split()[1].strip("'") for ln in verbose.splitlines() if ln.startswith("import ")]
    ours = [m for m in imported if m == "components" or m.startswith("components.")]
    assert entry in ours, ours
    from_zip = [ln for ln in verbose.splitlines() if ln.startswith("import 'components") and str(pyz) in ln]
    assert len(from_zip) == len(ours), "every project module is read from the zip, none from this checkout"
    assert not [m for m in imported if m.split(".")[0] in ("pulumi", "pydantic")], "the node has neither"


# --- the worker copy's two programs ----------------------------------------------------------------------------

COPY_PROGRAMS = {lc.SOURCE_PROGRAM: lc.source_program_text, lc.COPIER_PROGRAM: lc.copier_program_text}
TOKEN = "copy-token-7f3a9c"


@pytest.mark.parametrize("entry", sorted(COPY_PROGRAMS))
def test_each_copy_programs_zipapp_is_its_imports_with_the_contract_and_nothing_of_the_program(entry: str) -> None:
    payload = shipped.zipapp(entry)
    assert payload == shipped.zipapp(entry), "the source's payload is a header value: the same bytes every time"
    assert base64.b64decode(COPY_PROGRAMS[entry](), validate=True) == payload
    assert "\n" not in COPY_PROGRAMS[entry](), "one line of base64"
    with zipfile.ZipFile(io.BytesIO(payload)) as zf:
        names = set(zf.namelist())
    assert names == {*shipped.module_files(entry), "__main__.py"}
    assert {"components/contract.py", "components/weights/copy_config.py"} <= names, "the config's declaration"
    assert f"{entry.replace('.', '/')}.py" in names
    for program_side in ("local_copy", "worker_copy", "manifest", "copy_source", "copy_weights"):
        if not entry.endswith(program_side):
            assert f"components/weights/{program_side}.py" not in names, program_side


def _pyz(tmp_path: Path, entry: str) -> Path:
    pyz = tmp_path / f"{entry.rsplit('.', 1)[1]}.pyz"
    pyz.write_bytes(base64.b64decode(COPY_PROGRAMS[entry]()))
    return pyz


def test_the_copy_programs_run_from_their_zipapps_alone_and_read_the_configs_the_program_built(
    tmp_path: Path,
) -> None:
    """Both ends as the containers run them (`python3 x.pyz`), under -I in an empty directory: the source serves
    whom and what its config names, the copier ends with what its config expects."""
    head, dest, cwd = tmp_path / "head", tmp_path / "worker", tmp_path / "cwd"
    staged = {
        f"{wm.MODEL_DIR}/config.json": b'{"a": 1}\n',
        f"{wm.MODEL_DIR}/model-00001-of-00001.safetensors": os.urandom(300_000),
        f"{wm.ENGRAM_VLLM_DIR}/model.safetensors.index.json": b"{}\n",
        f"{wm.ENGRAM_DIR}/model-00047-of-00048.safetensors": b"not served",
    }
    for rel, data in staged.items():
        (head / rel).parent.mkdir(parents=True, exist_ok=True)
        (head / rel).write_bytes(data)
    dest.mkdir()
    cwd.mkdir()
    source_pyz, copier_pyz = _pyz(tmp_path, lc.SOURCE_PROGRAM), _pyz(tmp_path, lc.COPIER_PROGRAM)
    served = {p: d for p, d in staged.items() if p.split("/")[0] in wm.SERVED_DIRS}
    source_config = lc.source_config(token=TOKEN, worker_fabric_ip="127.0.0.1", timeout_s=60)
    copier_config = lc.copier_config(
        token=TOKEN,
        files={p: len(d) for p, d in served.items()},
        sha256={p: hashlib.sha256(d).hexdigest() for p, d in served.items()},
    )
    source_log = tmp_path / "source.stderr"
    with source_log.open("w") as log:
        source = subprocess.Popen(
            [sys.executable, "-I", "-v", str(source_pyz), "--root", str(head), "--bind", "127.0.0.1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=cwd,
        )
    try:
        assert source.stdin and source.stdout
        source.stdin.write(source_config.to_line() + "\n")
        source.stdin.flush()
        ready = lc.parse_source_line(source.stdout.readline(), {})
        assert ready is not None, source_log.read_text()[-2000:]

        def get(rel: str, token: str = TOKEN) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", ready.port, timeout=10)
            conn.request("GET", f"/files/{rel}", headers={"Authorization": f"Bearer {token}"})
            return conn.getresponse().status

        assert get(f"{wm.MODEL_DIR}/config.json") == 200 and get(f"{wm.MODEL_DIR}/config.json", "other") == 401
        assert get(f"{wm.ENGRAM_DIR}/model-00047-of-00048.safetensors") == 404, "only the config's dirs are served"
        copied = subprocess.run(
            [sys.executable, "-I", "-v", str(copier_pyz), "--node", "spark-1"]
            + ["--source", f"http://127.0.0.1:{ready.port}", "--bind", "127.0.0.1"]
            + ["--dest", str(dest), "--host-dest", "/copies/spark-1", "--streams", "2"],
            input=lc.copier_stdin(copier_config).split("\n", 1)[0] + "\n",  # what copy.sh hands the container
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
        )
    finally:
        assert source.stdin
        source.stdin.close()
        assert source.wait(timeout=20) == 0
    assert copied.returncode == 0, copied.stderr[-3000:]
    report = json.loads(copied.stdout.split(f"{REPORT_MARKER} ", 1)[1])
    assert report["copied"] == sorted(served) and report["root"] == "/copies/spark-1"
    assert {p: (dest / p).read_bytes() for p in served} == served
    assert not (dest / wm.ENGRAM_DIR).exists()
    assert_imported_from_the_zip_alone(source_log.read_text(), source_pyz, lc.SOURCE_PROGRAM)
    assert_imported_from_the_zip_alone(copied.stderr, copier_pyz, lc.COPIER_PROGRAM)


@pytest.mark.parametrize(
    "entry, line, status, said",
    [
        (
            lc.SOURCE_PROGRAM,
            json.dumps({"allow": ["127.0.0.1"], "dirs": ["model"]}),
            2,
            "copy_source: error: stdin's first line must carry the token and the workers' addresses "
            "(SourceConfig.token is missing",
        ),
        (
            lc.SOURCE_PROGRAM,
            json.dumps({"token": TOKEN, "allow": ["127.0.0.1"], "dirs": ["model"], "limits": {"io_timeout_s": "x"}}),
            2,
            "SourceConfig.limits.io_timeout_s must be float, got 'x'",
        ),
        (
            lc.COPIER_PROGRAM,
            json.dumps({"token": TOKEN}),
            1,
            "copy_weights: error: stdin's first line is not the copier's config (the token, the expected files): "
            "CopierConfig.expected is missing",
        ),
        (
            lc.COPIER_PROGRAM,
            json.dumps({"token": TOKEN, "expected": [{"path": "model/a", "size": "5", "sha256": "a" * 64}]}),
            1,
            "CopierConfig.expected[0].size must be int, got '5'",
        ),
        (lc.COPIER_PROGRAM, "", 1, "CopierConfig is not JSON"),
    ],
)
def test_a_copy_program_refuses_a_malformed_config_line_naming_the_field(
    tmp_path: Path, entry: str, line: str, status: int, said: str
) -> None:
    pyz = _pyz(tmp_path, entry)
    argv = (
        ["--root", str(tmp_path), "--bind", "127.0.0.1"]
        if entry == lc.SOURCE_PROGRAM
        else ["--node", "w1", "--source", "http://127.0.0.1:9", "--bind", "127.0.0.1"]
        + ["--dest", str(tmp_path), "--host-dest", "/c"]
    )
    done = subprocess.run(
        [sys.executable, "-I", str(pyz), *argv], input=line + "\n", capture_output=True, text=True, timeout=30
    )
    assert done.returncode == status and said in done.stderr, done.stderr
