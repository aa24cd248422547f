"""Server-Sent Events from an upstream's bytes, with every line bounded.

httpx-sse reads a whole line before looking at it, so an upstream that sends 100 MB without a newline has
100 MB held in memory. Here a line (and an event's data, its `data:` lines together) longer than
`max_bytes` fails at once, without reading further (the caller closes the response). Parsing follows the
SSE specification: `data:` lines joined by newlines, `event:` names the event, comments (`:`) and other
fields ignored, a blank line dispatches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator


class LineTooLong(Exception):
    pass


async def sse_events(chunks: AsyncIterator[bytes], max_bytes: int) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) for each event ("message" when unnamed)."""
    pending = bytearray()  # the bytes of the line being read
    data: list[str] = []
    data_bytes = 0
    name = ""
    async for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                pending += chunk[start:]
                if len(pending) > max_bytes:
                    raise LineTooLong(f"an event line is over {max_bytes} bytes")
                break
            pending += chunk[start:end]
            start = end + 1
            if len(pending) > max_bytes:
                raise LineTooLong(f"an event line is over {max_bytes} bytes")
            line = pending.rstrip(b"\r").decode("utf-8", "replace")
            pending.clear()
            if not line:
                if data:
                    yield name or "message", "\n".join(data)
                data, data_bytes, name = [], 0, ""
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                data_bytes += len(value) + 1
                if data_bytes > max_bytes:
                    raise LineTooLong(f"an event's data is over {max_bytes} bytes")
                data.append(value)
            elif field == "event":
                name = value
    if data:  # a last event without its blank line: the stream ended, what came is still an event
        yield name or "message", "\n".join(data)
