"""A live uvicorn on a free port, in a thread, serving create_app() with a recorded engine."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from models.protocol import Engine
from server.app import create_app
from server.serving.grammars import LLGUIDANCE, Grammars
from server.settings import Settings
from tests.conftest import _convert_into
from tests.server.fakes import RecordingEngine, ScriptedEngine
from tests.tiny_gguf import FAMILY_SPECS, write_tiny_gguf

MODEL = "scripted-test"


@dataclass
class LiveServer:
    url: str
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    settings: Settings
    engine: RecordingEngine | None

    @property
    def host_header(self) -> str:
        return self.url.removeprefix("http://")

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def make_settings(tmp_path: Path, **overrides) -> Settings:
    base = {"home": tmp_path, "model": MODEL, "stream_interval_ms": 50, "max_queue": 16, "keep_alive_s": -1}
    return Settings(**{**base, **overrides})


def start_server(
    settings: Settings,
    *,
    engine: Engine | None = None,
    engine_factory: Callable[[], Engine] | None = None,
    served=None,
    governor=None,
    breaker=None,
    grammars: Grammars = LLGUIDANCE,
) -> LiveServer:
    app = create_app(
        settings,
        engine=engine,
        engine_factory=engine_factory,
        served=served,
        governor=governor,
        breaker=breaker,
        grammars=grammars,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    started = threading.Event()
    for _ in range(500):
        if server.started:
            started.set()
            break
        started.wait(0.01)
    assert server.started, "uvicorn did not start"
    recorder = engine if isinstance(engine, RecordingEngine) else None
    return LiveServer(f"http://127.0.0.1:{port}", app, server, thread, settings, recorder)


@pytest.fixture(scope="session")
def tiny_long_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a 4,096-token context: room for a tools description (structured output and
    tool calls in every dialect: what parses parses because of the grammar)."""
    from dataclasses import replace

    root = tmp_path_factory.mktemp("tiny-long")
    gguf = write_tiny_gguf(
        root / "tiny.gguf", matrix_type="Q4_1", spec=replace(FAMILY_SPECS["llama"], context_length=4096)
    )
    return _convert_into(gguf, root / "tiny-long", variants=["q4", "f32"], measure=False, threads=1)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """live(token_delay_s=..., **settings) -> LiveServer with a RecordingEngine(ScriptedEngine), or what
    `engine=`, `engine_factory=` or `served=` (server/serving/model_setup.py builds one) give."""
    servers: list[LiveServer] = []

    def make(
        *,
        engine: Engine | None = None,
        engine_factory: Callable[[], Engine] | None = None,
        token_delay_s: float = 0.0,
        reply_tokens: int | None = None,
        context_length: int = 512,
        fail_after_tokens: int | None = None,
        served=None,
        governor=None,
        breaker=None,
        grammars: Grammars = LLGUIDANCE,
        **settings_overrides,
    ) -> LiveServer:
        if engine is None and engine_factory is None and served is None:
            inner = ScriptedEngine(
                model_id=MODEL,
                token_delay_s=token_delay_s,
                reply_tokens=reply_tokens,
                context_length=context_length,
            )
            engine = RecordingEngine(inner, fail_after_tokens=fail_after_tokens)
        srv = start_server(
            make_settings(tmp_path, **settings_overrides),
            engine=engine,
            engine_factory=engine_factory,
            served=served,
            governor=governor,
            breaker=breaker,
            grammars=grammars,
        )
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.stop()


def wait_ready(srv) -> None:
    """Until the live server's start model is loaded (/health 200 says "ok": it is 200 from the start)."""
    for _ in range(500):
        r = httpx.get(srv.url + "/health")
        if r.status_code == 200 and r.json()["status"] == "ok":
            return
        time.sleep(0.02)
    raise AssertionError(httpx.get(srv.url + "/health").text)


def responses_events(srv: LiveServer, body: dict) -> list[tuple[str | None, dict]]:
    """(event name, data) of each Server-Sent Event of a streamed /v1/responses request."""
    events, name = [], None
    with (
        httpx.Client(base_url=srv.url, timeout=30) as c,
        c.stream("POST", "/v1/responses", json={"stream": True, **body}) as r,
    ):
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
                name = None
    return events
