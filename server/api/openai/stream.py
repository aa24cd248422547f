"""OpenAI's answers to /v1/chat/completions and /v1/completions: one chat.completion / text_completion
body, or its chunks as Server-Sent Events (handed to `EventSourceResponse`).

How a stream ends (each path sends [DONE] except the last):
  Switched              -> held text goes out; later chunks name the new model (+ `event: governor`)
  FinishEvent           -> last text + finish_reason (+ usage chunk) -> [DONE]
  Failed (engine error) -> pending text, error chunk -> [DONE]
  Failed (shutdown)     -> pending text, error chunk server_shutting_down -> [DONE]
  client gone           -> sse-starlette cancels us; `finally` fires the job's CancelToken (nothing sent)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse, Response

from models.types import FinishEvent, TokenEvent
from server.api.common.flow import Generation
from server.api.common.streaming import (
    Batch,
    End,
    Error,
    JobEventSource,
    coalesced,
    encode,
    governor_event,
    interleaved,
)
from server.api.openai.protocol import (
    ChunkBuilder,
    chat_completion,
    merged_choices,
    summed_usage,
    text_completion,
)
from server.http.errors import error_payload
from server.serving.events import GovernorState, Started, Switched

if TYPE_CHECKING:
    from server.serving.worker import Job

DONE = "[DONE]"


def _data(obj: dict) -> dict:
    return {"data": json.dumps(obj, separators=(",", ":"), ensure_ascii=False)}


def error_chunk(err: BaseException) -> dict:
    _, body, _ = error_payload(err)
    return _data(body)


@dataclass
class ChunkEncoder:
    """OpenAI's chat and text completion chunks. One of a request's several choices (`alone` False) sends
    neither its usage nor [DONE] (`choices_stream` sends them once all have ended) and leaves the governor's
    events to choice 0."""

    job: Job
    builder: ChunkBuilder
    include_usage: bool
    alone: bool = True
    usage_chunk: dict | None = None  # a choice's usage, kept for `choices_stream`

    def opening(self) -> Iterable[dict[str, Any]]:
        return ()

    def batch(self, item: Batch) -> Iterable[dict[str, Any]]:
        return [_data(chunk) for chunk in self.builder.delta(item.text, item.events)]

    def end(self, item: End) -> Iterable[dict[str, Any]]:
        out = [_data(chunk) for chunk in self.builder.delta(item.text, item.events, item.finish)]
        if not self.alone:
            self.usage_chunk = self.builder.usage(item.finish)
            return out
        if self.include_usage:
            out.append(_data(self.builder.usage(item.finish)))
        return [*out, {"data": DONE}]

    def error(self, item: Error) -> Iterable[dict[str, Any]]:
        held = self.builder.delta(item.text, item.events) if item.events else ()
        done = [{"data": DONE}] if self.alone else []
        return [*(_data(chunk) for chunk in held), error_chunk(item.error), *done]

    def started(self, item: Started) -> Iterable[dict[str, Any]]:
        self.builder.started(item.model_id, item.variant)
        return ()

    def switched(self, item: Switched) -> Iterable[dict[str, Any]]:
        # the reply goes on on another model: later chunks name it (the held text left before)
        self.builder.started(item.model_id, item.variant)
        event = governor_event(self.job, item)
        return [event] if event is not None else []

    def governor(self, item: GovernorState) -> Iterable[dict[str, Any]]:
        event = governor_event(self.job, item) if self.builder.index == 0 else None
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


async def choices_stream(
    streams: list[tuple[Generation, ChunkBuilder]], *, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a request's n choices in one stream, as OpenAI sends them: each choice's chunks carry
    its index and come as they are made; one usage chunk (the prompt once, completion tokens added up)
    once every choice has ended, then one [DONE]. A choice that fails sends its error chunk; the others
    go on."""
    encoders = [ChunkEncoder(gen.job, builder, include_usage, alone=False) for gen, builder in streams]
    sources = [
        encode(gen.events_until_end(), encoder) for (gen, _), encoder in zip(streams, encoders, strict=True)
    ]
    async for out in interleaved(sources):
        yield out
    usages = [encoder.usage_chunk for encoder in encoders]
    if include_usage and all(usages):
        chunk = dict(usages[0] or {})
        chunk["usage"] = summed_usage([u["usage"] for u in usages if u])
        yield _data(chunk)
    yield {"data": DONE}


@dataclass
class OpenAIRenderer:
    kind: Literal["chat", "text"]
    include_usage: bool

    def reply(self, gen: Generation, tokens: list[TokenEvent], finish: FinishEvent) -> Response:
        text = "".join(ev.text for ev in tokens) + finish.text
        build = chat_completion if self.kind == "chat" else text_completion
        # the model that finished the reply (the governor may have moved it to another one mid-way)
        body = build(gen.rid, finish.model_id or gen.model, text, tokens, finish, finish.variant)
        body["route"] = gen.route.as_dict()
        return JSONResponse(body, headers=gen.headers())

    def replies(
        self, gens: list[Generation], results: list[tuple[list[TokenEvent], FinishEvent]]
    ) -> Response:
        """n choices: one body, choice i from the i-th reply."""
        build = chat_completion if self.kind == "chat" else text_completion
        bodies = []
        for gen, (tokens, finish) in zip(gens, results, strict=True):
            text = "".join(ev.text for ev in tokens) + finish.text
            bodies.append(build(gen.rid, finish.model_id or gen.model, text, tokens, finish, finish.variant))
        body = merged_choices(bodies)
        body["route"] = gens[0].route.as_dict()
        return JSONResponse(body, headers=gens[0].headers())

    def builder(self, gen: Generation, started: Started | None, index: int = 0) -> ChunkBuilder:
        builder = ChunkBuilder(self.kind, gen.rid, gen.model, index)
        builder.final_fields = lambda: {"route": gen.route.as_dict()}
        if started is not None:
            builder.started(started.model_id, started.variant)
        return builder

    def streams(self, gens: list[Generation], started: Started | None) -> Response:
        """n choices streamed: one response; choice 0's start (when known) names the model for all."""
        builders = [self.builder(gen, started, i) for i, gen in enumerate(gens)]

        def close() -> None:
            for gen in gens:
                gen.abandon()

        return JobEventSource(
            choices_stream(list(zip(gens, builders, strict=True)), include_usage=self.include_usage),
            ping=gens[0].rt.keepalive_ping_s,
            headers=gens[0].headers(),
            shutdown_grace_period=2.0,
            on_close=close,
        )

    def stream(self, gen: Generation, started: Started | None) -> Response:
        builder = self.builder(gen, started)
        return JobEventSource(
            sse_stream(
                gen.job,
                gen.events,
                builder,
                interval_s=gen.rt.stream_interval_s,
                include_usage=self.include_usage,
                on_end=gen.stream_end,
                first=gen.held,
            ),
            ping=gen.rt.keepalive_ping_s,
            headers=gen.headers(),
            # Our own shutdown path (Worker.close) ends streams first; this only bounds sse-starlette's.
            shutdown_grace_period=2.0,
            on_close=gen.abandon,  # a no-op unless the generator never ran
        )
