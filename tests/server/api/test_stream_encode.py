"""The one dispatch of a stream's items (`encode`): every item reaches exactly its encoder's method, in
order, after the opening; closing the encoded stream closes the items (the job's end is accounted)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from models.types import FinishEvent, Timings, TokenEvent, Usage
from server.api.common.streaming import Batch, End, Error, Item, encode
from server.serving.events import GovernorUpdate, Started, Switched
from tests import aio

TOKEN = TokenEvent(1, "hi", 0)
FINISH = FinishEvent("stop", Usage(1, 1), Timings(0.0, 0.0, 0.0, 0.0))
ITEMS: list[Item] = [
    Started(prompt_tokens=1, truncated=False, model_id="a"),
    Batch([TOKEN]),
    GovernorUpdate({"level": "warm"}),
    Switched("a/q4", "b", "q4", "rung moved", 1),
    Batch([TOKEN]),
    End([TOKEN], FINISH),
]


class Recording:
    """A StreamEncoder that says which method each item reached."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def _out(self, name: str, item: Any = None) -> list[str]:
        self.seen.append((name, item))
        return [name]

    def opening(self) -> list[str]:
        return self._out("opening")

    def batch(self, item: Batch) -> list[str]:
        return self._out("batch", item)

    def end(self, item: End) -> list[str]:
        return self._out("end", item)

    def error(self, item: Error) -> list[str]:
        return self._out("error", item)

    def started(self, item: Started) -> list[str]:
        return self._out("started", item)

    def switched(self, item: Switched) -> list[str]:
        return self._out("switched", item)

    def governor(self, item: GovernorUpdate) -> list[str]:
        return self._out("governor", item)


class Items:
    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[Item]:
        try:
            for item in self.items:
                yield item
        finally:
            self.closed = True


def drain(stream: AsyncIterator[Any], limit: int | None = None) -> list[Any]:
    async def run() -> list[Any]:
        out = []
        async for x in stream:
            out.append(x)
            if limit is not None and len(out) == limit:
                await stream.aclose()  # type: ignore[attr-defined]
                break
        return out

    return aio.run(run())


def test_encode_when_every_kind_of_item_then_each_reaches_its_method_in_order() -> None:
    source = Items(ITEMS)
    recording = Recording()
    out = drain(encode(source.__aiter__(), recording))
    assert out == ["opening", "started", "batch", "governor", "switched", "batch", "end"]
    assert [item for _, item in recording.seen[1:]] == ITEMS
    assert source.closed


def test_encode_when_an_error_ends_it_then_the_error_method_is_last() -> None:
    failure = Error([TOKEN], RuntimeError("boom"))
    out = drain(encode(Items([Batch([TOKEN]), failure]).__aiter__(), Recording()))
    assert out == ["opening", "batch", "error"]


def test_encode_when_the_consumer_leaves_midway_then_the_items_are_closed() -> None:
    source = Items(ITEMS)
    items = source.__aiter__()
    out = drain(encode(items, Recording()), limit=3)
    assert out == ["opening", "started", "batch"] and source.closed
