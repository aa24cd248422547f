"""What /v1/chat/completions and /v1/completions share: submit a job, then answer with one JSON body or
an SSE stream. Handlers stay ten lines; everything about the worker and the stream lifecycle is here."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from models.errors import ModelNotChat
from models.runtime.sampling import validate as validate_sampling
from models.types import FinishEvent, TokenEvent
from server.logs import RequestRecord, log_request
from server.routing.router import HEADER as ROUTE_HEADER
from server.routing.router import Route
from server.schemas import ChunkBuilder, _GenerationRequest, chat_completion, text_completion
from server.streaming import sse_stream
from server.worker import Failed, Job, Started, loop_sink

if TYPE_CHECKING:
    from server.app import Runtime

DISCONNECT_POLL_S = 0.05  # how often a waiting non-stream request checks that its client is still there


class ClientGone(Exception):
    pass


async def _watch_disconnect(request: Request, job: Job, gone: asyncio.Event) -> None:
    """Poll until the client disconnects, then cancel the job (the worker moves on within one token)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    gone.set()
    job.cancel.cancel()


@contextlib.asynccontextmanager
async def disconnect_watch(request: Request, job: Job) -> AsyncIterator[asyncio.Event]:
    gone = asyncio.Event()
    task = asyncio.create_task(_watch_disconnect(request, job, gone))
    try:
        yield gone
    finally:
        task.cancel()


async def _next_event(events: asyncio.Queue, gone: asyncio.Event, until: float | None = None) -> object:
    """The next worker event. Raises ClientGone once the client left, TimeoutError when `until`
    (monotonic seconds) passes first."""
    get = asyncio.ensure_future(events.get())
    left = asyncio.ensure_future(gone.wait())
    timeout = None if until is None else max(0.0, until - time.monotonic())
    try:
        await asyncio.wait({get, left}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not get.done():
            get.cancel()
    if get.done() and not get.cancelled():
        return get.result()
    if gone.is_set():
        raise ClientGone
    raise TimeoutError


async def complete(
    request: Request,
    kind: Literal["chat", "text"],
    body: _GenerationRequest,
    payload: list[dict] | str,
) -> Response:
    rt: Runtime = request.app.state.runtime
    assert rt.router is not None
    # routing: where this request is served and why (refuses an unknown model or a forbidden upstream)
    route = rt.router.plan(body.model, body.route, request.headers.get(ROUTE_HEADER), truncate=body.truncate)
    model = route.model
    engine = rt.worker.engine
    if route.side == "local" and kind == "chat" and engine is not None and not engine.can_chat:
        raise ModelNotChat.for_model(model)  # at once (the worker would say it too, maybe after a queue)
    params = body.to_params(rt.sampling_defaults)
    if rt.worker.engine is not None:  # logit_bias ids against the vocabulary: a 400 before any work
        validate_sampling(params.sampling, rt.worker.engine.vocab_size)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = Job(
        id=rid,
        kind=kind,
        payload=payload,
        params=params,
        sink=loop_sink(loop, events),
        governor_events=body.governor_events,
    )
    started_at = time.monotonic()
    endpoint = "chat" if kind == "chat" else "completions"

    def on_end(finish: FinishEvent | None, error: BaseException | None) -> None:
        outcome = (
            finish.finish_reason
            if finish
            else getattr(error, "code", "internal_error")
            if error
            else "client_gone"
        )
        rt.metrics.completions.labels(outcome=outcome).inc()
        log_request(
            RequestRecord(
                id=rid,
                endpoint=endpoint,
                model=model,
                variant=finish.variant if finish else None,
                stream=body.stream,
                prompt_tokens=finish.usage.prompt_tokens if finish else 0,
                completion_tokens=finish.usage.completion_tokens if finish else 0,
                ttft_ms=finish.timings.ttft_ms if finish else 0.0,
                tokens_per_s=finish.timings.predicted_per_second if finish else 0.0,
                outcome=outcome,
                duration_ms=(time.monotonic() - started_at) * 1000,
                route=f"{route.side}/{route.reason}",
            )
        )

    # Instead of worker.submit: local or upstream; busy / loading / closing raise here, before any work.
    rt.router.start(route, job, kind, body, payload)

    if body.stream:
        builder = ChunkBuilder(kind, rid, model)
        builder.final_fields = lambda: {"route": route.as_dict()}
        return await _stream(request, rt, job, events, builder, body, on_end, route)

    tokens: list[TokenEvent] = []
    try:
        async with disconnect_watch(request, job) as gone:
            while True:
                item = await _next_event(events, gone)
                if isinstance(item, TokenEvent):
                    tokens.append(item)
                elif isinstance(item, Failed):
                    on_end(None, item.error)
                    raise item.error
                elif isinstance(item, FinishEvent):
                    finish = item
                    break
    except ClientGone:
        on_end(None, None)
        return Response(status_code=499)  # nobody reads it; uvicorn needs an answer
    on_end(finish, None)
    text = "".join(ev.text for ev in tokens) + finish.text
    build = chat_completion if kind == "chat" else text_completion
    reply = build(rid, model, text, tokens, finish, finish.variant)
    reply["route"] = route.as_dict()
    return JSONResponse(reply, headers={ROUTE_HEADER: route.header()})


async def _stream(
    request: Request,
    rt: Runtime,
    job: Job,
    events: asyncio.Queue,
    builder: ChunkBuilder,
    body: _GenerationRequest,
    on_end,
    route: Route,
) -> Response:
    # Hold the response headers until the prompt is built (usually milliseconds), so a prompt that is too
    # long still gets a real 413 instead of an error chunk. If the job waits in the queue longer than the
    # ping interval, start the stream anyway: pings keep the client (and proxies) from timing out.
    deadline = time.monotonic() + rt.stream_start_wait_s
    try:
        async with disconnect_watch(request, job) as gone:
            while True:
                item = await _next_event(events, gone, until=deadline)
                if isinstance(item, Failed):
                    on_end(None, item.error)
                    raise item.error
                if isinstance(item, Started):
                    builder.variant = item.variant
                    break
    except ClientGone:
        on_end(None, None)
        return Response(status_code=499)
    except TimeoutError:
        pass

    def stream_end(finish: FinishEvent | None, error: BaseException | None, _sent: int) -> None:
        on_end(finish, error)

    return EventSourceResponse(
        sse_stream(
            job,
            events,
            builder,
            interval_s=rt.stream_interval_s,
            include_usage=body.include_usage,
            on_end=stream_end,
        ),
        ping=rt.keepalive_ping_s,
        headers={ROUTE_HEADER: route.header()},
        # Our own shutdown path (Worker.close) ends streams first; this only bounds sse-starlette's.
        shutdown_grace_period=2.0,
    )
