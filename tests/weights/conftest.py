"""The weight store tests' local hub, one per test."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from tests.support.staging import FakeHub, hub_handler, small_checkpoint


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    fake = FakeHub(repos=small_checkpoint())
    server = ThreadingHTTPServer(("127.0.0.1", 0), hub_handler(fake))
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()
