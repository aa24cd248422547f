"""OpenAI's replies: one chat.completion / text_completion body (built by small functions, so that the
route and the stream share one shape), or its chunks as Server-Sent Events.

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
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse, Response

from models.types import (
    FinishEvent,
    Timings,
    TokenEvent,
    ToolCallDelta,
    Usage,
)
from server.api.common.flow import Submission
from server.api.common.logprobs import chat_logprobs, token_text
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
from server.api.common.tools import (
    assemble_calls,
    call_deltas,
)
from server.http.errors import error_payload
from server.serving.events import GovernorUpdate, Started, Switched

if TYPE_CHECKING:
    from server.serving.contracts import Job


def now() -> int:
    return int(time.time())


def usage_dict(usage: Usage) -> dict:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.by_model:  # simmer: which model produced how many tokens (several when the governor moved it)
        body["models"] = dict(usage.by_model)
    return body


def timings_dict(timings: Timings) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(timings).items()}


def completion_logprobs(events: list[TokenEvent], offset: int = 0) -> dict | None:
    if not events or all(ev.logprob is None for ev in events):
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for ev in events:
        text = token_text(ev)
        tokens.append(text)
        token_logprobs.append(ev.logprob)
        tops.append({t.token: t.logprob for t in ev.top_logprobs or ()})
        offsets.append(offset)
        offset += len(ev.text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _extras(finish: FinishEvent) -> dict:
    return {
        "timings": timings_dict(finish.timings),
        "truncated": finish.truncated,
        "summarized": finish.summarized,
    }


def _fingerprint(variant: str | None) -> str | None:
    return f"simmer-{variant}" if variant else None


def _finish_reason(finish: FinishEvent) -> str:
    # OpenAI knows stop/length/tool_calls; a cancelled generation that still answers reports what it has.
    return finish.finish_reason if finish.finish_reason in ("stop", "length", "tool_calls") else "stop"


def _stream_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """Stream-chunk tool_calls: one entry per call index; the call's first chunk carries its id, type and
    name (the openai SDK's stream helpers read them from there), later ones only arguments."""
    out: dict[int, dict] = {}
    for d in deltas:
        entry = out.get(d.index)
        if entry is None:
            entry = out[d.index] = {"index": d.index}
            if d.id is not None:
                entry.update({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            else:
                entry["function"] = {"arguments": ""}
        entry["function"]["arguments"] += d.arguments
    return [out[i] for i in sorted(out)]


def merged_choices(bodies: list[dict]) -> dict:
    """One reply body of several choices from the bodies of the replies that made them (choice i from the
    i-th): the first body's fields, every choice at its index, completion tokens added up."""
    out = dict(bodies[0])
    out["choices"] = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
    out["usage"] = summed_usage([body["usage"] for body in bodies])
    return out


def summed_usage(usages: list[dict]) -> dict:
    """The usage of a request's choices: the prompt counted once (every choice has the same one), the
    completion tokens added up."""
    usage = dict(usages[0])
    usage["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if any("models" in u for u in usages):  # simmer's tokens per model: each choice's added up
        models: dict[str, int] = {}
        for u in usages:
            for model, n in u.get("models", {}).items():
                models[model] = models.get(model, 0) + n
        usage["models"] = models
    return usage


def chat_completion(
    rid: str, model: str, text: str, tokens: list[TokenEvent], finish: FinishEvent, variant: str | None
) -> dict:
    # refusal: OpenAI's spec requires the field; simmer's models never refuse by a separate channel
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    calls = assemble_calls(call_deltas(tokens, finish))
    if calls:
        message = {"role": "assistant", "content": text or None, "refusal": None, "tool_calls": calls}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": _fingerprint(variant),
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": chat_logprobs(tokens),
                "finish_reason": _finish_reason(finish),
            }
        ],
        "usage": usage_dict(finish.usage),
        **_extras(finish),
    }


def text_completion(
    rid: str, model: str, text: str, tokens: list[TokenEvent], finish: FinishEvent, variant: str | None
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "system_fingerprint": _fingerprint(variant),
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": completion_logprobs(tokens),
                "finish_reason": _finish_reason(finish),
            }
        ],
        "usage": usage_dict(finish.usage),
        **_extras(finish),
    }


class ChunkBuilder:
    """Builds the stream chunks of one response (chat or text completion)."""

    def __init__(self, kind: Literal["chat", "text"], rid: str, model: str, index: int = 0) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self.index = index  # the choice these chunks carry (OpenAI's n: one builder per choice)
        self.created = now()
        self._role_sent = False
        self._offset = 0  # text offset for completion logprobs
        self._held: list[TokenEvent] = []  # tokens of batches that showed nothing yet (their logprobs)
        self.variant: str | None = None  # known once the worker starts the job
        # Fields of the final chunk (and the usage chunk) known only at the end: the route object.
        self.final_fields: Callable[[], dict] = dict

    def started(self, model_id: str | None, variant: str | None) -> None:
        """The model that runs the reply from now on (the governor may move it to another mid-way)."""
        if model_id:
            self.model = model_id
        self.variant = variant

    def _chunk(self, choices: list[dict], variant: str | None = None) -> dict:
        variant = variant or self.variant
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": _fingerprint(variant),
            "choices": choices,
        }

    def delta(self, text: str, tokens: list[TokenEvent], finish: FinishEvent | None = None) -> list[dict]:
        """The chunks for one batch of tokens (and the finish, at the end): none when the batch shows nothing
        (bytes the detokenizer holds, a call's envelope); its tokens' logprobs then go with the next chunk.
        As OpenAI streams: the role comes alone in the first chunk (`content` null); no delta carries empty
        content; the last chunk's delta is empty, with the finish_reason."""
        tokens = self._held + tokens
        self._held = []
        chunks = []
        if self.kind == "chat":
            calls = _stream_calls(call_deltas(tokens, finish))
            if not self._role_sent:  # the role-only opening chunk, before anything else
                self._role_sent = True
                chunks.append(self._choice({"role": "assistant", "content": None}))
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            if delta:
                chunks.append(self._choice(delta, chat_logprobs(tokens)))
            elif finish is None:
                self._held = tokens
            if finish is not None:
                logprobs = None if delta else chat_logprobs(tokens)
                chunks.append(self._choice({}, logprobs, finish))
        else:
            if text or finish is not None:
                choice = {
                    "index": self.index,
                    "text": text,
                    "logprobs": completion_logprobs(tokens, self._offset),
                    "finish_reason": _finish_reason(finish) if finish else None,
                }
                self._offset += len(text)
                chunks.append(
                    self._final(self._chunk([choice], finish.variant), finish)
                    if finish
                    else self._chunk([choice])
                )
            else:
                self._held = tokens
        return chunks

    def _choice(
        self, delta: dict[str, Any], logprobs: dict | None = None, finish: FinishEvent | None = None
    ) -> dict:
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(finish) if finish else None,
        }
        chunk = self._chunk([choice], finish.variant if finish else None)
        return self._final(chunk, finish) if finish else chunk

    def _final(self, chunk: dict, finish: FinishEvent) -> dict:
        chunk.update(_extras(finish))
        chunk.update(self.final_fields())
        return chunk

    def usage(self, finish: FinishEvent) -> dict:
        chunk = self._chunk([], finish.variant)
        chunk["usage"] = usage_dict(finish.usage)
        chunk.update(_extras(finish))
        chunk.update(self.final_fields())
        return chunk


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

    def governor(self, item: GovernorUpdate) -> Iterable[dict[str, Any]]:
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
    streams: list[tuple[Submission, ChunkBuilder]], *, include_usage: bool
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

    def reply(self, gen: Submission, tokens: list[TokenEvent], finish: FinishEvent) -> Response:
        text = "".join(ev.text for ev in tokens) + finish.text
        build = chat_completion if self.kind == "chat" else text_completion
        # the model that finished the reply (the governor may have moved it to another one mid-way)
        body = build(gen.rid, finish.model_id or gen.model, text, tokens, finish, finish.variant)
        body["route"] = gen.route.as_dict()
        return JSONResponse(body, headers=gen.headers())

    def replies(
        self, gens: list[Submission], results: list[tuple[list[TokenEvent], FinishEvent]]
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

    def builder(self, gen: Submission, started: Started | None, index: int = 0) -> ChunkBuilder:
        builder = ChunkBuilder(self.kind, gen.rid, gen.model, index)
        builder.final_fields = lambda: {"route": gen.route.as_dict()}
        if started is not None:
            builder.started(started.model_id, started.variant)
        return builder

    def streams(self, gens: list[Submission], started: Started | None) -> Response:
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

    def stream(self, gen: Submission, started: Started | None) -> Response:
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
