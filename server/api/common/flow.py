"""What every generating endpoint shares, whatever its dialect (OpenAI chat and completions, Ollama's
/api/chat and /api/generate, the Responses API): route and submit a job, then answer with one body or a
stream. Handlers stay ten lines; everything about the worker and the stream lifecycle is here.

A dialect is a `Renderer`: it turns the collected tokens into one response, or the coalesced events
(server/api/common/streaming.py) into its streaming response. The shared steps, on the one internal request
(server/serving/request.py) the dialect's translation drafted:
    start()   route (local or upstream), parse once, submit; busy / loading / a bad model or grammar refuse
              here, before any work
    respond() not streamed: wait for every event (cancel when the client leaves), then renderer.reply();
              streamed: hold the headers until the prompt is built (a too-long prompt is still a real 413),
              then renderer.stream(); the stream's end (done, error, client gone) is accounted for once.

Accounting (serving/accounting.py): the job carries one RequestAccount; the worker (or the upstream relay)
closes one half, this module the other (`Submission.end`, `Submission.abandon`), and the record (the log
line and the token counters of /metrics) is written once both are in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from fastapi import Request
from fastapi.responses import Response

from models.errors import Cancelled, ModelNotChat, ModelNotFound, WrongModelKind
from models.runtime.sampling import validate as validate_sampling
from models.types import KIND_GENERATION, FinishEvent, TokenEvent
from server.api.common.streaming import Item, coalesced
from server.logs import RequestRecord, log_request
from server.refusals import ShuttingDown
from server.routing.router import HEADER as ROUTE_HEADER
from server.routing.router import Route
from server.serving.accounting import RequestAccount
from server.serving.cache_scope import cache_scope
from server.serving.contracts import Job, loop_sink
from server.serving.events import Failed, Started
from server.serving.grammars import CHECKS, Grammars
from server.serving.request import Draft, GenerationRequest, SamplingDefaults, check, parse
from server.serving.turn_order import client_of

if TYPE_CHECKING:
    from server.api.context import Runtime

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


BATCH_HEADER = "X-Simmer-Batch"


@dataclass
class Submission:
    """One submitted job: its events, where it runs, and its accounting."""

    rt: Runtime
    job: Job
    events: asyncio.Queue
    route: Route
    model: str  # as the reply names it
    stream: bool
    account: RequestAccount
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None  # when the worker (or the upstream) started the job
    # events taken off the queue while the headers were held, for the stream to send first
    held: list[object] = field(default_factory=list)

    @property
    def rid(self) -> str:
        return self.job.id

    def headers(self) -> dict[str, str]:
        """The reply's headers: where it was served (X-Simmer-Route); with SIMMER_BATCH=fast, that a local
        reply's text may depend on the replies batched beside it (X-Simmer-Batch: fast)."""
        headers = {ROUTE_HEADER: self.route.header()}
        if self.rt.batch_fast and self.route.side == "local":
            headers[BATCH_HEADER] = "fast"
        return headers

    def mark_started(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def end(self, outcome: str, sent_tokens: int) -> None:
        """How the request ended for its client (the route's half of the account; the first call counts).
        A generation stopped by its cancel token ends with finish_reason `cancelled`: its client left."""
        self.account.route_done("client_gone" if outcome == "cancelled" else outcome, sent_tokens)

    def abandon(self) -> None:
        """The client is gone: stop the job, take it out of the queue if it never started, end the route's
        half of its account (the worker ends the other once it lets go of the job). A no-op for a request
        whose route already ended (the stream's own end got there first)."""
        if self.account.route_ended:
            return
        self.job.cancel.cancel()
        self.rt.worker.withdraw(self.job)
        self.end("client_gone", 0)

    def stream_end(self, finish: FinishEvent | None, error: BaseException | None, sent: int) -> None:
        self.end(finish.finish_reason if finish else _error_code(error) if error else "client_gone", sent)

    def events_until_end(self) -> AsyncIterator[Item]:
        """The coalesced stream (server/api/common/streaming.py) of this job, with its end accounted for."""
        return coalesced(
            self.job,
            self.events,
            interval_s=self.rt.stream_interval_s,
            on_end=self.stream_end,
            first=self.held,
        )


def write_record(rt: Runtime, record: RequestRecord) -> None:
    """The request's log line and its share of the token metrics, from the same record (any thread)."""
    rt.metrics.add_tokens(record.prompt_tokens, record.completion_tokens)
    rt.metrics.completions.labels(outcome=record.outcome).inc()
    log_request(record)


def _error_code(error: BaseException) -> str:
    if isinstance(error, Cancelled):  # the worker saw the token its client's leaving fired (a race)
        return "client_gone"
    return getattr(error, "code", None) or "internal_error"


def _parse_and_check(
    draft: Draft, defaults: SamplingDefaults, grammars: Grammars, model: str, scope: str
) -> GenerationRequest:
    req = parse(draft, defaults, grammars, model=model, cache_scope=scope)
    check(req, grammars)
    return req


async def start(request: Request, draft: Draft, *, rid: str) -> Submission:
    """Route, parse and submit the job (instead of worker.submit). Raises, before any work, what the router
    or the worker refuses: an unknown model, a forbidden upstream, a grammar that does not compile, busy,
    loading, closing."""
    rt: Runtime = request.app.state.runtime
    assert rt.router is not None
    arrived = time.monotonic()
    # routing: where this request is served and why (refuses an unknown model or a forbidden upstream)
    header = request.headers.get(ROUTE_HEADER)
    route = rt.router.plan(draft.model, draft.route, header, truncate=draft.asked.truncate)
    model = route.model
    scope = cache_scope(
        api_key_set=rt.api_key_set,
        authorization=request.headers.get("authorization"),
        cache_salt=draft.cache_salt,
    )
    # The one parse: defaults merged, the grammar the reply follows converted and compiled once, off the
    # event loop on a thread with a large stack: a schema or grammar llguidance refuses is a 400 naming
    # the dialect's field, before any work.
    req = await asyncio.wrap_future(
        CHECKS.submit(_parse_and_check, draft, rt.sampling_defaults, rt.grammars, model, scope)
    )
    if route.side == "local":
        if rt.served.resolve(model) is None:  # known a moment ago, removed from the store since
            raise ModelNotFound(f"The model '{model}' is not installed", param="model")
        entry = rt.served.resolve(model)
        if entry is not None and entry.kind != KIND_GENERATION:  # an embedding model makes no text
            raise WrongModelKind.for_model(entry.id, entry.kind)
        # at once, before any queue: a chat request needs a model (or a ladder rung below it) that chats
        if req.kind == "chat" and not rt.served.serves_chat(model):
            raise ModelNotChat.for_model(model)
        entry = rt.served.resolve(model)
        if entry is not None and entry.vocab_size is not None:  # logit_bias ids against the vocabulary
            validate_sampling(req.params.sampling, entry.vocab_size)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    account = RequestAccount.for_request(
        req,
        id=rid,
        model=route.model,
        emit=lambda record: write_record(rt, record),
        route=lambda: f"{route.side}/{route.reason}",  # read at the end: a fallback may move it
    )
    client = client_of(
        api_key_set=rt.api_key_set,
        authorization=request.headers.get("authorization"),
        peer=request.client.host if request.client else None,
    )
    job = Job(id=rid, request=req, sink=loop_sink(loop, events), account=account, client=client)
    # Instead of worker.submit: local or upstream; busy / loading / closing raise here, before any work.
    rt.router.start(route, job)
    return Submission(rt, job, events, route, route.model, req.show.stream, account, arrived=arrived)


async def collect(request: Request, gen: Submission) -> tuple[list[TokenEvent], FinishEvent] | None:
    """Every token and the finish; None when the client left first (the job is cancelled). A failure is
    raised (the app's handlers answer it)."""
    tokens: list[TokenEvent] = []
    try:
        async with disconnect_watch(request, gen.job) as gone:
            while True:
                item = await _next_event(gen.events, gone)
                if isinstance(item, TokenEvent):
                    tokens.append(item)
                elif isinstance(item, Started):
                    gen.mark_started()
                elif isinstance(item, Failed):
                    gen.end(_error_code(item.error), 0)
                    raise item.error
                elif isinstance(item, FinishEvent):
                    if item.finish_reason == "cancelled":  # the client left; the engine stopped first
                        raise ClientGone
                    gen.mark_started()
                    gen.end(item.finish_reason, item.usage.completion_tokens)
                    return tokens, item
    except ClientGone:
        gen.abandon()
        return None
    except asyncio.CancelledError:  # from outside: the server is going away
        gen.abandon()
        raise


async def wait_started(request: Request, gen: Submission) -> Started | Literal[False] | None:
    """Hold the response headers until the prompt is built (usually milliseconds), so a prompt that is too
    long still gets a real 413 instead of an error in the stream. If the job waits in the queue longer than
    the ping interval, start the stream anyway (None): pings keep the client and proxies from timing out.
    A shutdown while holding starts the stream too (None): an open stream ends with its error event.
    False: the client left. Any other failure before the start is raised."""
    deadline = time.monotonic() + gen.rt.stream_start_wait_s
    try:
        async with disconnect_watch(request, gen.job) as gone:
            while True:
                item = await _next_event(gen.events, gone, until=deadline)
                if isinstance(item, Failed):
                    if isinstance(item.error, ShuttingDown):
                        gen.held.append(item)
                        return None
                    gen.end(_error_code(item.error), 0)
                    raise item.error
                if isinstance(item, Started):
                    gen.mark_started()
                    return item
    except ClientGone:
        gen.abandon()
        return False
    except TimeoutError:
        return None
    except asyncio.CancelledError:
        gen.abandon()
        raise


class Renderer(Protocol):
    """One dialect's answers."""

    def reply(self, gen: Submission, tokens: list[TokenEvent], finish: FinishEvent) -> Response: ...

    def stream(self, gen: Submission, started: Started | None) -> Response: ...


async def respond(request: Request, gen: Submission, renderer: Renderer) -> Response:
    if gen.stream:
        started = await wait_started(request, gen)
        if started is False:
            return Response(status_code=499)  # nobody reads it; uvicorn needs an answer
        return renderer.stream(gen, started)
    got = await collect(request, gen)
    if got is None:
        return Response(status_code=499)
    return renderer.reply(gen, *got)
