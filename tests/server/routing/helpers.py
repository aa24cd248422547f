"""Routing tests' helpers: a chat body, streaming it and reading its SSE chunks and text, and a router's
local side over a list of submitted jobs."""

from __future__ import annotations

import json

import httpx

from server.routing.sides import LocalSide
from tests.server.requests import chat_request
from tests.server.routing.conftest import MODEL

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "the cat sat"}],
    "temperature": 0,
    "max_tokens": 12,
}


def sse_chunks(response: httpx.Response) -> tuple[list[dict], bool]:
    """The JSON chunks of a stream, and whether it ended with [DONE]."""
    chunks, done = [], False
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            chunks.append(json.loads(data))
    return chunks, done


def stream(
    srv, path: str, body: dict, headers: dict | None = None
) -> tuple[httpx.Response, list[dict], bool]:
    with (
        httpx.Client(base_url=srv.url, timeout=30) as c,
        c.stream(
            "POST",
            path,
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
            headers=headers,
        ) as r,
    ):
        if r.status_code != 200:
            r.read()
            return r, [], False
        chunks, done = sse_chunks(r)
        return r, chunks, done


def text_of(chunks: list[dict], kind: str) -> str:
    out = ""
    for c in chunks:
        for choice in c.get("choices", []):
            out += (choice["delta"].get("content") or "") if kind == "chat" else choice["text"]
    return out


REQUEST = chat_request()


def local_side(submitted: list) -> LocalSide:
    return LocalSide(
        served_ids=lambda: {"m"},
        default_model=lambda: "m",
        state=lambda: "ready",
        queue_full=lambda: False,
        submit=submitted.append,
    )
