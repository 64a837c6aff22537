"""The staging program as it is shipped: one zip application of its imports, the same bytes for the same files,
and it runs with nothing of this checkout on sys.path (no pulumi, no pydantic)."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import zipfile
from pathlib import Path

from components import shipped
from components.weights import manifest as wm

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
    imported = [ln.split()[1].strip("'") for ln in proc.stderr.splitlines() if ln.startswith("import ")]
    ours = [m for m in imported if m == "components" or m.startswith("components.")]
    assert "components.weights.staging.main" in ours
    from_zip = [ln for ln in proc.stderr.splitlines() if ln.startswith("import 'components") and str(pyz) in ln]
    assert len(from_zip) == len(ours), "every project module is read from the zip, none from this checkout"
    assert not [m for m in imported if m.split(".")[0] in ("pulumi", "pydantic")], "the node has neither"
