"""Real `simmer serve` processes in tests: a free port, and waiting until one answers /health."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited before it was ready"
        try:
            r = httpx.get(url + "/health")
            if r.status_code == 200 and r.json()["status"] == "ok":  # 200 "loading" from the start
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("the server did not become ready")
