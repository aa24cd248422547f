"""The upstream's Server-Sent Events, parsed with every line bounded (server/routing/sse_reader.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from server.routing.sse_reader import LineTooLong, sse_events
from tests import aio


async def pieces(*chunks: bytes) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


def events(*chunks: bytes, max_bytes: int = 1000) -> list[tuple[str, str]]:
    async def collect() -> list[tuple[str, str]]:
        return [e async for e in sse_events(pieces(*chunks), max_bytes)]

    return aio.run(collect())


def test_sse_when_split_anywhere_then_the_same_events() -> None:
    stream = (
        b'data: {"a": 1}\r\n\r\n: a comment\n\nevent: governor\ndata: x\n\n'
        b"data: one\ndata: two\n\nid: 3\ndata: [DONE]\n\n"
    )
    want = [("message", '{"a": 1}'), ("governor", "x"), ("message", "one\ntwo"), ("message", "[DONE]")]
    assert events(stream) == want
    assert events(*[stream[i : i + 1] for i in range(len(stream))]) == want  # a byte at a time


def test_sse_when_a_line_is_over_the_bound_then_fails_before_reading_it_all() -> None:
    read = []

    async def endless() -> AsyncIterator[bytes]:
        yield b"data: "
        while True:
            read.append(1)
            yield b"x" * 100

    async def first() -> None:
        async for _ in sse_events(endless(), 1000):
            pass

    with pytest.raises(LineTooLong):
        aio.run(first())
    assert len(read) == 10  # stopped at the bound, not at the end of the line


def test_sse_when_many_data_lines_add_up_over_the_bound_then_fails() -> None:
    with pytest.raises(LineTooLong, match="data"):
        events(b"data: " + b"x" * 600 + b"\n" + b"data: " + b"y" * 600 + b"\n\n")
