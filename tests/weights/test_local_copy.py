"""Each worker's own copy (`weights.share: copy`): the head's source and the worker's copier run for real as
processes on loopback, from the zip applications the program ships (the venv's python under `-I` standing in for
the serving image's python3), each reading the config line the program builds; the copy check runs with sh, and
the rendered node scripts keep the token out of every command line."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from components import shipped
from components.scripts import sh_command
from components.weights import local_copy as lc
from components.weights import manifest as wm
from components.weights.copy_config import Limits, SourceConfig
from components.weights.copy_weights import PARTIAL_SUFFIX, RECORD_FILE, REPORT_MARKER, read_record
from tests.support.fake_docker import install_fake_docker
from tests.support.page_cache import cached_files, resident_pages, warm
from tests.support.scripts import header_value, run_sh

PYTHON = sys.executable
TOKEN = "copy-token-7f3a9c"
# The two programs as shipped (zip applications), written once per module by `_programs`.
PROGRAMS: dict[str, Path] = {}


@pytest.fixture(autouse=True, scope="module")
def _programs(tmp_path_factory: pytest.TempPathFactory) -> None:
    where = tmp_path_factory.mktemp("programs")
    for name, text in (("copy_source", lc.source_program_text()), ("copy_weights", lc.copier_program_text())):
        (where / f"{name}.pyz").write_bytes(base64.b64decode(text))
        PROGRAMS[name] = where / f"{name}.pyz"


def program(name: str) -> list[str]:
    """How a container runs it: python3 and the zip application; `-I`: nothing of this checkout on sys.path."""
    return [PYTHON, "-I", str(PROGRAMS[name])]


@dataclass
class Source:
    proc: subprocess.Popen[str]
    port: int

    def get(
        self, path: str, token: str = TOKEN, bind: str = "127.0.0.1", authorization: str | None = None
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5, source_address=(bind, 0))
        conn.request("GET", path, headers={"Authorization": authorization or f"Bearer {token}"})
        reply = conn.getresponse()
        return reply.status, reply.read()

    def threads(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads:")))

    def stop(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


def start_source(root: Path, allow: str = "127.0.0.1", dirs: tuple[str, ...] = wm.SERVED_DIRS, **limits: Any) -> Source:
    """The source as source.sh runs it, its config line on stdin (`limits`: copy_config.Limits' fields)."""
    proc = subprocess.Popen(
        [*program("copy_source"), "--root", str(root), "--bind", "127.0.0.1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin and proc.stdout
    config = SourceConfig(token=TOKEN, allow=(allow,), dirs=dirs, limits=Limits(**limits))
    proc.stdin.write(config.to_line() + "\n")
    proc.stdin.flush()
    ready = lc.parse_source_line(proc.stdout.readline(), {})
    assert ready is not None
    return Source(proc, ready.port)


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def head(tmp_path: Path) -> Path:
    root = tmp_path / "head"
    write(root / wm.MODEL_DIR / "model-00001-of-00002.safetensors", os.urandom(3_000_000))
    write(root / wm.MODEL_DIR / "model-00002-of-00002.safetensors", os.urandom(2_000_000))
    write(root / wm.MODEL_DIR / "config.json", b'{"a": 1}\n')
    write(root / wm.ENGRAM_DIR / "model-00047-of-00048.safetensors", os.urandom(1_000_000))
    write(root / wm.ENGRAM_DIR / wm.ENGRAM_INDEX, b'{"weight_map": {}}\n')
    # As staging builds it: the slim Engram directory, a hardlink of the shard and its own index.
    (root / wm.ENGRAM_VLLM_DIR).mkdir()
    os.link(root / wm.ENGRAM_DIR / "model-00047-of-00048.safetensors", root / wm.ENGRAM_VLLM_DIR / SHARD47)
    write(root / wm.ENGRAM_VLLM_DIR / wm.ENGRAM_INDEX, b'{"weight_map": {"x.engram.embed.weight": "s"}}\n')
    write(root / "dsv41-weights-manifest.json", b"{}")
    return root


@pytest.fixture
def source(head: Path) -> Iterator[Source]:
    s = start_source(head)
    yield s
    s.stop()


def expected_of(head: Path, dirs: tuple[str, ...] = wm.SERVED_DIRS) -> tuple[dict[str, int], dict[str, str]]:
    files, digests = {}, {}
    for p in sorted(head.rglob("*")):
        rel = p.relative_to(head).as_posix()
        if p.is_file() and rel.split("/")[0] in dirs:
            files[rel] = p.stat().st_size
            digests[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files, digests


def copy(
    source: Source,
    head: Path,
    dest: Path,
    *,
    streams: int = 3,
    token: str = TOKEN,
    idents: tuple[str, str] = ("", ""),
    dirs: tuple[str, ...] = wm.SERVED_DIRS,
) -> tuple[subprocess.CompletedProcess[str], lc.CopyReport | None]:
    files, digests = expected_of(head, dirs)
    config = lc.copier_config(token=token, files=files, sha256=digests)
    dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [
            *program("copy_weights"),
            "--node",
            "spark-1",
            "--source",
            f"http://127.0.0.1:{source.port}",
            "--bind",
            "127.0.0.1",
            "--dest",
            str(dest),
            "--host-dest",
            str(dest),
            "--streams",
            str(streams),
            "--dest-ident",
            idents[0],
            "--source-ident",
            idents[1],
        ],
        input=config.to_line() + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done, (lc.parse_copy_report(done.stdout) if done.returncode == 0 else None)


SHARD47 = "model-00047-of-00048.safetensors"


def same_tree(head: Path, dest: Path) -> bool:
    files, _ = expected_of(head)
    return all((dest / p).read_bytes() == (head / p).read_bytes() for p in files)


def test_a_first_copy_fetches_every_staged_file_verified_and_records_it(
    source: Source, head: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "worker"
    done, report = copy(source, head, dest)
    assert done.returncode == 0, done.stderr
    assert report is not None
    files, digests = expected_of(head)
    assert sorted(report.copied) == sorted(files) and report.bytes == sum(files.values())
    assert same_tree(head, dest)
    assert not (dest / "dsv41-weights-manifest.json").exists(), "only the staged directories are copied"
    assert not (dest / wm.ENGRAM_DIR).exists(), "a worker holds what its rank reads: never engram-src/"
    assert {p: row[0] for p, row in read_record(dest).items()} == digests
    assert not list(dest.rglob(f"*{PARTIAL_SUFFIX}")), "no temporary file is left in place"


def test_a_second_copy_copies_nothing_and_reads_no_weights(
    source: Source, head: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "worker"
    copy(source, head, dest)
    done, report = copy(source, head, dest)
    assert done.returncode == 0, done.stderr
    assert report is not None and report.copied == () and report.bytes == 0
    assert "copying" not in done.stderr and "other content" not in done.stderr


def test_a_copy_leaves_no_page_of_the_copy_on_the_worker_and_the_source_drops_what_it_sent(
    head: Path, tmp_path: Path
) -> None:
    # The GB10 driver does not reclaim page cache, and the ranks start right after the copy.
    files, _ = expected_of(head)
    dest = tmp_path / "worker"
    source = start_source(head)
    try:
        done, report = copy(source, head, dest)
    finally:
        source.stop()  # the deployer closes the source's stdin once the copy is done
    assert done.returncode == 0, done.stderr
    assert report is not None
    assert report.page_cache == wm.PageCacheDropped(files=len(files), bytes=sum(files.values()), failed=0)
    # Its record (one page, rewritten after every file) aside: the weights.
    assert set(cached_files(dest)) <= {RECORD_FILE}, "the worker's copy, just written, must be out of its page cache"
    assert f"page cache: dropped the pages of {len(files)} files" in done.stderr
    # Not read back with mincore here: over loopback the kernel may keep a sent page referenced by a socket buffer
    # freed later (deferred skb freeing), which no advice can drop; the test below drops what it served, unsent.
    assert source.proc.stderr is not None
    assert f"page cache: dropped the pages of the {len(files)} files sent" in source.proc.stderr.read()


def test_the_source_drops_every_file_it_sent_from_the_heads_page_cache(head: Path) -> None:
    from components.weights.copy_source import Source as CopySource

    served = CopySource(head, [wm.MODEL_DIR, wm.ENGRAM_VLLM_DIR], ["127.0.0.1"], TOKEN)
    files, _ = expected_of(head)
    for rel in files:  # staged (flushed, dropped) on the head, then read again by the copy
        with (head / rel).open("rb") as f:
            os.fdatasync(f.fileno())
        assert warm(head / rel) > 0, "precondition: the head's file is in its page cache"
        path = served.resolve(rel)
        assert path is not None
        served.sent(path)
    served.sent(path)  # sent twice (a resumed file): dropped once
    (head / "unsent.bin").write_bytes(os.urandom(1 << 20))
    assert warm(head / "unsent.bin") > 0
    assert served.drop_sent() == (len(files), sum(files.values()))
    assert {rel for rel in cached_files(head) if rel in files} == set()
    assert resident_pages(head / "unsent.bin") > 0, "only what the source sent is the source's to advise"


def test_a_copy_with_nothing_to_fetch_still_drops_the_pages_of_the_copy(
    source: Source, head: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "worker"
    copy(source, head, dest)
    files, _ = expected_of(head)
    for rel in files:
        assert warm(dest / rel) > 0
    done, report = copy(source, head, dest)
    assert done.returncode == 0 and report is not None and report.copied == ()
    assert report.page_cache is not None and report.page_cache.files == len(files)
    assert set(cached_files(dest)) <= {RECORD_FILE}


def test_the_copiers_drop_counts_a_hard_link_once_and_names_a_file_it_cannot_open(tmp_path: Path) -> None:
    from components.weights.copy_weights import drop_page_cache

    (tmp_path / "a").write_bytes(os.urandom(1 << 20))
    os.link(tmp_path / "a", tmp_path / "b")
    counts, failed = drop_page_cache([tmp_path / "a", tmp_path / "b", tmp_path / "gone"])
    assert counts == {"files": 1, "bytes": 1 << 20, "failed": 1}
    assert failed == [f"{tmp_path}/gone: No such file or directory"]
    assert resident_pages(tmp_path / "a") == 0


def test_an_interrupted_copy_resumes_the_partial_file_and_keeps_the_finished_ones(
    source: Source, head: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "worker"
    copy(source, head, dest)
    big = f"{wm.MODEL_DIR}/model-00001-of-00002.safetensors"
    record_before = read_record(dest)
    # As an interruption leaves it: the big file not yet renamed into place, 1 MB of it written.
    (dest / big).unlink()
    write(dest / (big + PARTIAL_SUFFIX), (head / big).read_bytes()[:1_000_000])
    done, report = copy(source, head, dest)
    assert done.returncode == 0, done.stderr
    assert report is not None and report.copied == (big,)
    assert report.bytes == 2_000_000, "only the rest of the partial file is fetched"
    assert same_tree(head, dest)
    assert {p: r for p, r in read_record(dest).items() if p != big} == {
        p: r for p, r in record_before.items() if p != big
    }


def test_a_corrupted_file_of_the_right_size_is_detected_and_copied_again(
    source: Source, head: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "worker"
    copy(source, head, dest)
    small = f"{wm.ENGRAM_VLLM_DIR}/model-00047-of-00048.safetensors"
    with (dest / small).open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    assert (dest / small).stat().st_size == (head / small).stat().st_size
    done, report = copy(source, head, dest)
    assert done.returncode == 0, done.stderr
    assert report is not None and report.copied == (small,)
    assert "other content" in done.stderr and small in done.stderr
    assert same_tree(head, dest)


def test_a_head_file_that_changed_since_staging_fails_naming_it_and_installs_nothing(
    source: Source, head: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "worker"
    files, digests = expected_of(head)
    name = f"{wm.MODEL_DIR}/config.json"
    (head / name).write_bytes(b'{"a": 2}\n')  # same size, other content than staging verified
    config = lc.copier_config(token=TOKEN, files=files, sha256=digests)
    dest.mkdir()
    done = subprocess.run(
        [
            *program("copy_weights"),
            "--node",
            "spark-1",
            "--source",
            f"http://127.0.0.1:{source.port}",
            "--bind",
            "127.0.0.1",
            "--dest",
            str(dest),
            "--host-dest",
            "/copy",
        ],
        input=config.to_line() + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert f"copy_weights: error: {name}" in done.stderr and "is not what staging verified" in done.stderr
    assert not (dest / name).exists() and not (dest / (name + PARTIAL_SUFFIX)).exists()


def test_files_of_an_older_revision_this_copy_made_are_removed_and_unrecorded_files_are_kept(
    source: Source, head: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "worker"
    old = f"{wm.MODEL_DIR}/model-00002-of-00002.safetensors"
    copy(source, head, dest)
    write(dest / wm.MODEL_DIR / "notes.txt", b"mine")
    (head / old).rename(head / "moved-away")
    done, report = copy(source, head, dest)
    assert done.returncode == 0, done.stderr
    assert not (dest / old).exists() and old not in read_record(dest)
    assert (dest / wm.MODEL_DIR / "notes.txt").read_bytes() == b"mine"


def test_an_upgrade_links_the_engram_shards_a_copy_already_holds_instead_of_copying_them(
    head: Path, tmp_path: Path
) -> None:
    # A worker copied by a version before the slim Engram directory holds engram-src/ (the shards and the native
    # index); now it must hold engram-vllm/. The shards' bytes are already there and verified: nothing moves.
    dest = tmp_path / "worker"
    both = start_source(head, dirs=(wm.MODEL_DIR, wm.ENGRAM_DIR, wm.ENGRAM_VLLM_DIR))
    try:
        done, _ = copy(both, head, dest, dirs=(wm.MODEL_DIR, wm.ENGRAM_DIR))
        assert done.returncode == 0, done.stderr
        old = dest / wm.ENGRAM_DIR / SHARD47
        inode = old.stat().st_ino
        done, report = copy(both, head, dest)
    finally:
        both.stop()
    assert done.returncode == 0, done.stderr
    assert report is not None and report.copied == (f"{wm.ENGRAM_VLLM_DIR}/{wm.ENGRAM_INDEX}",), (
        "only the slim index is fetched: the shard is linked from the verified copy already on the worker"
    )
    raw = json.loads(done.stdout.split(f"{REPORT_MARKER} ", 1)[1])
    assert raw["linked"] == [f"{wm.ENGRAM_VLLM_DIR}/{SHARD47}"]
    assert (dest / wm.ENGRAM_VLLM_DIR / SHARD47).stat().st_ino == inode
    assert not old.exists() and not (dest / wm.ENGRAM_DIR / wm.ENGRAM_INDEX).exists(), "the old layout is removed"
    assert set(read_record(dest)) == set(expected_of(head)[0])
    assert same_tree(head, dest)


def test_the_copy_refuses_to_write_into_the_heads_own_directory(source: Source, head: Path, tmp_path: Path) -> None:
    done, _ = copy(source, head, tmp_path / "worker", idents=("m1:64768:42", "m1:64768:42"))
    assert done.returncode == 1
    assert "is the head's weights root itself" in done.stderr and "{node}" in done.stderr
    assert not list((tmp_path / "worker").rglob("*.safetensors"))


def test_the_source_serves_staged_files_only_to_the_worker_with_the_token(source: Source, head: Path) -> None:
    name = f"{wm.MODEL_DIR}/config.json"
    assert source.get(f"/files/{name}") == (200, (head / name).read_bytes())
    assert source.get(f"/files/{name}", token="wrong")[0] == 401
    for path in (
        "/files/dsv41-weights-manifest.json",
        "/files/model/../dsv41-weights-manifest.json",
        "/files/%2e%2e/etc/passwd",
        "/files/model/missing",
        "/",
    ):
        assert source.get(path)[0] == 404, path


def test_the_source_answers_only_the_workers_fabric_address(head: Path) -> None:
    s = start_source(head, allow="127.0.0.9")
    try:
        status, body = s.get(f"/files/{wm.MODEL_DIR}/config.json")
        assert status == 403 and b"127.0.0.1 is not a worker" in body
    finally:
        assert s.proc.stdin
        s.proc.stdin.close()
        s.proc.wait(timeout=10)


def test_the_source_stops_when_the_deployer_closes_its_stdin(source: Source) -> None:
    assert source.proc.stdin
    source.proc.stdin.close()
    began = time.monotonic()
    assert source.proc.wait(timeout=10) == 0
    assert time.monotonic() - began < 5


def test_a_token_without_the_bearer_scheme_is_refused(source: Source) -> None:
    name = f"/files/{wm.MODEL_DIR}/config.json"
    assert source.get(name, authorization=TOKEN)[0] == 401, "the token alone is not an Authorization header"
    assert source.get(name, authorization=f"Basic {TOKEN}")[0] == 401
    assert source.get(name, authorization=f"bearer {TOKEN}")[0] == 200, "the scheme is case-insensitive"


def half_sent(port: int, bind: str) -> socket.socket:
    """A slow-loris client: a request line and one header, never the blank line that ends them."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(bind, 0))
    sock.sendall(b"GET /files/model/config.json HTTP/1.1\r\nHost: head\r\n")
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """The server let the connection go (EOF or a reset, after whatever it answered) within the socket's timeout."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_an_outsider_is_answered_before_it_sends_a_byte(source: Source) -> None:
    # Checked at accept: a connection from another address gets its 403 without the server reading anything.
    sock = socket.create_connection(("127.0.0.1", source.port), timeout=5, source_address=("127.0.0.2", 0))
    with sock:
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 403 ") and b"127.0.0.2 is not a worker" in reply


def test_the_connection_cap_leaves_room_for_the_most_streams_a_copy_opens() -> None:
    from components.config import Weights

    most = next(m.le for m in Weights.model_fields["copy_streams"].metadata if hasattr(m, "le"))
    assert Limits().max_connections > most, "a copy at weights.copyStreams' maximum would wait for slots"
    assert Limits().silence_s < 60, "a lost session must end the source within a minute"


def test_a_slow_loris_flood_is_bounded_and_a_copy_still_completes(head: Path, tmp_path: Path) -> None:
    s = start_source(head, max_connections=6, request_timeout_s=2)
    try:
        idle = s.threads()
        outsiders = [half_sent(s.port, "127.0.0.2") for _ in range(300)]
        worker = [half_sent(s.port, "127.0.0.1") for _ in range(60)]
        time.sleep(0.5)
        assert s.threads() <= idle + 6, f"{s.threads()} threads for 360 half-sent requests (cap 6)"
        # A copy started in the flood completes: its streams are asked to retry until slots free up.
        done, report = copy(s, head, tmp_path / "worker", streams=3)
        assert done.returncode == 0, done.stderr
        assert report is not None and same_tree(head, tmp_path / "worker")
        for sock in outsiders + worker:
            sock.settimeout(4)
            assert closed_by_server(sock), "a half-sent request is let go after request_timeout_s"
            sock.close()
        time.sleep(0.3)
        assert s.threads() == idle, "every connection's thread is released"
        assert s.get(f"/files/{wm.MODEL_DIR}/config.json")[0] == 200
    finally:
        s.stop()


def test_the_source_stops_when_the_deployers_heartbeats_stop(head: Path) -> None:
    # The deployer's machine vanished: nothing closes the session on the head, the heartbeats just stop.
    s = start_source(head, silence_s=1)
    began = time.monotonic()
    try:
        assert s.proc.wait(timeout=10) == 0
    finally:
        s.proc.kill()
    assert 1 <= time.monotonic() - began < 4
    assert s.proc.stderr and "no heartbeat from the deployer for 1 s" in s.proc.stderr.read()


def test_heartbeats_keep_the_source_serving(head: Path) -> None:
    s = start_source(head, silence_s=1)
    try:
        assert s.proc.stdin
        for _ in range(8):
            s.proc.stdin.write("\n")
            s.proc.stdin.flush()
            time.sleep(0.3)
        assert s.proc.poll() is None and s.get(f"/files/{wm.MODEL_DIR}/config.json")[0] == 200
    finally:
        s.stop()


def test_source_sh_ends_with_the_source_when_the_deployer_falls_silent(head: Path, tmp_path: Path) -> None:
    """The whole remote command ends, not only the server: nothing waits on the session's stdin afterwards."""
    install_fake_docker(tmp_path / "bin", tmp_path / "docker.log")
    command = sh_command(
        lc.render_source_command(
            abs_root=str(head), bind="127.0.0.1", image="img", container="dsv41-exl3-dev-weights-source-spark-1"
        )
    )
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    proc = subprocess.Popen(
        ["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdin and proc.stdout
    config = SourceConfig(token=TOKEN, allow=("127.0.0.1",), dirs=(wm.MODEL_DIR,), limits=Limits(silence_s=1))
    proc.stdin.write(config.to_line() + "\n")
    proc.stdin.flush()
    seen: dict[str, str] = {}
    while (ready := lc.parse_source_line(proc.stdout.readline(), seen)) is None:
        pass
    assert ready.port > 0 and seen["ident"]
    try:
        assert proc.wait(timeout=10) == 0, "the shell must end with the source, its stdin still open"
    finally:
        proc.kill()
        proc.stdin.close()


# --- the copy check: record and stat only ------------------------------------------------------------------------


def check(dest: Path, head: Path, **changes: str) -> dict[str, str]:
    files, digests = expected_of(head)
    digests.update(changes)
    done = run_sh(lc.render_copy_check(copy_root=str(dest), files=files, sha256=digests))
    assert done.returncode == 0, done.stderr
    return lc.parse_copy_check(done.stdout)


def test_the_check_passes_a_verified_copy_and_names_every_file_that_is_not(
    source: Source, head: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "worker"
    copy(source, head, dest)
    assert check(dest, head) == {}
    shard = f"{wm.MODEL_DIR}/model-00002-of-00002.safetensors"
    with (dest / shard).open("r+b") as f:
        f.write(b"\xff")  # rewritten in place: same size, new mtime
    (dest / f"{wm.MODEL_DIR}/config.json").unlink()
    engram = f"{wm.ENGRAM_VLLM_DIR}/model-00047-of-00048.safetensors"
    assert check(dest, head, **{engram: "0" * 64}) == {
        shard: "modified",
        f"{wm.MODEL_DIR}/config.json": "missing",
        engram: "changed",
    }


def test_the_check_counts_files_without_a_record_and_a_missing_root(source: Source, head: Path, tmp_path: Path) -> None:
    dest = tmp_path / "worker"
    copy(source, head, dest)
    (dest / RECORD_FILE).unlink()
    files, _ = expected_of(head)
    assert check(dest, head) == {p: "unverified" for p in files}
    assert check(tmp_path / "nowhere", head) == {p: "missing" for p in files}


# --- rendered commands -------------------------------------------------------------------------------------------


def test_rendered_commands_name_their_containers_and_carry_the_scripts() -> None:
    source = lc.render_source_command(
        abs_root="/w",
        bind="192.168.100.1",
        image="img@sha256:" + "a" * 64,
        container=lc.source_container("dsv41-exl3-dev", "spark-1"),
    )
    command = lc.render_copy_command(
        node="spark-1",
        copy_root="~/dsv41-exl3",
        source="http://192.168.100.1:4000",
        source_ident="m:1:2",
        bind="192.168.100.2",
        image="img",
        streams=4,
        container=lc.copier_container("dsv41-exl3-dev"),
        timeout_s=600,
    )
    assert header_value(source, "CONTAINER") == "dsv41-exl3-dev-weights-source-spark-1"
    assert base64.b64decode(header_value(source, "SOURCE_PYZ"), validate=True) == shipped.zipapp(lc.SOURCE_PROGRAM)
    assert header_value(command, "COPY_ROOT") == "~/dsv41-exl3"
    config = lc.copier_config(token=TOKEN, files={"model/a": 1}, sha256={"model/a": "b" * 64})
    assert [(e.path, e.size, e.sha256) for e in config.expected] == [("model/a", 1, "b" * 64)]
    assert "b" * 64 not in command, "the expected files travel on stdin in the copier's config, not in the command"
    config_line, program_line, end = lc.copier_stdin(config).split("\n")
    assert json.loads(config_line)["token"] == TOKEN and end == ""
    assert base64.b64decode(program_line, validate=True) == shipped.zipapp(lc.COPIER_PROGRAM)
    with pytest.raises(ValueError, match="no sha256"):
        lc.copier_config(token=TOKEN, files={"model/a": 1}, sha256={})


def test_copy_root_resolves_the_node_placeholder() -> None:
    assert lc.copy_root_for("/var/lib/copies/{node}", "spark-2") == "/var/lib/copies/spark-2"
    assert lc.copy_root_for("~/dsv41-exl3", "spark-2") == "~/dsv41-exl3"
