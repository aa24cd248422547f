"""Every exception ends as an OpenAI-shaped answer on a connection that stays usable, and /metrics counts
every answer by status."""

from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from server.http.errors import ErrorMiddleware

MSG = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def requests_total(client: httpx.Client) -> dict[tuple[str, str], float]:
    text = client.get("/metrics").text
    pattern = r'^simmer_requests_total\{route="([^"]*)",status="(\d+)"\} (\S+)$'
    return {(m[1], m[2]): float(m[3]) for m in re.finditer(pattern, text, re.M)}


def no_asgi_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]
    assert not [r for r in caplog.records if "ASGI callable returned without" in r.getMessage()]


def test_server_when_engine_raises_then_500_openai_shaped_and_keep_alive_connection_reused(
    live, caplog: pytest.LogCaptureFixture
) -> None:
    """After a 500 the pooled connection stays usable (it used to be reset: ECONNRESET on the next one)."""
    caplog.set_level(logging.INFO)
    srv = live(fail_after_tokens=0)  # the engine raises RuntimeError at its first token
    ports: list[int] = []

    def remember_port(response: httpx.Response) -> None:
        stream = response.extensions["network_stream"]
        ports.append(stream.get_extra_info("socket").getsockname()[1])

    with srv.client(event_hooks={"response": [remember_port]}) as client:
        bad = client.post("/v1/chat/completions", json=MSG)
        assert bad.status_code == 500
        assert bad.json()["error"] == {
            "message": "Internal server error",
            "type": "server_error",
            "code": "internal_error",
            "param": None,
        }
        assert bad.headers.get("connection") != "close"
        good = client.get("/v1/models")
        assert good.status_code == 200
        again = client.post("/v1/chat/completions", json=MSG)
        assert again.status_code == 500
    assert len(set(ports)) == 1  # one connection served all three
    no_asgi_tracebacks(caplog)
    assert any("injected engine failure" in str(r.exc_info) for r in caplog.records if r.exc_info)


def test_server_when_engine_raises_mid_stream_then_error_chunk_done_and_connection_reused(
    live, caplog: pytest.LogCaptureFixture
) -> None:
    srv = live(fail_after_tokens=2)
    with srv.client() as client:
        body = {**MSG, "max_tokens": 8, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            data = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200
        assert '"code":"internal_error"' in data[-2] and data[-1] == "data: [DONE]"
        assert client.get("/health").status_code == 200
    no_asgi_tracebacks(caplog)


# ---- ErrorMiddleware alone, on uvicorn, around an app that raises before or after it started answering ----


async def raising_app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/ok":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    if scope["path"] == "/after-start":
        await send({"type": "http.response.start", "status": 200, "headers": []})  # chunked
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})
    raise ValueError("boom")


@pytest.fixture
def raising_server() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(ErrorMiddleware(raising_app), log_config=None, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    started = threading.Event()
    while not server.started:
        started.wait(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_error_middleware_when_app_raises_before_answering_then_500_and_connection_kept(
    raising_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    with httpx.Client(base_url=raising_server) as client:
        r = client.get("/before-start")
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert client.get("/ok").text == "ok"
    no_asgi_tracebacks(caplog)


def test_error_middleware_when_app_raises_mid_chunked_body_then_body_ended_and_connection_kept(
    raising_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    with httpx.Client(base_url=raising_server) as client:
        r = client.get("/after-start")
        assert (r.status_code, r.text) == (200, "partial")
        assert client.get("/ok").text == "ok"
    no_asgi_tracebacks(caplog)


# ---- /metrics counts every answer ----


def test_metrics_when_refusals_and_500s_then_every_response_counted_by_status(live) -> None:
    """The 500s, the Host 403s and the Content-Length 413s are counted (they used not to be)."""
    srv = live(fail_after_tokens=0, api_key="k", max_body_bytes=2000)
    chat = "/v1/chat/completions"
    with srv.client(headers={"Authorization": "Bearer k"}) as client:
        assert client.post(chat, json=MSG).status_code == 500
        assert client.post(chat, json=MSG, headers={"Host": "evil.example"}).status_code == 403
        assert client.post(chat, json=MSG, headers={"Authorization": ""}).status_code == 401
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        assert client.post(chat, json=big).status_code == 413
        assert client.get("/nowhere").status_code == 404
        assert client.delete("/v1/models").status_code == 405
        assert client.post(chat, json={"messages": []}).status_code == 400
        counts = requests_total(client)
    for status in ("500", "403", "401", "413", "400"):
        assert counts.get((chat, status)) == 1.0, (status, counts)
    assert counts.get(("other", "404")) == 1.0
    assert counts.get(("/v1/models", "405")) == 1.0
