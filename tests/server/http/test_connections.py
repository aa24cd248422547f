"""The connection guard (http/connections.py) on a real uvicorn with short limits: a request head or body
that never ends is cut at its deadline, the oldest unfinished connection makes room for a new one at the
cap, and a failed accept() is logged once in a while, not each time."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from server.http.connections import (
    ACCEPT_FAILED,
    ConnectionGuard,
    guarded_protocol,
    rate_limited_exception_handler,
)


async def echo(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(len(await request.body())))


APP = Starlette(routes=[Route("/", echo, methods=["GET", "POST"])])


@pytest.fixture
def serve() -> Iterator:
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(**limits) -> tuple[int, ConnectionGuard]:
        guard = ConnectionGuard(**{"cap": 100, "header_timeout_s": 0.5, "body_timeout_s": 0.5, **limits})
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(APP, http=guarded_protocol(guard), log_config=None, lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        for _ in range(500):
            if server.started:
                break
            time.sleep(0.01)
        servers.append((server, thread))
        return sock.getsockname()[1], guard

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(5)


def connect(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(data)
    return s


def closed_within(s: socket.socket, seconds: float) -> bool:
    """The server closed `s` within `seconds` (what it sent before closing is read and dropped)."""
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def get(port: int) -> bytes:
    s = connect(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    with s:
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data


def test_guard_when_the_request_head_never_ends_then_closed_at_its_deadline(serve) -> None:
    port, guard = serve()
    slow = connect(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    started = time.monotonic()
    for _ in range(3):  # a byte now and then does not extend the deadline
        time.sleep(0.1)
        slow.sendall(b"a")
    assert closed_within(slow, 2.0)
    assert 0.4 < time.monotonic() - started < 1.5
    assert guard.closed["header_timeout"] == 1
    assert get(port).startswith(b"HTTP/1.1 200")


def test_guard_when_a_chunked_body_never_ends_then_closed_at_its_deadline(serve) -> None:
    port, guard = serve()
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    endless = connect(port, head + b"1\r\na\r\n")
    for _ in range(3):
        time.sleep(0.1)
        endless.sendall(b"1\r\na\r\n")
    assert closed_within(endless, 2.0)
    assert guard.closed["body_timeout"] == 1
    done = connect(port, head + b"3\r\nabc\r\n0\r\n\r\n")  # a body that ends is served
    assert done.recv(4096).startswith(b"HTTP/1.1 200")


def test_guard_when_a_keep_alive_connection_starts_a_head_it_never_ends_then_closed(serve) -> None:
    port, _ = serve(header_timeout_s=0.5)
    s = connect(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the next head, never finished: uvicorn's keep-alive
    assert closed_within(s, 2.0)  # timer stops at its first byte, the head deadline does not


def test_guard_when_at_the_cap_then_the_oldest_unfinished_goes_and_the_new_request_is_served(serve) -> None:
    port, guard = serve(cap=3, header_timeout_s=30, body_timeout_s=30)
    slow = [connect(port, b"GET / HTTP/1.1\r\nHost: x\r\n") for _ in range(3)]
    time.sleep(0.2)
    assert get(port).startswith(b"HTTP/1.1 200")  # /health's case: a fresh request gets in
    assert closed_within(slow[0], 2.0) and not closed_within(slow[1], 0.2)
    assert guard.closed["evicted"] == 1
    for s in slow:
        s.close()


def test_guard_when_silent_connections_flood_the_cap_then_a_slow_honest_upload_is_not_the_one_closed(
    serve,
) -> None:
    """An upload sending its body slowly, then connections that send nothing, each opened within the head's
    grace of a second but silent past SILENT_GRACE_S (0.1 s) when the next comes: at the cap the silent
    ones make room, and the upload completes."""
    port, guard = serve(cap=4, header_timeout_s=30, body_timeout_s=30)
    body = b"x" * 40
    upload = connect(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n" + body[:10])
    time.sleep(0.1)
    silent = []
    for i in range(6):  # one every 0.15 s, while the upload sends 10 bytes every 0.3 s
        silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.15)
        if i % 2 and 10 * (i // 2 + 1) < 40:
            upload.sendall(body[10 * (i // 2 + 1) : 10 * (i // 2 + 2)])  # the rest of its 40 bytes
    upload.settimeout(5)
    assert upload.recv(4096).startswith(b"HTTP/1.1 200")
    assert guard.closed["evicted"] >= 3  # silent ones
    for s in [upload, *silent]:
        s.close()


def test_accept_failures_when_thousands_then_logged_once_with_the_count(caplog) -> None:
    handler = rate_limited_exception_handler()
    loop = asyncio.new_event_loop()
    try:
        caplog.set_level(logging.ERROR)
        for _ in range(5000):
            handler(loop, {"message": ACCEPT_FAILED, "exception": OSError(24, "Too many open files")})
    finally:
        loop.close()
    records = [r for r in caplog.records if "accept() failed" in r.getMessage()]
    assert len(records) == 1 and "Too many open files" in records[0].getMessage()
