"""OpenAI's Responses API, stateless: POST /v1/responses (server/api/responses/protocol.py has the JSON).

Generation goes through completion_flow like /v1/chat/completions (same worker, queue, governor, router);
this module only renders the reply: one `response` object, or Server-Sent Events named after their `type`
(response.created ... response.completed, or error + response.failed), without a [DONE] line. A reply the
governor moves to another model mid-way gets a response.in_progress naming the new model (with simmer's
`switch`, as chat's `event: governor` has it); the finished response names the model that finished it.
A stream that asked for `governor_events` also gets chat's `event: governor` events (state changes and
switches, server/api/common/streaming.py's governor_event), outside the numbered response.* sequence.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from models.types import FinishEvent, TokenEvent
from server.api.common.flow import Generation, respond, start
from server.api.common.streaming import (
    Batch,
    End,
    Error,
    JobEventSource,
    encode,
    governor_event,
    switch_report,
)
from server.api.responses.protocol import EventStream, ResponseObject, ResponsesRequest
from server.api.responses.translate import draft
from server.http.errors import error_payload
from server.serving.events import GovernorState, Started, Switched

router = APIRouter(prefix="/v1")


def _sse(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"], "data": json.dumps(event, ensure_ascii=False, separators=(",", ":"))}


@dataclass
class ResponsesRenderer:
    response: ResponseObject

    def reply(self, gen: Generation, tokens: list[TokenEvent], finish: FinishEvent) -> Response:
        text = "".join(ev.text for ev in tokens) + finish.text
        body = self.response.final(text, tokens, finish)
        return JSONResponse(body, headers=gen.headers())

    def stream(self, gen: Generation, started: Started | None) -> Response:
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

    gen: Generation
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

    def governor(self, item: GovernorState) -> list[dict[str, str]]:
        governor = governor_event(self.gen.job, item)
        return [governor] if governor is not None else []


@router.post("/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    rid = "resp_" + uuid.uuid4().hex[:24]
    gen = await start(request, draft(body), rid=rid)
    return await respond(request, gen, ResponsesRenderer(ResponseObject(rid, gen.model, body)))
