"""Token events -> SSE events.

Two parts, kept apart as sse-starlette keeps its encoder apart from its transport:
- `Coalescer`: pure, clock passed in. The first token goes out at once; after that, tokens are held and
  flushed at most once per interval, and whatever is left goes out at the end.
- `coalesced`: reads the job's event queue, asks the coalescer what to send and yields batches, then the
  end (or the error); whatever ends the stream, the job is cancelled unless it finished.
- `encode`: the one dispatch of those items to a dialect's `StreamEncoder`, one method per kind of item.
  Each dialect's encoder is its own: OpenAI's chunks, Ollama's NDJSON and the Responses API's events
  (each in its dialect's render.py).

Whatever ends the stream (the finish, an error, a shutdown, the client gone: sse-starlette cancels us), the
job's CancelToken fires unless it finished.

`on_end(finish, failure, sent_tokens)` runs once at the end, whichever way; `sent_tokens` counts the tokens
whose chunk went out (`coalesced` resumes after a yield only once its consumer sent what it encoded).
`JobEventSource` adds a last resort for a response cancelled before its generator ever ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from sse_starlette import EventSourceResponse
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from models.types import FinishEvent, TokenEvent
from server.serving.contracts import Job
from server.serving.events import Failed, GovernorUpdate, Started, Switched


class Coalescer:
    """Decides when held token text is flushed. Pure: the caller passes `now` (seconds)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._pending: list[TokenEvent] = []
        self._last_flush: float | None = None  # None until the first visible text went out

    def add(self, event: TokenEvent, now: float) -> list[TokenEvent] | None:
        """Hold `event`; return the batch to send now, or None to keep holding."""
        self._pending.append(event)
        if self._last_flush is None:
            # First token at once; an empty delta (bytes held back by the detokenizer) does not count,
            # a tool-call delta does.
            return self._take(now) if any(ev.text or ev.tool_calls for ev in self._pending) else None
        if now >= self._last_flush + self.interval_s:
            return self._take(now)
        return None

    def deadline(self) -> float | None:
        """When held text must be flushed (None: nothing held, or nothing sent yet)."""
        if not self._pending or self._last_flush is None:
            return None
        return self._last_flush + self.interval_s

    def flush(self, now: float) -> list[TokenEvent]:
        """Everything held (the timer fired, or the stream ends)."""
        return self._take(now)

    def _take(self, now: float) -> list[TokenEvent]:
        batch, self._pending = self._pending, []
        if batch:
            self._last_flush = now
        return batch


# What `coalesced` yields: the worker's events with token text batched (GovernorUpdate and Started pass as
# they are). Every dialect's stream (SSE chunks, Ollama's NDJSON, Responses events) is an encoder of these.
@dataclass(frozen=True)
class Batch:
    """Token events to send now (one coalesced delta)."""

    events: list[TokenEvent]

    @property
    def text(self) -> str:
        return "".join(ev.text for ev in self.events)


@dataclass(frozen=True)
class End:
    """The generation finished: the tokens still held, then the finish (its `text` is the last bytes)."""

    events: list[TokenEvent]
    finish: FinishEvent

    @property
    def text(self) -> str:
        return "".join(ev.text for ev in self.events) + self.finish.text


@dataclass(frozen=True)
class Error:
    """The generation failed: the tokens still held (send them first), then the error."""

    events: list[TokenEvent]
    error: BaseException

    @property
    def text(self) -> str:
        return "".join(ev.text for ev in self.events)


Item = Batch | End | Error | GovernorUpdate | Started | Switched


def switch_report(item: Switched) -> dict[str, Any]:
    """A move to another model as every dialect's stream reports it (old, new, reason, tokens_before)."""
    return {
        "old": item.old,
        "new": f"{item.model_id}/{item.variant}",
        "reason": item.reason,
        "tokens_before": item.tokens,
    }


def governor_event(job: Job, item: GovernorUpdate | Switched) -> dict[str, str] | None:
    """The `event: governor` SSE event of a governor state, or of a move to another model, for a stream
    that asked for them (`governor_events: true`); None otherwise: SDKs do not expect named events. Every
    SSE dialect (OpenAI's chunks, the Responses API's events) sends the same."""
    if not job.request.show.governor_events:
        return None
    data = item.state if isinstance(item, GovernorUpdate) else {"switch": switch_report(item)}
    return {"event": "governor", "data": json.dumps(data, separators=(",", ":"))}


async def coalesced(
    job: Job,
    events: asyncio.Queue,
    *,
    interval_s: float,
    on_end: Callable[[FinishEvent | None, BaseException | None, int], None],
    clock: Callable[[], float] = time.monotonic,
    first: Iterable[object] = (),
) -> AsyncIterator[Item]:
    """The job's events until End or Error (the last item). However the stream ends, including the
    consumer going away (cancelled or closed: use contextlib.aclosing), the job is cancelled unless it
    finished, and `on_end(finish, error, tokens sent)` runs once. A batch counts as sent once the consumer
    asks for the next item. `first`: events already taken off the queue (by the route, while it held the
    headers), handled before the queue."""
    coalescer = Coalescer(interval_s)
    finish: FinishEvent | None = None
    failure: BaseException | None = None
    sent_tokens = 0
    held = deque(first)
    try:
        while True:
            deadline = coalescer.deadline()
            timeout = None if deadline is None else max(0.0, deadline - clock())
            try:
                item = held.popleft() if held else await asyncio.wait_for(events.get(), timeout)
            except TimeoutError:
                batch = coalescer.flush(clock())
                yield Batch(batch)
                sent_tokens += len(batch)
                continue
            if isinstance(item, TokenEvent):
                batch = coalescer.add(item, clock())
                if batch:
                    yield Batch(batch)
                    sent_tokens += len(batch)
            elif isinstance(item, FinishEvent):
                finish = item
                batch = coalescer.flush(clock())
                yield End(batch, item)
                sent_tokens += len(batch)
                return
            elif isinstance(item, Failed):
                failure = item.error
                batch = coalescer.flush(clock())
                yield Error(batch, item.error)
                sent_tokens += len(batch)
                return
            elif isinstance(item, Switched):
                # the reply goes on on another model: the text held so far leaves under the old name
                batch = coalescer.flush(clock())
                if batch:
                    sent_tokens += len(batch)
                    yield Batch(batch)
                yield item
            elif isinstance(item, GovernorUpdate | Started):
                yield item
    finally:
        if finish is None:
            # Client gone or error: free the worker (a no-op if the engine already finished).
            job.cancel.cancel()
        on_end(finish, failure, sent_tokens)


class StreamEncoder(Protocol):
    """One dialect's stream: what each item of `coalesced` becomes on the wire (SSE event dicts, NDJSON
    lines). `encode` calls exactly one method per item, in order."""

    def opening(self) -> Iterable[Any]:
        """Before any item."""
        ...

    def batch(self, item: Batch) -> Iterable[Any]: ...

    def end(self, item: End) -> Iterable[Any]:
        """The held tokens and the finish: the last item."""
        ...

    def error(self, item: Error) -> Iterable[Any]:
        """The held tokens and the error: the last item."""
        ...

    def started(self, item: Started) -> Iterable[Any]:
        """The worker (or the upstream) started the job on this model."""
        ...

    def switched(self, item: Switched) -> Iterable[Any]:
        """The reply goes on on another model (the held text went out before, under the old one)."""
        ...

    def governor(self, item: GovernorUpdate) -> Iterable[Any]: ...


async def encode(items: AsyncIterator[Item], encoder: StreamEncoder) -> AsyncGenerator[Any, None]:
    """The one dispatch of a stream's items to its encoder. Closing this closes `items` (so the job is
    cancelled and its end accounted, however the stream ends)."""
    for out in encoder.opening():
        yield out
    async with contextlib.aclosing(items):
        async for item in items:
            if isinstance(item, Batch):
                outs = encoder.batch(item)
            elif isinstance(item, End):
                outs = encoder.end(item)
            elif isinstance(item, Error):
                outs = encoder.error(item)
            elif isinstance(item, Started):
                outs = encoder.started(item)
            elif isinstance(item, Switched):
                outs = encoder.switched(item)
            else:
                outs = encoder.governor(item)
            for out in outs:
                yield out


async def interleaved(streams: list[AsyncGenerator[Any, None]]) -> AsyncIterator[Any]:
    """Every item of several streams as each comes (streams read at once, ties in list order); ends when
    all have ended. However it ends, every stream is closed (so each job is cancelled and accounted)."""
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield item
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        # a stream is closed only once its pending read let go of it (closing a running one raises)
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


class _ClosesJob:
    """Calls `on_close()` however the response ends. A generator's own `finally` does not run when the
    response is cancelled before the generator first ran (the client left, or the server shut down, while
    the headers were being sent): the job would run on for nobody, unaccounted."""

    _on_close: Callable[[], None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)  # type: ignore[misc]
        finally:
            self._on_close()


class JobEventSource(_ClosesJob, EventSourceResponse):
    """An EventSourceResponse for one job's stream (SSE dialects)."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close


class JobStreamingResponse(_ClosesJob, StreamingResponse):
    """A StreamingResponse for one job's stream (Ollama's NDJSON)."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close
