"""OpenAI's replies: one chat.completion / text_completion body (built by small functions, so that the
route and the stream share one shape), or its chunks as Server-Sent Events; both are replies.py's models,
sent as `wire` writes them.

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

from fastapi.responses import Response

from models import types as engine_types
from models.types import FinishEvent, TokenEvent, ToolCallDelta
from server.api.common.flow import Submission
from server.api.common.logprobs import token_logprobs, token_text
from server.api.common.reply import reply_response, wire
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
from server.api.openai.replies import (
    AssistantMessage,
    CachedTokens,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChunkChoice,
    ChunkDelta,
    ChunkFunction,
    ChunkToolCall,
    CompletionLogprobs,
    RouteReport,
    TextChoice,
    TextChunkChoice,
    TextCompletion,
    TextCompletionChunk,
    Timings,
    ToolCall,
    Usage,
)
from server.http.errors import error_payload
from server.serving.events import GovernorUpdate, Started, Switched

if TYPE_CHECKING:
    from server.serving.contracts import Job


def now() -> int:
    return int(time.time())


Completion = ChatCompletion | TextCompletion
Chunk = ChatCompletionChunk | TextCompletionChunk


def usage_reply(usage: engine_types.Usage) -> Usage:
    fields: dict[str, Any] = {}
    if usage.by_model:  # simmer: which model produced how many tokens (several when the governor moved it)
        fields["models"] = dict(usage.by_model)
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=CachedTokens(cached_tokens=usage.cached_tokens),
        **fields,
    )


def timings_reply(t: engine_types.Timings) -> Timings:
    return Timings(
        prompt_n=t.prompt_n,
        prompt_ms=round(t.prompt_ms, 3),
        prompt_per_second=round(t.prompt_per_second, 3),
        predicted_n=t.predicted_n,
        predicted_ms=round(t.predicted_ms, 3),
        predicted_per_second=round(t.predicted_per_second, 3),
        ttft_ms=round(t.ttft_ms, 3),
        draft_n=t.draft_n,
        draft_n_accepted=t.draft_n_accepted,
    )


def chat_logprobs(events: list[TokenEvent]) -> ChatLogprobs | None:
    content = token_logprobs(events)
    return None if content is None else ChatLogprobs(content=content, refusal=None)


def completion_logprobs(events: list[TokenEvent], offset: int = 0) -> CompletionLogprobs | None:
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
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )


def _ending(finish: FinishEvent) -> dict[str, Any]:
    """The fields of the body that ends a reply beside OpenAI's (the route is the renderer's)."""
    return {
        "timings": timings_reply(finish.timings),
        "truncated": finish.truncated,
        "summarized": finish.summarized,
    }


def _fingerprint(variant: str | None) -> str | None:
    return f"simmer-{variant}" if variant else None


def _finish_reason(finish: FinishEvent) -> Literal["stop", "length", "tool_calls"]:
    # OpenAI knows stop/length/tool_calls; a cancelled generation that still answers reports what it has.
    reason = finish.finish_reason
    return reason if reason == "length" or reason == "tool_calls" else "stop"


def _text_finish_reason(finish: FinishEvent) -> Literal["stop", "length"]:
    # a text completion has no tools
    return "length" if finish.finish_reason == "length" else "stop"


def _stream_calls(deltas: list[ToolCallDelta]) -> list[ChunkToolCall]:
    """Stream-chunk tool_calls: one entry per call index; the call's first chunk carries its id, type and
    name (the openai SDK's stream helpers read them from there), later ones only arguments."""
    opened: dict[int, tuple[str, str] | None] = {}  # a call that starts here: its id and name
    arguments: dict[int, str] = {}
    for d in deltas:
        if d.index not in opened:
            opened[d.index] = (d.id, d.name) if d.id is not None and d.name is not None else None
            arguments[d.index] = ""
        arguments[d.index] += d.arguments
    out = []
    for i in sorted(opened):
        if (start := opened[i]) is None:
            out.append(ChunkToolCall(index=i, function=ChunkFunction(arguments=arguments[i])))
        else:
            function = ChunkFunction(name=start[1], arguments=arguments[i])
            out.append(ChunkToolCall(index=i, id=start[0], type="function", function=function))
    return out


def merged_choices(bodies: list[Completion]) -> Completion:
    """One reply body of several choices from the bodies of the replies that made them (choice i from the
    i-th): the first body's fields, every choice at its index, completion tokens added up."""
    choices = [body.choices[0].model_copy(update={"index": i}) for i, body in enumerate(bodies)]
    usage = summed_usage([body.usage for body in bodies])
    return bodies[0].model_copy(update={"choices": choices, "usage": usage})


def summed_usage(usages: list[Usage]) -> Usage:
    """The usage of a request's choices: the prompt counted once (every choice has the same one), the
    completion tokens added up."""
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages)
    update: dict[str, Any] = {
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
    }
    if any(u.models is not None for u in usages):  # simmer's tokens per model: each choice's added up
        models: dict[str, int] = {}
        for u in usages:
            for model, n in (u.models or {}).items():
                models[model] = models.get(model, 0) + n
        update["models"] = models
    return first.model_copy(update=update)


def chat_completion(
    rid: str, model: str, text: str, tokens: list[TokenEvent], finish: FinishEvent, variant: str | None
) -> ChatCompletion:
    # refusal: OpenAI's spec requires the field; simmer's models never refuse by a separate channel
    message = AssistantMessage(role="assistant", content=text, refusal=None)
    calls = assemble_calls(call_deltas(tokens, finish))
    if calls:
        message = AssistantMessage(
            role="assistant",
            content=text or None,
            refusal=None,
            tool_calls=[ToolCall.model_validate(call) for call in calls],
        )
    choice = ChatChoice(
        index=0, message=message, logprobs=chat_logprobs(tokens), finish_reason=_finish_reason(finish)
    )
    return ChatCompletion(
        id=rid,
        object="chat.completion",
        created=now(),
        model=model,
        system_fingerprint=_fingerprint(variant),
        choices=[choice],
        usage=usage_reply(finish.usage),
        **_ending(finish),
    )


def text_completion(
    rid: str, model: str, text: str, tokens: list[TokenEvent], finish: FinishEvent, variant: str | None
) -> TextCompletion:
    choice = TextChoice(
        index=0, text=text, logprobs=completion_logprobs(tokens), finish_reason=_text_finish_reason(finish)
    )
    return TextCompletion(
        id=rid,
        object="text_completion",
        created=now(),
        model=model,
        system_fingerprint=_fingerprint(variant),
        choices=[choice],
        usage=usage_reply(finish.usage),
        **_ending(finish),
    )


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
        # Known only at the end, for the final chunk (and the usage chunk): where the reply was served.
        self.route: Callable[[], RouteReport | None] = lambda: None

    def started(self, model_id: str | None, variant: str | None) -> None:
        """The model that runs the reply from now on (the governor may move it to another mid-way)."""
        if model_id:
            self.model = model_id
        self.variant = variant

    def _chunk(
        self,
        choices: list[ChunkChoice] | list[TextChunkChoice],
        finish: FinishEvent | None = None,
        usage: Usage | None = None,
    ) -> Chunk:
        """One chunk; the one that ends the reply (`finish`) carries simmer's fields and the route."""
        fields: dict[str, Any] = {
            "id": self.rid,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": _fingerprint((finish.variant if finish else None) or self.variant),
            "choices": choices,
        }
        if usage is not None:
            fields["usage"] = usage
        if finish is not None:
            fields.update(_ending(finish))
            if (route := self.route()) is not None:
                fields["route"] = route
        if self.kind == "chat":
            return ChatCompletionChunk(object="chat.completion.chunk", **fields)
        return TextCompletionChunk(object="text_completion", **fields)

    def delta(self, text: str, tokens: list[TokenEvent], finish: FinishEvent | None = None) -> list[Chunk]:
        """The chunks for one batch of tokens (and the finish, at the end): none when the batch shows nothing
        (bytes the detokenizer holds, a call's envelope); its tokens' logprobs then go with the next chunk.
        As OpenAI streams: the role comes alone in the first chunk (`content` null); no delta carries empty
        content; the last chunk's delta is empty, with the finish_reason."""
        tokens = self._held + tokens
        self._held = []
        chunks: list[Chunk] = []
        if self.kind == "chat":
            calls = _stream_calls(call_deltas(tokens, finish))
            if not self._role_sent:  # the role-only opening chunk, before anything else
                self._role_sent = True
                chunks.append(self._choice(ChunkDelta(role="assistant", content=None)))
            fields: dict[str, Any] = {"content": text} if text else {}
            if calls:
                fields["tool_calls"] = calls
            if fields:
                chunks.append(self._choice(ChunkDelta(**fields), chat_logprobs(tokens)))
            elif finish is None:
                self._held = tokens
            if finish is not None:
                logprobs = None if fields else chat_logprobs(tokens)
                chunks.append(self._choice(ChunkDelta(), logprobs, finish))
        else:
            if text or finish is not None:
                choice = TextChunkChoice(
                    index=self.index,
                    text=text,
                    logprobs=completion_logprobs(tokens, self._offset),
                    finish_reason=_text_finish_reason(finish) if finish else None,
                )
                self._offset += len(text)
                chunks.append(self._chunk([choice], finish))
            else:
                self._held = tokens
        return chunks

    def _choice(
        self, delta: ChunkDelta, logprobs: ChatLogprobs | None = None, finish: FinishEvent | None = None
    ) -> Chunk:
        choice = ChunkChoice(
            index=self.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=_finish_reason(finish) if finish else None,
        )
        return self._chunk([choice], finish)

    def usage(self, finish: FinishEvent) -> Chunk:
        return self._chunk([], finish, usage_reply(finish.usage))


DONE = "[DONE]"


def _data(chunk: Chunk) -> dict[str, Any]:
    return {"data": wire(chunk)}


def error_chunk(err: BaseException) -> dict:
    _, body, _ = error_payload(err)
    return {"data": json.dumps(body, separators=(",", ":"), ensure_ascii=False)}


@dataclass
class ChunkEncoder:
    """OpenAI's chat and text completion chunks. One of a request's several choices (`alone` False) sends
    neither its usage nor [DONE] (`choices_stream` sends them once all have ended) and leaves the governor's
    events to choice 0."""

    job: Job
    builder: ChunkBuilder
    include_usage: bool
    alone: bool = True
    usage_chunk: Chunk | None = None  # a choice's usage, kept for `choices_stream`

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
    ended = [encoder.usage_chunk for encoder in encoders if encoder.usage_chunk is not None]
    if include_usage and len(ended) == len(encoders):
        usages = [chunk.usage for chunk in ended if chunk.usage is not None]
        yield _data(ended[0].model_copy(update={"usage": summed_usage(usages)}))
    yield {"data": DONE}


def route_report(gen: Submission) -> RouteReport:
    return RouteReport.model_validate(gen.route.as_dict())


def _routed(body: Completion, gen: Submission) -> Completion:
    return body.model_copy(update={"route": route_report(gen)})


@dataclass
class OpenAIRenderer:
    kind: Literal["chat", "text"]
    include_usage: bool

    def reply(self, gen: Submission, tokens: list[TokenEvent], finish: FinishEvent) -> Response:
        text = "".join(ev.text for ev in tokens) + finish.text
        build = chat_completion if self.kind == "chat" else text_completion
        # the model that finished the reply (the governor may have moved it to another one mid-way)
        body = build(gen.rid, finish.model_id or gen.model, text, tokens, finish, finish.variant)
        return reply_response(_routed(body, gen), headers=gen.headers())

    def replies(
        self, gens: list[Submission], results: list[tuple[list[TokenEvent], FinishEvent]]
    ) -> Response:
        """n choices: one body, choice i from the i-th reply."""
        build = chat_completion if self.kind == "chat" else text_completion
        bodies: list[Completion] = []
        for gen, (tokens, finish) in zip(gens, results, strict=True):
            text = "".join(ev.text for ev in tokens) + finish.text
            bodies.append(build(gen.rid, finish.model_id or gen.model, text, tokens, finish, finish.variant))
        body = _routed(merged_choices(bodies), gens[0])
        return reply_response(body, headers=gens[0].headers())

    def builder(self, gen: Submission, started: Started | None, index: int = 0) -> ChunkBuilder:
        builder = ChunkBuilder(self.kind, gen.rid, gen.model, index)
        builder.route = lambda: route_report(gen)
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
