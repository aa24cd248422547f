"""A scripted OpenAI-compatible upstream: a real HTTP server (uvicorn, in a thread) whose answer the test
sets, and which records what it received. For the cases a real server will not produce on demand: a 429
with Retry-After, a 400 that quotes the key, an error event mid-stream, a stream that is not JSON."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Script:
    status: int = 200
    body: dict | str | None = None  # a non-200 body
    headers: dict[str, str] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)  # raw SSE `data:` payloads for a 200
    event_delay_s: float = 0.0


def chat_chunk(text: str, finish: str | None = None) -> str:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return json.dumps({"id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [choice]})


class ScriptedUpstream:
    def __init__(self, *, certfile: str | None = None, keyfile: str | None = None) -> None:
        self.scheme = "https" if certfile else "http"
        self.script = Script(events=[chat_chunk("hello"), chat_chunk(" world", "stop"), "[DONE]"])
        self.received: list[tuple[dict, dict[str, str]]] = []  # (json body, headers)
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._handle, methods=["POST"]),
                Route("/v1/completions", self._handle, methods=["POST"]),
            ]
        )
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", ssl_certfile=certfile, ssl_keyfile=keyfile
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/v1"

    def start(self) -> ScriptedUpstream:
        self._thread.start()
        started = threading.Event()
        for _ in range(500):
            if self._server.started:
                return self
            started.wait(0.01)
        raise RuntimeError("scripted upstream did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    async def _handle(self, request: Request) -> Response:
        self.received.append((await request.json(), {k.lower(): v for k, v in request.headers.items()}))
        s = self.script
        if s.status != 200:
            content = json.dumps(s.body) if isinstance(s.body, dict) else (s.body or "")
            return Response(content, status_code=s.status, headers=s.headers, media_type="application/json")

        async def events():
            for data in s.events:
                if s.event_delay_s:
                    await asyncio.sleep(s.event_delay_s)
                yield f"data: {data}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream", headers=s.headers)
