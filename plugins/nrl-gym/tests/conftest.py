"""What the nrl-gym tests share: a FastAPI app served on loopback, as a Gym server would be."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def _served(app) -> Iterator[str]:
    """``app`` served by uvicorn in a thread on a free 127.0.0.1 port; yields its base URL and
    stops the server (without waiting for requests still sleeping) when the block ends."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        server.force_exit = True
        thread.join(timeout=10)


@pytest.fixture
def served():
    """``with served(app) as base_url: ...``: a FastAPI app on a loopback port for the block."""
    return _served
