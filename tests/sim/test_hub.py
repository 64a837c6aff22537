"""The hub stand-in's per-connection throttle (`sim/hub.py`), served in-process on 127.0.0.1: each download is
capped on its own, listings are not, a Range resume is capped too, and the faults file changes the cap live."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sim import hub as sim_hub

REPO = "org/model"
SIZE = 256 << 10
RATE = 512 << 10  # bytes per second: one body of SIZE takes 0.5 s


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[sim_hub.Hub, int]]:
    h = sim_hub.Hub(
        repos={REPO: {"a.safetensors": bytes(SIZE), "b.safetensors": b"\1" * SIZE}},
        faults_file=tmp_path / "faults",
        rate_per_connection=RATE,
    )
    server = sim_hub.serve("127.0.0.1", 0, h)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield h, server.server_address[1]
    server.shutdown()
    server.server_close()


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    began = time.monotonic()
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body, time.monotonic() - began


def test_a_download_is_sent_no_faster_than_the_cap(hub: tuple[sim_hub.Hub, int]) -> None:
    _, port = hub
    status, body, took = _get(port, f"/{REPO}/resolve/main/a.safetensors")
    assert status == 200 and body == bytes(SIZE)
    assert took >= 0.45, f"{SIZE} bytes at {RATE} B/s take 0.5 s, took {took:.2f} s"


def test_the_cap_is_per_connection_not_shared(hub: tuple[sim_hub.Hub, int]) -> None:
    _, port = hub
    began = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: _get(port, f"/{REPO}/resolve/main/{n}.safetensors"), "abab"))
    wall = time.monotonic() - began
    assert all(r[0] == 200 and r[2] >= 0.45 for r in results), [r[2] for r in results]
    assert wall < 1.5, f"four capped downloads at once must take about as long as one (0.5 s), took {wall:.2f} s"


def test_a_range_resume_is_capped_and_listings_are_not(hub: tuple[sim_hub.Hub, int]) -> None:
    _, port = hub
    status, body, took = _get(port, f"/{REPO}/resolve/main/b.safetensors", {"Range": f"bytes={SIZE // 2}-"})
    assert status == 206 and body == b"\1" * (SIZE // 2) and took >= 0.2
    status, _, took = _get(port, f"/api/models/{REPO}/tree/main")
    assert status == 200 and took < 0.2


def test_the_faults_file_changes_the_cap_while_the_hub_runs(hub: tuple[sim_hub.Hub, int], tmp_path: Path) -> None:
    h, port = hub
    (tmp_path / "faults").write_text("rate:0\n")
    assert h.rate() == 0
    assert _get(port, f"/{REPO}/resolve/main/a.safetensors")[2] < 0.3, "rate:0 lifts the cap"
    (tmp_path / "faults").write_text(f"rate:{SIZE}\n")  # 1 s per body
    assert _get(port, f"/{REPO}/resolve/main/a.safetensors")[2] >= 0.9
    (tmp_path / "faults").unlink()
    assert h.rate() == RATE, "without the line the hub's own cap applies again"


def test_faults_parse_rate_lines_and_refuse_a_bad_one() -> None:
    faults = sim_hub.Faults.parse(["rate: 1000", "org/x/y", "listed:org/x/z", "rate:2000"])
    assert faults.rate == 2000 and faults.hidden == {"org/x/y"} and faults.unresolvable == {"org/x/z"}
    assert sim_hub.Faults.parse(["org/x/y"]).rate is None
    with pytest.raises(ValueError, match="bytes per second per connection"):
        sim_hub.Faults.parse(["rate:fast"])
    with pytest.raises(ValueError, match="0: no cap"):
        sim_hub.parse_rate("-1", "--rate-per-connection")


def test_paced_writes_keep_to_the_rate() -> None:
    import io

    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    out = io.BytesIO()
    sim_hub.write_paced(out, b"x" * 100_000, 50_000, clock=lambda: now[0], sleep=sleep)
    assert out.getvalue() == b"x" * 100_000
    assert now[0] == pytest.approx(100_000 / 50_000, rel=0.02), "the body took its size over the rate"
    assert len(slept) >= 50, "sent in small pieces, not one burst and one sleep"
