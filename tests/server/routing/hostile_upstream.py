"""A hostile OpenAI-compatible upstream: a real HTTP server in a process of its own (`HostileUpstream`
starts `python -m tests.server.routing.hostile_upstream PORT`: what it streams must not share the GIL with
the server under test) that answers each request as its last user message names it (`_behaviour`): a
gigabyte of valid chunks or of error body, a 100 MB line, comment pings or one byte at a time forever,
tokens slower than any deadline, absurd numbers. Its /v1/embeddings answers as the first input names it
(`_embedding_behaviour`): a gigabyte of JSON, NaN, the wrong number of vectors or of dimensions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

GB = 1 << 30
ROOT = Path(__file__).resolve().parents[3]


def chunk(text: str, finish: str | None = None, **extra) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish, **extra}
    body = {"id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n".encode()


async def gigabyte_of(block: bytes) -> AsyncIterator[bytes]:
    """`block` repeated to a gigabyte, in 64 KB writes (the server stops when its client leaves)."""
    piece = block * max(1, (64 << 10) // len(block))
    for _ in range(GB // len(piece)):
        yield piece


async def forever(data: bytes, every_s: float) -> AsyncIterator[bytes]:
    while True:
        yield data
        await asyncio.sleep(every_s)


async def one_by_one(*pieces: bytes, every_s: float = 0.0) -> AsyncIterator[bytes]:
    for p in pieces:
        yield p
        if every_s:
            await asyncio.sleep(every_s)


def stream(body: AsyncIterator[bytes]) -> Response:
    return StreamingResponse(body, media_type="text/event-stream")


def _behaviour(name: str) -> Response:
    if name == "ok":
        return stream(one_by_one(chunk("hello"), chunk(" world", "stop"), b"data: [DONE]\n\n"))
    if name == "endless":  # a gigabyte of valid chunks, one token each
        return stream(gigabyte_of(chunk("x")))
    if name == "error-gb":  # an HTTP 500 whose body is a gigabyte
        return StreamingResponse(gigabyte_of(b"e" * 1024), status_code=500, media_type="text/plain")
    if name == "long-line":  # one 100 MB line
        return stream(one_by_one(b"data: ", *([b"x" * (1 << 20)] * 100), b"\n\n"))
    if name == "pings":  # comments only, forever
        return stream(forever(b": ping\n\n", 0.05))
    if name == "drip":  # one byte at a time, never a whole event
        return stream(forever(b"d", 0.2))
    if name == "slow-tokens":  # a token every 0.3 s, forever: within any silence timeout
        return stream(forever(chunk("y"), 0.3))
    if name == "usage-400-digits":
        usage = '{"prompt_tokens": ' + "9" * 400 + ', "completion_tokens": 1, "total_tokens": 5}'
        last = b'data: {"choices": [], "usage": ' + usage.encode() + b"}\n\n"
        return stream(one_by_one(chunk("hi", "stop"), last, b"data: [DONE]\n\n"))
    if name == "logprob-overflow":  # a logprob of 1e400 (inf to a JSON parser) and one of 400 digits
        top = '[{"token": "hi", "logprob": -' + "9" * 400 + "}]"
        entries = '[{"token": "hi", "logprob": 1e400, "bytes": [104, 105], "top_logprobs": ' + top + "}]"
        text = (
            '{"choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": {"content": '
            + entries
            + '}, "finish_reason": "stop"}]}'
        )
        return stream(one_by_one(f"data: {text}\n\n".encode(), b"data: [DONE]\n\n"))
    if name == "delta-not-an-object":
        bad = b'data: {"choices": [{"index": 0, "delta": "x"}, {"index": 0, "delta": {"content": 5}}]}\n\n'
        return stream(one_by_one(bad, chunk("", "stop"), b"data: [DONE]\n\n"))
    return Response(json.dumps({"error": {"message": f"unknown behaviour {name!r}"}}), status_code=400)


def vectors(*rows: list) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    usage = {"prompt_tokens": 3, "total_tokens": 3}
    return json.dumps({"object": "list", "data": data, "model": "m", "usage": usage}).encode()


def _embedding_behaviour(name: str) -> Response:
    def answer(body: bytes | AsyncIterator[bytes]) -> Response:
        if isinstance(body, bytes):
            return Response(body, media_type="application/json")
        return StreamingResponse(body, media_type="application/json")

    if name == "ok":
        return answer(vectors([0.5, -0.25, 1.0]))
    if name == "gigabyte":  # a valid start, then a gigabyte of numbers
        head = b'{"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5'
        return answer(_after(head, gigabyte_of(b", 0.123456789")))
    if name == "nan":  # Python's JSON reads NaN; no other JSON does
        return answer(b'{"data": [{"index": 0, "embedding": [NaN, 0.5, 1.0]}]}')
    if name == "overflow":  # 1e400 is an infinity to a JSON parser; 400 digits are no float
        return answer(b'{"data": [{"index": 0, "embedding": [1e400, -' + b"9" * 400 + b", 1.0]}]}")
    if name == "two-vectors":  # one input, two vectors
        return answer(vectors([0.5, 0.5, 0.5], [1.0, 1.0, 1.0]))
    if name == "two-dimensions":  # the client asked for 3
        return answer(vectors([0.5, 0.5]))
    if name == "strings":
        return answer(vectors(["0.5", "0.5", True]))
    if name == "not-json":
        return answer(b"<html>hello</html>")
    if name == "drip":  # one byte at a time, forever
        return answer(forever(b" ", 0.2))
    if name == "error-gb":
        return StreamingResponse(gigabyte_of(b"e" * 1024), status_code=500, media_type="text/plain")
    return Response(json.dumps({"error": {"message": f"unknown behaviour {name!r}"}}), status_code=400)


async def _after(head: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield head
    async for piece in rest:
        yield piece


def app() -> Starlette:
    async def handle(request: Request) -> Response:
        body = await request.json()
        name = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        return _behaviour(str(name))

    async def embeddings(request: Request) -> Response:
        inputs = (await request.json())["input"]
        return _embedding_behaviour(str(inputs[0] if isinstance(inputs, list) else inputs))

    return Starlette(
        routes=[
            Route("/v1/chat/completions", handle, methods=["POST"]),
            Route("/v1/completions", handle, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
        ]
    )


class HostileUpstream:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> HostileUpstream:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.server.routing.hostile_upstream", str(self.port)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self._proc.poll() is None, "the hostile upstream exited"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self
            time.sleep(0.05)
        raise RuntimeError("the hostile upstream did not start")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)


if __name__ == "__main__":
    uvicorn.run(app(), host="127.0.0.1", port=int(sys.argv[1]), log_config=None, access_log=False)
