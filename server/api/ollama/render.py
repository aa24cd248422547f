"""Ollama's replies: one object or NDJSON lines for /api/chat and /api/generate (`NdjsonRenderer`,
`NdjsonEncoder`), built from small functions (`piece`, `final`, `durations`), and a pull's progress lines;
each is replies.py's model, sent as `wire` writes it.
A reply's calls come back as Ollama's message.tool_calls, each whole once its arguments object is
(`CallCollector`)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import Response

from models.types import FinishEvent, TokenEvent, ToolCallDelta
from server.api.common.flow import Submission
from server.api.common.logprobs import token_text
from server.api.common.names import LATEST, model_id
from server.api.common.reply import reply_response, wire
from server.api.common.streaming import Batch, End, Error, JobStreamingResponse, encode
from server.api.common.tools import assemble_calls, call_deltas
from server.api.ollama.replies import (
    OllamaCall,
    OllamaCallFunction,
    OllamaChat,
    OllamaGenerate,
    OllamaLogprob,
    OllamaProgress,
    OllamaReplyMessage,
    TopLogprob,
)
from server.http.errors import error_payload
from server.serving.events import GovernorUpdate, Started, Switched


def ollama_name(model: str) -> str:
    """How /api/tags and /api/ps name a model: with Ollama's default tag."""
    return model if ":" in model else model + LATEST


def name_as_given(given: str, model: str) -> str:
    """`model` as the reply names it: the client's own name for the model it asked for (Ollama echoes it);
    another model (the governor moved the reply) in the same style, with the default tag if the client
    wrote one."""
    if model_id(given) == model:
        return given
    return ollama_name(model) if given.endswith(LATEST) else model


def created_at() -> str:
    """RFC 3339 in UTC with the fraction, as Ollama writes created_at."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def iso(timestamp: str) -> str:
    """A model's modified_at: the ISO 8601 time the store wrote; now when unknown."""
    if timestamp:
        return timestamp
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


PREFIX = "/api/"  # errors under it are Ollama's {"error": ...}
NDJSON = "application/x-ndjson"


OllamaLine = OllamaChat | OllamaGenerate


def line(reply: OllamaLine | OllamaProgress) -> bytes:
    return wire(reply).encode() + b"\n"


def error_line(err: BaseException) -> bytes:
    body = error_payload(err, PREFIX)[1]
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def logprobs_list(tokens: list[TokenEvent]) -> list[OllamaLogprob] | None:
    """Ollama's logprobs: one object per token, its top alternatives when asked. Built unvalidated, as
    api/common/logprobs.py's (an upstream's relayed logprobs may lack one)."""
    if not tokens or all(ev.logprob is None for ev in tokens):
        return None
    out = []
    for ev in tokens:
        text = token_text(ev)
        fields: dict[str, Any] = {}
        if ev.top_logprobs:
            fields["top_logprobs"] = [
                TopLogprob.model_construct(token=t.token, logprob=t.logprob, bytes=list(t.bytes))
                for t in ev.top_logprobs
            ]
        entry = OllamaLogprob.model_construct(
            token=text, logprob=ev.logprob, bytes=list(text.encode()), **fields
        )
        out.append(entry)
    return out


def durations(finish: FinishEvent, *, total_s: float, load_s: float) -> dict[str, int]:
    """The final object's statistics, in nanoseconds as Ollama has them. prompt_eval_count counts the
    prompt tokens evaluated for this request (a reused prefix is not evaluated again), as Ollama reports
    what its runner evaluated; load_duration is the wait before the worker took the job (queue, a governor
    pause, a model loaded again after keep_alive)."""
    t = finish.timings
    return {
        "total_duration": round(total_s * 1e9),
        "load_duration": round(load_s * 1e9),
        "prompt_eval_count": t.prompt_n,
        "prompt_eval_duration": round(t.prompt_ms * 1e6),
        "eval_count": finish.usage.completion_tokens,
        "eval_duration": round(t.predicted_ms * 1e6),
    }


def done_reason(finish: FinishEvent) -> str:
    return "length" if finish.finish_reason == "length" else "stop"


def ollama_calls(deltas: list[ToolCallDelta]) -> list[OllamaCall]:
    """Ollama's message.tool_calls from the engine's call deltas: the calls whose arguments object is
    complete (one cut by num_predict has no object to give, and is left out)."""
    out = []
    for call in assemble_calls(deltas):
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            continue
        if isinstance(arguments, dict):
            function = OllamaCallFunction(index=len(out), name=call["function"]["name"], arguments=arguments)
            out.append(OllamaCall(id=call["id"], function=function))
    return out


class CallCollector:
    """A streamed reply's calls, each sent whole once its arguments object is complete (Ollama streams
    calls whole: its `arguments` is an object, not text)."""

    def __init__(self) -> None:
        self._deltas: list[ToolCallDelta] = []
        self._sent = 0

    def add(self, deltas: list[ToolCallDelta]) -> list[OllamaCall]:
        """The calls these deltas completed."""
        if not deltas:
            return []
        self._deltas += deltas
        calls = ollama_calls(self._deltas)
        new, self._sent = calls[self._sent :], len(calls)
        return new


Kind = Literal["chat", "generate"]


def _line(
    kind: Kind,
    model: str,
    text: str,
    tokens: list[TokenEvent],
    calls: list[OllamaCall] | None,
    **fields: Any,
) -> OllamaLine:
    fields = {"model": model, "created_at": created_at(), **fields}
    if (lp := logprobs_list(tokens)) is not None:
        fields["logprobs"] = lp
    if kind == "chat":
        message = OllamaReplyMessage(role="assistant", content=text)
        if calls:
            message = OllamaReplyMessage(role="assistant", content=text, tool_calls=calls)
        return OllamaChat(message=message, **fields)
    return OllamaGenerate(response=text, **fields)


def piece(
    kind: Kind, model: str, text: str, tokens: list[TokenEvent], calls: list[OllamaCall] | None = None
) -> OllamaLine:
    """One streamed object (done: false)."""
    return _line(kind, model, text, tokens, calls, done=False)


def final(
    kind: Kind,
    model: str,
    text: str,
    tokens: list[TokenEvent],
    finish: FinishEvent,
    stats: dict[str, int],
    calls: list[OllamaCall] | None = None,
) -> OllamaLine:
    """The last object: done, done_reason and the statistics (with the whole reply when not streamed), and
    simmer's window flags as the OpenAI bodies have them: truncated (turns were dropped) and summarized
    (the dropped turns came as a summary note)."""
    fields: dict[str, Any] = {"truncated": finish.truncated, "summarized": finish.summarized}
    if finish.usage.by_model:  # simmer: which model produced how many tokens (the governor may move a reply)
        fields["eval_count_by_model"] = {name_as_given(model, m): n for m, n in finish.usage.by_model.items()}
    return _line(
        kind, model, text, tokens, calls, done=True, done_reason=done_reason(finish), **stats, **fields
    )


def control(kind: Kind, model: str, reason: Literal["load", "unload"]) -> OllamaLine:
    """The answer to a load or unload request (no prompt, no messages)."""
    return _line(kind, model, "", [], None, done=True, done_reason=reason)


@dataclass
class NdjsonRenderer:
    """Ollama's answers to /api/chat and /api/generate: one object, or NDJSON ending with done: true.
    Each line names the model that produced it: the governor may start the reply on another model, or move
    it to another mid-way (then the held text leaves under the old name and later lines name the new one)."""

    kind: Kind
    name: str  # the model as the client named it (Ollama echoes it)

    def named(self, model: str | None) -> str:
        return name_as_given(self.name, model) if model else self.name

    def stats(self, gen: Submission, finish: FinishEvent) -> dict[str, int]:
        now = time.monotonic()
        started = gen.started if gen.started is not None else now
        return durations(finish, total_s=now - gen.arrived, load_s=started - gen.arrived)

    def reply(self, gen: Submission, tokens: list[TokenEvent], finish: FinishEvent) -> Response:
        text = "".join(ev.text for ev in tokens) + finish.text
        calls = ollama_calls(call_deltas(tokens, finish))
        name = self.named(finish.model_id)
        body = final(self.kind, name, text, tokens, finish, self.stats(gen, finish), calls)
        return reply_response(body, headers=gen.headers())

    def stream(self, gen: Submission, started: Started | None) -> Response:
        name = self.named(started.model_id) if started is not None else self.name
        return JobStreamingResponse(
            encode(gen.events_until_end(), NdjsonEncoder(self, gen, name)),
            media_type=NDJSON,
            headers=gen.headers(),
            on_close=gen.abandon,  # a no-op unless the generator never ran
        )


@dataclass
class NdjsonEncoder:
    """Ollama's stream: one line per piece, then the final line with the stats (or an error line)."""

    renderer: NdjsonRenderer
    gen: Submission
    name: str  # the model producing the lines, from now on
    collector: CallCollector = field(default_factory=CallCollector)

    @property
    def kind(self) -> Kind:
        return self.renderer.kind

    def opening(self) -> list[bytes]:
        return []

    def batch(self, item: Batch) -> list[bytes]:
        calls = self.collector.add(call_deltas(item.events))
        if item.text or calls or any(ev.logprob is not None for ev in item.events):
            return [line(piece(self.kind, self.name, item.text, item.events, calls))]
        return []

    def end(self, item: End) -> list[bytes]:
        out = []
        calls = self.collector.add(call_deltas(item.events, item.finish))
        if item.text or item.events or calls:  # held text goes out before the final object
            out.append(line(piece(self.kind, self.name, item.text, item.events, calls)))
        self.gen.mark_started()
        if item.finish.model_id:
            self.name = self.renderer.named(item.finish.model_id)
        stats = self.renderer.stats(self.gen, item.finish)
        return [*out, line(final(self.kind, self.name, "", [], item.finish, stats))]

    def error(self, item: Error) -> list[bytes]:
        out = [line(piece(self.kind, self.name, item.text, item.events))] if item.events else []
        return [*out, error_line(item.error)]

    def started(self, item: Started) -> list[bytes]:
        self.gen.mark_started()
        self.name = self.renderer.named(item.model_id)
        return []

    def switched(self, item: Switched) -> list[bytes]:
        self.name = self.renderer.named(item.model_id)  # `coalesced` sent the held text under the old name
        return []

    def governor(self, item: GovernorUpdate) -> list[bytes]:
        return []


class PullProgress:
    """The store's (stage, fraction) reports, from the pull's thread, as Ollama's progress objects: one per
    stage and per 0.1 % of it. `digest` names the stage (clients key their progress bars on it); total and
    completed are per mille, not bytes (the store reports fractions)."""

    TOTAL = 1000

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[OllamaProgress] = asyncio.Queue()
        self._last: tuple[str, int] | None = None

    def note(self, text: str) -> None:
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, OllamaProgress(status=text))

    def __call__(self, stage: str, fraction: float) -> None:
        done = round(max(0.0, min(1.0, fraction)) * self.TOTAL)
        if (stage, done) == self._last:
            return
        self._last = (stage, done)
        item = OllamaProgress(status=stage, digest=stage, total=self.TOTAL, completed=done)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def lines(self, task: asyncio.Future) -> AsyncIterator[bytes]:
        yield line(OllamaProgress(status="pulling manifest"))
        while not (task.done() and self.queue.empty()):
            getter = asyncio.ensure_future(self.queue.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield line(getter.result())
            else:
                getter.cancel()
        try:
            installed = task.result()
        except Exception as err:  # the stream has started: the error is its last line
            yield error_line(err)
            return
        yield line(OllamaProgress(status="verifying sha256 digest"))
        yield line(OllamaProgress(status=f"installed {installed.id} {installed.version}"))
        yield line(OllamaProgress(status="success"))
