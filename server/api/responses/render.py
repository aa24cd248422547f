"""The Responses API's replies: the response object (`ResponseObject`, also the base of every stream
event that carries it) and its stream of typed events (`EventStream`), as one body or Server-Sent Events
(`ResponsesRenderer`).

The reply is one `response` object, or Server-Sent Events named after their `type`
(response.created ... response.completed, or error + response.failed), without a [DONE] line. The response
object and its output items are replies.py's models (an event carries them as the fields they were built
with); the events around them are plain objects, which replies.py does not declare. A reply the
governor moves to another model mid-way gets a response.in_progress naming the new model (with simmer's
`switch`, as chat's `event: governor` has it); the finished response names the model that finished it.
A stream that asked for `governor_events` also gets chat's `event: governor` events (state changes and
switches, server/api/common/streaming.py's governor_event), outside the numbered response.* sequence.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel

from models.types import FinishEvent, TokenEvent, ToolCallDelta, Usage
from server.api.common.flow import Submission
from server.api.common.logprobs import token_logprobs
from server.api.common.reply import Reply, TokenLogprob, reply_response
from server.api.common.streaming import (
    Batch,
    End,
    Error,
    JobEventSource,
    encode,
    governor_event,
    switch_report,
)
from server.api.common.tools import assemble_calls, call_deltas
from server.api.responses import replies
from server.api.responses.replies import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseError,
    ResponseTextConfig,
    ResponseUsage,
)
from server.api.responses.requests import ResponsesRequest
from server.http.errors import error_payload
from server.serving.events import GovernorUpdate, Started, Switched

Item = OutputMessage | FunctionCallItem
Status = Literal["completed", "incomplete", "failed", "in_progress"]


def plain(reply: Reply) -> dict[str, Any]:
    """A reply model as an event carries it: the fields it was built with."""
    return reply.model_dump(exclude_unset=True)


def usage_object(usage: Usage) -> ResponseUsage:
    fields: dict[str, Any] = {}
    if usage.by_model:  # simmer: output tokens per model, as chat's usage.models (the governor moves replies)
        fields["models"] = dict(usage.by_model)
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        # cache_write_tokens: the prompt tokens prefilled this time, which the prefix cache then keeps
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.cached_tokens,
            cache_write_tokens=max(0, usage.prompt_tokens - usage.cached_tokens),
        ),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=usage.total_tokens,
        **fields,
    )


def logprobs_of(tokens: list[TokenEvent] | None) -> list[TokenLogprob]:
    return token_logprobs(tokens or []) or []


def text_part(text: str, tokens: list[TokenEvent] | None = None) -> OutputText:
    return OutputText(type="output_text", text=text, annotations=[], logprobs=logprobs_of(tokens))


def message_item(item_id: str, status: ItemStatus, parts: list[OutputText]) -> OutputMessage:
    return OutputMessage(id=item_id, type="message", status=status, role="assistant", content=parts)


def call_item(item_id: str, call: dict[str, Any], status: ItemStatus) -> FunctionCallItem:
    """A function_call output item from an assembled chat call (assemble_calls in api/common/tools.py)."""
    function = call["function"]
    return FunctionCallItem(
        id=item_id,
        type="function_call",
        status=status,
        call_id=call["id"],
        name=function["name"],
        arguments=function["arguments"],
    )


def _complete(arguments: str) -> bool:
    """A call's arguments are a whole JSON object (one cut by max_output_tokens is not)."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def finish_status(
    finish: FinishEvent,
) -> tuple[Literal["completed", "incomplete"], IncompleteDetails | None]:
    """completed, or incomplete (the reply hit max_output_tokens or the context)."""
    if finish.finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    return "completed", None


class ResponseObject:
    """Builds the `response` object of one request, the same in the reply and in every stream event.
    `model` is the model producing the reply now: the governor may place it on another model, or move it to
    another mid-way; the finished response names the model that finished it."""

    def __init__(self, rid: str, model: str, request: ResponsesRequest) -> None:
        self.rid = rid
        self.item_id = "msg_" + rid.removeprefix("resp_")
        self.model = model
        self.request = request
        self.created_at = int(time.time())

    def call_id(self, index: int) -> str:
        """The output item id of call `index` (its call_id is the engine's call_...)."""
        return f"fc_{self.rid.removeprefix('resp_')}_{index}"

    def build(
        self,
        status: Status,
        output: list[Item],
        *,
        usage: Usage | None = None,
        incomplete: IncompleteDetails | None = None,
        error: ResponseError | None = None,
        finish: FinishEvent | None = None,
    ) -> replies.Response:
        """`finish` (the reply's end) adds simmer's window flags, as the OpenAI bodies have them."""
        r = self.request
        choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, BaseModel) else r.tool_choice
        fields: dict[str, Any] = (
            {"truncated": finish.truncated, "summarized": finish.summarized} if finish else {}
        )
        # Optional in OpenAI's spec and never null there: left out until known (`user` unless sent).
        if r.user is not None:
            fields["user"] = r.user
        if usage is not None:
            fields["usage"] = usage_object(usage)
        return replies.Response(
            id=self.rid,
            object="response",
            created_at=self.created_at,
            completed_at=int(time.time()) if status in ("completed", "incomplete") else None,
            status=status,
            error=error,
            incomplete_details=incomplete,
            model=self.model,
            instructions=r.instructions,
            output=output,
            parallel_tool_calls=r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            previous_response_id=None,
            tool_choice=choice or "auto",
            tools=[t.echo() for t in r.tools or ()],
            temperature=r.temperature,
            top_p=r.top_p,
            top_logprobs=r.top_logprobs,
            max_output_tokens=r.max_output_tokens,
            truncation=r.truncation or "disabled",
            text=ResponseTextConfig(format=r.format.echo()),
            reasoning=None,
            store=False,  # nothing was stored, whatever `store` asked (see the module docstring)
            background=False,
            metadata=r.metadata or {},
            service_tier=r.service_tier or "default",
            safety_identifier=r.safety_identifier,
            prompt_cache_key=r.prompt_cache_key,
            **fields,
        )

    def output(
        self, text: str, tokens: list[TokenEvent], calls: list[dict[str, Any]], status: ItemStatus
    ) -> list[Item]:
        """The output items: the message (when there is text, or nothing else), then one per call."""
        items: list[Item] = []
        if text or not calls:
            items.append(message_item(self.item_id, status, [text_part(text, tokens)]))
        for i, call in enumerate(calls):
            done = "completed" if _complete(call["function"]["arguments"]) else "incomplete"
            items.append(call_item(self.call_id(i), call, done))
        return items

    def final(self, text: str, tokens: list[TokenEvent], finish: FinishEvent) -> replies.Response:
        self.model = finish.model_id or self.model
        status, incomplete = finish_status(finish)
        calls = assemble_calls(call_deltas(tokens, finish))
        output = self.output(text, tokens, calls, status)
        return self.build(status, output, usage=finish.usage, incomplete=incomplete, finish=finish)


class EventStream:
    """The `response.*` events of one streamed response, numbered in order (sequence_number).

    Output items open as they come, one at a time: each is closed (its `.done` events, then
    response.output_item.done) before the next opens, as OpenAI's stream does. Without tools the message
    opens at once (an empty reply is an empty message); with tools the message opens at its first text and
    each call at its first delta (its arguments then stream as response.function_call_arguments.delta), so a
    reply that is only calls has no message, as in the reply that is not streamed. No text delta is empty:
    the logprobs of tokens that showed nothing yet go with the next one."""

    def __init__(self, response: ResponseObject) -> None:
        self.r = response
        self.seq = 0
        self.text = ""
        self.tokens: list[TokenEvent] = []  # the message's tokens sent so far (its logprobs)
        self.pending: list[TokenEvent] = []  # text tokens whose text has not gone out yet
        self.message_at: int | None = None  # the message's output_index, once open
        self.calls: dict[int, int] = {}  # call index -> output_index
        self.deltas: list[ToolCallDelta] = []
        self.opened = 0  # output items so far
        self.current: int | None = None  # the output_index of the item open now
        self.closed: dict[int, Item] = {}  # output_index -> the item as its output_item.done said

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return out

    def opening(self) -> list[dict[str, Any]]:
        r = self.r
        events = [
            self.event("response.created", response=plain(r.build("in_progress", []))),
            self.event("response.in_progress", response=plain(r.build("in_progress", []))),
        ]
        if not r.request.tools:
            events += self._open_message()
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        r = self.r
        self.message_at, self.opened = self.opened, self.opened + 1
        self.current = self.message_at
        return [
            self.event(
                "response.output_item.added",
                output_index=self.message_at,
                item=plain(message_item(r.item_id, "in_progress", [])),
            ),
            self.event(
                "response.content_part.added",
                item_id=r.item_id,
                output_index=self.message_at,
                content_index=0,
                part=plain(text_part("")),
            ),
        ]

    def delta(self, text: str, tokens: list[TokenEvent], finish: FinishEvent | None = None) -> list[dict]:
        """The events of one batch of tokens: text deltas, then call deltas."""
        events: list[dict[str, Any]] = []
        deltas = call_deltas(tokens, finish)
        self.pending += [ev for ev in tokens if not ev.tool_calls]
        if text:
            if self.message_at is None:
                events += self._close_current("completed")
                events += self._open_message()
            self.text += text
            sent, self.pending = self.pending, []
            self.tokens += sent
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self.r.item_id,
                    output_index=self.message_at,
                    content_index=0,
                    delta=text,
                    logprobs=[plain(lp) for lp in logprobs_of(sent)],
                )
            )
        for d in deltas:
            self.deltas.append(d)
            if d.index not in self.calls:
                events += self._close_current("completed")
                self.calls[d.index], self.opened = self.opened, self.opened + 1
                self.current = self.calls[d.index]
                call = {"id": d.id, "function": {"name": d.name, "arguments": ""}}
                item = call_item(self.r.call_id(d.index), call, "in_progress")
                events.append(
                    self.event(
                        "response.output_item.added", output_index=self.calls[d.index], item=plain(item)
                    )
                )
            if d.arguments:
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self.r.call_id(d.index),
                        output_index=self.calls[d.index],
                        delta=d.arguments,
                    )
                )
        return events

    def _item(self, index: int, status: ItemStatus) -> Item:
        """The item at output_index `index` as it stands (a message: `status`; a call: completed when its
        arguments are a whole object)."""
        if index == self.message_at:
            return message_item(self.r.item_id, status, [self._part()])
        call_index = next(i for i, at in self.calls.items() if at == index)
        call = assemble_calls([d for d in self.deltas if d.index == call_index])[0]
        done = "completed" if _complete(call["function"]["arguments"]) else "incomplete"
        return call_item(self.r.call_id(call_index), call, done)

    def _close_current(self, status: ItemStatus) -> list[dict[str, Any]]:
        """The `.done` events of the item open now (none when none is)."""
        index, self.current = self.current, None
        if index is None:
            return []
        if index == self.message_at:
            self.tokens += self.pending
            self.pending = []
        item = self._item(index, status)
        self.closed[index] = item
        r = self.r
        if isinstance(item, OutputMessage):
            part = plain(self._part())
            events = [
                self.event(
                    "response.output_text.done",
                    item_id=r.item_id,
                    output_index=index,
                    content_index=0,
                    text=self.text,
                    logprobs=part["logprobs"],
                ),
                self.event(
                    "response.content_part.done",
                    item_id=r.item_id,
                    output_index=index,
                    content_index=0,
                    part=part,
                ),
            ]
        else:
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.arguments,
                )
            ]
        return [*events, self.event("response.output_item.done", output_index=index, item=plain(item))]

    def moved(self, model: str | None, switch: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The reply runs on `model` from now on (the worker started it on another model than the one
        asked for, or the governor moved it mid-way): a response.in_progress naming it, with the output as
        it stands (and simmer's `switch`: old, new, reason, tokens_before). Nothing when it is the same."""
        if not model or model == self.r.model:
            return []
        self.r.model = model
        extra = {"switch": switch} if switch else {}
        response = plain(self.r.build("in_progress", self._output("in_progress")))
        return [self.event("response.in_progress", response=response, **extra)]

    def _output(self, status: ItemStatus) -> list[Item]:
        """Every item opened so far, in output order: the closed ones as they were closed, the open one with
        `status`."""
        items = dict(self.closed)
        if self.current is not None:
            items[self.current] = self._item(self.current, status)
        return [items[i] for i in sorted(items)]

    def _part(self) -> OutputText:
        return text_part(self.text, self.tokens)

    def closing(self, finish: FinishEvent) -> list[dict[str, Any]]:
        r = self.r
        events: list[dict[str, Any]] = []
        if self.message_at is None and not self.calls:  # nothing came: an empty message, as not streamed
            events += self._open_message()
        status, incomplete = finish_status(finish)
        events += self._close_current(status)
        r.model = finish.model_id or r.model
        final = r.build(
            status, self._output(status), usage=finish.usage, incomplete=incomplete, finish=finish
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=plain(final))]

    def failure(self, code: str, message: str, param: str | None, kind: str) -> list[dict[str, Any]]:
        """The `error` event names simmer's code; the failed response's `error.code` is one of the codes
        OpenAI's spec lists for it: `invalid_prompt` for a request the server refused, else `server_error`."""
        listed = "invalid_prompt" if kind == "invalid_request_error" else "server_error"
        error = ResponseError(code=listed, message=message)
        failed = self.r.build("failed", self._output("incomplete"), error=error)
        return [
            self.event("error", code=code, message=message, param=param),
            self.event("response.failed", response=plain(failed)),
        ]


def _sse(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"], "data": json.dumps(event, ensure_ascii=False, separators=(",", ":"))}


@dataclass
class ResponsesRenderer:
    response: ResponseObject

    def reply(self, gen: Submission, tokens: list[TokenEvent], finish: FinishEvent) -> Response:
        text = "".join(ev.text for ev in tokens) + finish.text
        body = self.response.final(text, tokens, finish)
        return reply_response(body, headers=gen.headers())

    def stream(self, gen: Submission, started: Started | None) -> Response:
        if started is not None and started.model_id:  # placed on another model than asked for: say so at once
            self.response.model = started.model_id
        return JobEventSource(
            encode(gen.events_until_end(), ResponsesEncoder(gen, EventStream(self.response))),
            ping=gen.rt.keepalive_ping_s,
            headers=gen.headers(),
            shutdown_grace_period=2.0,
            on_close=gen.abandon,  # a no-op unless the generator never ran
        )


@dataclass
class ResponsesEncoder:
    """The Responses API's stream: response.* events numbered in order, and chat's `event: governor`
    events for a stream that asked for them."""

    gen: Submission
    events: EventStream

    def opening(self) -> list[dict[str, str]]:
        return [_sse(event) for event in self.events.opening()]

    def batch(self, item: Batch) -> list[dict[str, str]]:
        return [_sse(event) for event in self.events.delta(item.text, item.events)] if item.events else []

    def end(self, item: End) -> list[dict[str, str]]:
        out = []
        if item.text or item.events or item.finish.tool_calls:
            out = [_sse(event) for event in self.events.delta(item.text, item.events, item.finish)]
        return [*out, *(_sse(event) for event in self.events.closing(item.finish))]

    def error(self, item: Error) -> list[dict[str, str]]:
        out = [_sse(event) for event in self.events.delta(item.text, item.events)] if item.events else []
        error = error_payload(item.error)[1]["error"]
        failure = self.events.failure(error["code"], error["message"], error["param"], error["type"])
        return [*out, *(_sse(event) for event in failure)]

    def started(self, item: Started) -> list[dict[str, str]]:  # the stream opened before the job started
        return [_sse(event) for event in self.events.moved(item.model_id)]

    def switched(self, item: Switched) -> list[dict[str, Any]]:  # the held text went out under the old model
        out: list[dict[str, Any]] = [
            _sse(event) for event in self.events.moved(item.model_id, switch_report(item))
        ]
        governor = governor_event(self.gen.job, item)
        return [*out, governor] if governor is not None else out

    def governor(self, item: GovernorUpdate) -> list[dict[str, str]]:
        governor = governor_event(self.gen.job, item)
        return [governor] if governor is not None else []
