"""A real `simmer serve` process with 256 file descriptors, flooded with connections that never finish a
request (headers a byte at a time, or a chunked body that never ends) and more of them than it has fds:
/health keeps answering within 2 s throughout, and the log does not fill with accept() errors."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from bench.sustained.process import stop
from tests.server.processes import free_port, wait_ready

FD_LIMIT = 256
SERVE = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), int(sys.argv[3])))
    from server.launch import serve
    from server.settings import Settings
    from tests.server.fakes import ScriptedEngine
    settings = Settings(port=int(sys.argv[1]), home=sys.argv[2], model="scripted-test", thermal_source="none")
    serve(settings, engine_factory=lambda: ScriptedEngine(token_delay_s=0.01, reply_tokens=4))
    """
)
SLOW_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
ENDLESS_BODY = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
)


class Flood:
    """`count` connections kept open and unfinished: each gets one more byte a second; one the server
    closes is opened again (as an attacker would)."""

    def __init__(self, port: int, count: int) -> None:
        self.port, self.count = port, count
        self.socks: list[tuple[socket.socket, bytes]] = []
        self.stop = threading.Event()
        self.reopened = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def open_one(self, i: int) -> tuple[socket.socket, bytes] | None:
        kind = ENDLESS_BODY if i % 5 == 0 else SLOW_HEAD
        s = socket.socket()
        s.settimeout(1.0)
        try:
            s.connect(("127.0.0.1", self.port))
            s.sendall(kind)
        except OSError:
            s.close()
            return None
        return s, (b"1\r\na\r\n" if kind is ENDLESS_BODY else b"a")

    def run(self) -> None:
        for i in range(self.count):
            if self.stop.is_set():
                return
            one = self.open_one(i)
            if one is not None:
                self.socks.append(one)
        while not self.stop.wait(1.0):
            for k, (s, drip) in enumerate(list(self.socks)):
                try:
                    s.sendall(drip)
                except OSError:
                    s.close()
                    self.reopened += 1
                    again = self.open_one(k)
                    if again is not None:
                        self.socks[k] = again

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        for s, _ in self.socks:
            s.close()


def test_slow_connection_flood_when_fds_run_short_then_health_answers_and_the_log_stays_small(
    tmp_path,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the flood needs 2048 fds in the test process (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(port), str(tmp_path / "home"), str(FD_LIMIT)],
            cwd=os.getcwd(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    url = f"http://127.0.0.1:{port}"
    flood = Flood(port, 2 * FD_LIMIT)
    worst, answered = 0.0, 0
    try:
        wait_ready(url, proc, timeout=60)
        flood.thread.start()
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                answer = str(httpx.get(url + "/health", timeout=5).status_code)
            except httpx.TransportError as err:
                answer = repr(err)
            took = time.monotonic() - started
            assert answer == "200" and took < 2.0, f"/health: {answer} after {took:.2f} s under the flood"
            worst, answered = max(worst, took), answered + 1
            time.sleep(0.25)
        chat = httpx.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10
        )
        assert chat.status_code == 200, chat.text
    finally:
        flood.close()
        stop(proc)
    text = log.read_text(errors="replace")
    assert flood.reopened > 0, "the server never closed an unfinished connection"
    assert text.count("out of system resource") <= 5, text[-2000:]
    assert log.stat().st_size < 200_000, text[-2000:]
