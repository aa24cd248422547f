"""Token events -> SSE events.

Two parts, kept apart as sse-starlette keeps its encoder apart from its transport:
- `Coalescer`: pure, clock passed in. The first token goes out at once; after that, tokens are held and
  flushed at most once per interval, and whatever is left goes out at the end.
- `coalesced`: reads the job's event queue, asks the coalescer what to send and yields batches, then the
  end (or the error); whatever ends the stream, the job is cancelled unless it finished.
- `encode`: the one dispatch of those items to a dialect's `StreamEncoder`, one method per kind of item.
  `ChunkEncoder` is OpenAI's (`sse_stream`, handed to `EventSourceResponse`: every stream ends with a final
  chunk, or an error chunk, then `data: [DONE]`); Ollama's NDJSON and the Responses API's events have their
  encoders in their own route modules.

How a stream ends (each path sends [DONE] except the last):
  Switched              -> held text goes out; later chunks name the new model (+ `event: governor`)
  FinishEvent           -> last text + finish_reason (+ usage chunk) -> [DONE]
  Failed (engine error) -> pending text, error chunk -> [DONE]
  Failed (shutdown)     -> pending text, error chunk server_shutting_down -> [DONE]
  client gone           -> sse-starlette cancels us; `finally` fires the job's CancelToken (nothing sent)

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
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from sse_starlette import EventSourceResponse
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from models.types import FinishEvent, TokenEvent
from server.api.openai.protocol import ChunkBuilder
from server.http.errors import error_payload
from server.serving.events import Failed, GovernorState, Started, Switched
from server.serving.worker import Job

DONE = "[DONE]"


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


def _data(obj: dict) -> dict:
    return {"data": json.dumps(obj, separators=(",", ":"), ensure_ascii=False)}


def error_chunk(err: BaseException) -> dict:
    _, body, _ = error_payload(err)
    return _data(body)


# What `coalesced` yields: the worker's events with token text batched (GovernorState and Started pass as
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


Item = Batch | End | Error | GovernorState | Started | Switched


def switch_report(item: Switched) -> dict[str, Any]:
    """A move to another model as every dialect's stream reports it (old, new, reason, tokens_before)."""
    return {
        "old": item.old,
        "new": f"{item.model_id}/{item.variant}",
        "reason": item.reason,
        "tokens_before": item.tokens,
    }


def governor_event(job: Job, item: GovernorState | Switched) -> dict[str, str] | None:
    """The `event: governor` SSE event of a governor state, or of a move to another model, for a stream
    that asked for them (`governor_events: true`); None otherwise: SDKs do not expect named events. Every
    SSE dialect (OpenAI's chunks, the Responses API's events) sends the same."""
    if not job.request.show.governor_events:
        return None
    data = item.state if isinstance(item, GovernorState) else {"switch": switch_report(item)}
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
            elif isinstance(item, GovernorState | Started):
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

    def governor(self, item: GovernorState) -> Iterable[Any]: ...


async def encode(items: AsyncIterator[Item], encoder: StreamEncoder) -> AsyncIterator[Any]:
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


@dataclass
class ChunkEncoder:
    """OpenAI's chat and text completion chunks."""

    job: Job
    builder: ChunkBuilder
    include_usage: bool

    def opening(self) -> Iterable[dict[str, Any]]:
        return ()

    def batch(self, item: Batch) -> Iterable[dict[str, Any]]:
        return [_data(chunk) for chunk in self.builder.delta(item.text, item.events)]

    def end(self, item: End) -> Iterable[dict[str, Any]]:
        out = [_data(chunk) for chunk in self.builder.delta(item.text, item.events, item.finish)]
        if self.include_usage:
            out.append(_data(self.builder.usage(item.finish)))
        return [*out, {"data": DONE}]

    def error(self, item: Error) -> Iterable[dict[str, Any]]:
        held = self.builder.delta(item.text, item.events) if item.events else ()
        return [*(_data(chunk) for chunk in held), error_chunk(item.error), {"data": DONE}]

    def started(self, item: Started) -> Iterable[dict[str, Any]]:
        self.builder.started(item.model_id, item.variant)
        return ()

    def switched(self, item: Switched) -> Iterable[dict[str, Any]]:
        # the reply goes on on another model: later chunks name it (the held text left before)
        self.builder.started(item.model_id, item.variant)
        event = governor_event(self.job, item)
        return [event] if event is not None else []

    def governor(self, item: GovernorState) -> Iterable[dict[str, Any]]:
        event = governor_event(self.job, item)
        return [event] if event is not None else []


def sse_stream(
    job: Job,
    events: asyncio.Queue,
    builder: ChunkBuilder,
    *,
    interval_s: float,
    include_usage: bool,
    on_end: Callable[[FinishEvent | None, BaseException | None, int], None],
    clock: Callable[[], float] = time.monotonic,
    first: Iterable[object] = (),
) -> AsyncIterator[dict[str, Any]]:
    """Yield sse-starlette event dicts for one job until [DONE]. `first`: as for `coalesced`."""
    stream = coalesced(job, events, interval_s=interval_s, on_end=on_end, clock=clock, first=first)
    return encode(stream, ChunkEncoder(job, builder, include_usage))


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
