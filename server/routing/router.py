"""The route step: gather what routing needs, ask the pure policy, and start the job on that side.

`Router.plan()` decides before any work (and refuses what must be refused); `Router.start()` replaces the
worker's submit for both sides. Either side feeds the job's sink with the same events, so the response code
after it does not know where the reply comes from. Two ways a side can change before the first token:
- an upstream attempt fails before its first token: the job goes to the local worker when the decision
  allows (`fallback`), else the client gets `upstream_unavailable`;
- an auto request that the local side refuses before starting (queue full, prompt over the context cap, the
  device paused it too long, the model cannot load) is decided again with what the refusal taught, and may
  go upstream.
And one more before the worker takes it from the queue: when the governor starts holding new work (a pause,
the device killed the app), an auto job still queued is decided again and may go upstream (device_changed;
the worker gives it back unstarted, Worker.take_back).
After the first token a reply stays where it is; an upstream failure then ends the stream with an error
event and [DONE] (api/common/streaming.py), never a restart on the other side.

Under the pace controller the policy also reads the thermal pace (DeviceState.pace_tok_s) and the work ahead
of a new local job (LocalSide.tokens_ahead); the router keeps the pace floor's hysteresis state (`slow`,
policy.pace_slow) from one request to the next.

Accounting (serving/accounting.py): for a job served upstream the relay is the worker's half of the request's
one record: it feeds the tokens and the usage, and ends that half when the upstream task ends, unless the
job went to the local worker (which then ends it). A local refusal that goes upstream is a hand-over.

The governor is read through `device_view(gate)`, the worker through `LocalSide` (server/routing/sides.py):
both read-only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from models.errors import (
    ContextLengthExceeded,
    DeviceOverheated,
    InsufficientMemory,
    InvalidParameter,
    ModelNotFound,
    SimmerError,
)
from models.types import FinishEvent, TokenEvent
from server.refusals import (
    DevicePaused,
    ModelLoading,
    ServerBusy,
    ShuttingDown,
    UpstreamNotAllowed,
    UpstreamUnavailable,
)
from server.routing.breaker import Breaker
from server.routing.decision import (
    HOME_FACTOR,
    MODES,
    NOT_ALLOWED,
    NOT_FOUND,
    DeviceState,
    RouteInputs,
    Side,
    Work,
    decide_route,
    pace_slow,
    strictest,
)
from server.routing.embeddings import embeddings_body, embeddings_error
from server.routing.embeddings import fetch as fetch_embeddings
from server.routing.relay import ChunkReader, relay
from server.routing.sides import LocalSide
from server.routing.upstream import Endpoint, UpstreamClient, UpstreamFailure, forward_body, to_simmer_error
from server.serving.contracts import Job
from server.serving.embedding import Embedded
from server.serving.events import Failed, Started
from server.serving.request import Mode
from server.settings import Settings

log = logging.getLogger("simmer.routing")

HEADER = "X-Simmer-Route"


@dataclass
class Route:
    """Where one request is served and why. Mutable: a fallback moves it before the first token."""

    side: Side
    reason: str
    model: str  # the id the client asked for (the local model's id when it named none)
    upstream_model: str | None
    fallback: bool
    inputs: RouteInputs

    def header(self) -> str:
        return f"{self.side}; reason={self.reason}"

    def as_dict(self) -> dict[str, str]:
        return {"served": self.side, "reason": self.reason}


# Local refusals before the first token that an auto request may answer by going upstream, and what each
# teaches the policy.
def _hint(error: BaseException) -> dict[str, Any] | None:
    if isinstance(error, ContextLengthExceeded):
        return {"prompt_over_context": True}
    if isinstance(error, ServerBusy):
        return {"queue_full": True}
    if isinstance(error, DevicePaused | DeviceOverheated | ModelLoading | InsufficientMemory):
        return {}  # the fresh device and local state say it
    return None


@dataclass(frozen=True)
class Held:
    """An auto job waiting in the local queue (a pause may send it upstream), and its own sink."""

    route: Route
    job: Job
    original: Callable[[object], None]


class Router:
    def __init__(
        self,
        *,
        policy: Mode,
        local: LocalSide,
        device: Callable[[], DeviceState | None],
        upstream: UpstreamClient | None = None,
        upstream_models: Mapping[str, str] | None = None,
        breaker: Breaker | None = None,
        min_local_tok_s: float = 0.0,
        max_local_wait_s: float = 0.0,
        upstream_stall_s: float = 120.0,
        upstream_deadline_s: float = 600.0,
    ) -> None:
        self.policy = policy
        self.local = local
        self.device = device
        self.upstream = upstream
        self.upstream_models = dict(upstream_models or {})
        self.breaker = breaker or Breaker()
        self.min_local_tok_s = min_local_tok_s
        self.max_local_wait_s = max_local_wait_s
        self.upstream_stall_s = upstream_stall_s  # an upstream reply without a token this long ends
        self.upstream_deadline_s = upstream_deadline_s  # and one that takes longer than this in all
        self.slow = False  # pace_slow()'s state: the local pace is under the floor, not yet home
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        # auto jobs queued locally and not started: a pause may send them upstream (device_changed)
        self._held: dict[int, Held] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- what the routes show ---------------------------------------------------------------------------
    @property
    def offloads(self) -> bool:
        """Can anything leave the device at all?"""
        return self.upstream is not None and self.policy != "local"

    def remote_models(self) -> list[str]:
        """Ids served only upstream (listed by /v1/models as remote). None under policy local."""
        if not self.offloads:
            return []
        local = self.local.served_ids()
        return sorted(m for m in self.upstream_models if m not in local)

    def state(self) -> dict[str, Any]:
        """Routing as /v1/thermal shows it. Counts, states and names only: never text, never the key."""
        view = self.breaker.view()
        device = self.device()
        requests: dict[str, dict[str, int]] = {"local": {}, "upstream": {}}
        for (side, reason), n in sorted(self.requests.items()):
            requests[side][reason] = n
        return {
            "policy": self.policy,
            "upstream": {
                "configured": self.upstream is not None,
                "url": self.upstream.display_url if self.upstream else None,
                "remote_models": self.remote_models(),
            },
            "breaker": {
                "state": view.state,
                "consecutive_failures": view.consecutive_failures,
                "retry_in_s": view.retry_in_s,
                "opened": view.opened,
                "last_failure": view.last_failure,
            },
            "pace": {
                # the thermal pace now (null: heat does not bind, or no known cost per token)
                "local_tok_s": None
                if device is None or device.pace_tok_s is None
                else round(device.pace_tok_s, 2),
                "min_local_tok_s": self.min_local_tok_s,
                "slow": self.slow,  # as the last request found it (home only at HOME_FACTOR x the floor)
                "max_local_wait_s": self.max_local_wait_s,
                "local_tokens_ahead": self.local.tokens_ahead(),
            },
            "requests": requests,
            "upstream_failures": dict(sorted(self.failures.items())),
        }

    # -- the decision -----------------------------------------------------------------------------------
    def plan(
        self, model: str | None, body_route: Mode | None, header_route: str | None, *, truncate: bool
    ) -> Route:
        return self._plan(model, body_route, header_route, truncate=truncate, work="generate")

    def plan_embeddings(self, model: str | None, body_route: Mode | None, header_route: str | None) -> Route:
        """Where an embeddings request is served: the same policy, for work that makes no tokens
        (decision.py's embed rows). The generation model's load state is not asked: asking starts its
        load, and the encoder opens in the job anyway."""
        return self._plan(model, body_route, header_route, truncate=False, work="embed")

    def _plan(
        self,
        model: str | None,
        body_route: Mode | None,
        header_route: str | None,
        *,
        truncate: bool,
        work: Work,
    ) -> Route:
        requested = strictest(body_route, _parse_header(header_route))
        model = model or None  # "" names no model, as before routing: the served one
        local_ids = self.local.served_ids()
        model_local = model is None or model in local_ids
        name = (model or self.local.default_model()) if model_local else model
        configured = self.upstream is not None
        inputs = RouteInputs(
            policy=self.policy if configured else "local",
            requested=requested,
            upstream_available=configured and self.breaker.available(),
            model_local=model_local,
            model_upstream=configured and (model_local or name in self.upstream_models),
            local=self.local.state() if work == "generate" else "ready",
            queue_full=self.local.queue_full(),
            truncate=truncate,
            max_local_wait_s=self.max_local_wait_s,
            work=work,
            **self._device_inputs(),
        )
        decision = decide_route(inputs)
        if decision.side is None:
            raise self._refusal(decision.refusal, model, inputs)
        upstream_model = None
        if configured:
            upstream_model = self.upstream_models.get(name) or self.upstream_models.get(model or "") or name
        return Route(decision.side, decision.reason, name, upstream_model, decision.fallback, inputs)

    def _device_inputs(self) -> dict[str, Any]:
        """The device now, the pace floor's state moved on with it, and the work ahead of a new local job."""
        device = self.device()
        slow = self.offloads and pace_slow(self.slow, device, self.min_local_tok_s)
        if slow != self.slow:
            pace = device.pace_tok_s if device else None
            log.info(
                "local pace %s tok/s: %s",
                f"{pace:.1f}" if pace is not None else "unpaced",
                f"under {self.min_local_tok_s:g}, auto sends new work upstream"
                if slow
                else f"back to {HOME_FACTOR:g} x {self.min_local_tok_s:g} or unpaced, new work stays here",
            )
            self.slow = slow
        return {"device": device, "pace_slow": slow, "local_tokens_ahead": self.local.tokens_ahead()}

    def _refusal(self, code: str | None, model: str | None, inputs: RouteInputs) -> SimmerError:
        if code == NOT_ALLOWED:
            return UpstreamNotAllowed(
                "This server keeps every request on the device (SIMMER_ROUTE=local): "
                "route=upstream is not allowed"
            )
        if code == NOT_FOUND:
            served = sorted({*self.local.served_ids(), *self.remote_models()})
            where = "is not served locally" if inputs.requested == "local" else "does not exist"
            return ModelNotFound(
                f"The model '{model}' {where}; this server serves {', '.join(map(repr, served))}",
                param="model",
            )
        view = self.breaker.view()
        return UpstreamUnavailable(
            f"The upstream is unavailable (breaker {view.state} after {view.last_failure or 'failures'}); "
            "retry later or allow local serving",
            retry_after_s=view.retry_in_s or None,
        )

    # -- starting the job -------------------------------------------------------------------------------
    def start(self, route: Route, job: Job) -> None:
        """Replaces worker.submit(job): start the job where `route` says. Raises like submit (busy, loading,
        shutting down) when the local side refuses at once and no other side may take it."""
        if route.side == "upstream":
            self._start_upstream(route, job)
            return
        original = job.sink
        if self.offloads:
            job.sink = self._watch_local_start(route, job, original)
        try:
            self.local.submit(job)
        except SimmerError as err:
            job.sink = original
            self._held.pop(id(job), None)
            if not self._reroute(route, job, err):
                raise
            return
        self.count(route)

    def _watch_local_start(
        self, route: Route, job: Job, original: Callable[[object], None]
    ) -> Callable[[object], None]:
        """The job's sink, watching for a refusal before Started (on the worker's thread)."""
        loop = self._loop = asyncio.get_running_loop()
        started = False
        if route.inputs.requested != "local":  # may still leave while it waits in the queue
            self._held[id(job)] = Held(route, job, original)
            job.cancel.on_cancel(lambda: self._held.pop(id(job), None))  # the client left while queued

        def sink(item: object) -> None:
            nonlocal started
            if isinstance(item, Started | Failed):
                self._held.pop(id(job), None)
            if isinstance(item, Started):
                started = True
            elif not started and isinstance(item, Failed) and _hint(item.error) is not None:
                job.sink = original
                if job.account is not None:  # the worker lets go (worker_done) but may not have the last word
                    job.account.handing_over()
                loop.call_soon_threadsafe(self._reroute_or_fail, route, job, item)
                return
            original(item)

        return sink

    def device_changed(self) -> None:
        """The governor's state changed (any thread: its subscriber). Jobs waiting in the local queue that
        a pause would hold are looked at again on the event loop."""
        loop = self._loop
        if self._held and loop is not None and not self._closing:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(self._move_held)

    def _move_held(self) -> None:
        """New work is held (paused, or the device killed the app): each auto job still in the local queue
        is decided again as if it arrived now, and goes upstream if that is the answer, instead of waiting
        out the pause. Only from the queue: a job the worker took (it may be starting) stays."""
        device = self.device()
        if device is None or not (device.paused or device.killed) or self._closing:
            return
        for route, job, original in [(h.route, h.job, h.original) for h in self._held.values()]:
            if job.cancel.cancelled:
                continue
            inputs = replace(
                route.inputs,
                upstream_available=self.breaker.available(),
                local=self.local.state(),
                device=device,
                pace_slow=self.slow,
            )
            decision = decide_route(inputs)
            if decision.side != "upstream" or not self.local.take_back(job):
                continue
            self._held.pop(id(job), None)
            job.sink = original
            log.info("%s: new work is held here; going upstream from the queue (%s)", job.id, decision.reason)
            route.side, route.reason, route.fallback, route.inputs = (
                "upstream",
                decision.reason,
                decision.fallback,
                inputs,
            )
            self._start_upstream(route, job)

    def _reroute_or_fail(self, route: Route, job: Job, failed: Failed) -> None:
        if job.cancel.cancelled or not self._reroute(route, job, failed.error):
            job.sink(failed)
            job.worker_done()  # nobody took it over

    def _reroute(self, route: Route, job: Job, error: BaseException) -> bool:
        """Decide again with what the local refusal taught; go upstream if that is the answer."""
        hint = _hint(error)
        if hint is None or self.upstream is None or self._closing:
            return False
        inputs = replace(
            route.inputs,
            upstream_available=self.breaker.available(),
            local=self.local.state(),
            **{**self._device_inputs(), **hint},
        )
        decision = decide_route(inputs)
        if decision.side != "upstream":
            return False
        log.info(
            "%s: local refused (%s); going upstream (%s)",
            job.id,
            getattr(error, "code", "?"),
            decision.reason,
        )
        route.side, route.reason, route.fallback, route.inputs = "upstream", decision.reason, False, inputs
        self._start_upstream(route, job)
        return True

    # -- embeddings: one answer, no events (server/routing/embeddings.py) --------------------------------
    def reroute_embeddings(self, route: Route, error: BaseException) -> bool:
        """The local side refused an embeddings request before answering it (busy, paused, overheated):
        decide again with what that taught, as for a generation. True: `route` now says upstream."""
        hint = _hint(error)
        if hint is None or self.upstream is None or self._closing or route.side != "local":
            return False
        inputs = replace(
            route.inputs,
            upstream_available=self.breaker.available(),
            **{**self._device_inputs(), **hint},
        )
        decision = decide_route(inputs)
        if decision.side != "upstream":
            return False
        log.info("embeddings: local refused (%s); going upstream (%s)", type(error).__name__, decision.reason)
        route.side, route.reason, route.fallback, route.inputs = "upstream", decision.reason, False, inputs
        return True

    async def embeddings(
        self,
        rid: str,
        route: Route,
        inputs: list[str] | list[list[int]],
        *,
        dimensions: int | None,
        width: int | None,
    ) -> Embedded | None:
        """The upstream's vectors for `inputs` (`width` each when known). None: it failed before its answer
        and the decision allows the local side, which `route` now names (upstream_failed). Raises the
        refusal otherwise. The whole answer is bounded by the read timeout (it is one piece, as a token is
        in a stream) within the reply timeout."""
        assert self.upstream is not None and route.upstream_model is not None
        probe = self.breaker.begin()
        self.count(route)
        body = embeddings_body(route.upstream_model, inputs, dimensions)
        timeout_s = min(self.upstream_stall_s, self.upstream_deadline_s)
        try:
            got = await fetch_embeddings(self.upstream, body, len(inputs), width, timeout_s=timeout_s)
        except UpstreamFailure as failure:
            self._failed(failure, probe, rid)
            if route.fallback and not self._closing:
                route.side, route.reason, route.fallback = "local", "upstream_failed", False
                log.info("%s: embedding locally after the upstream failed", rid)
                self.count(route)
                return None
            raise embeddings_error(failure, self.breaker.view().retry_in_s or None) from None
        except BaseException:  # the client left (cancelled), or a bug: no verdict on the upstream
            self.breaker.abandon(probe)
            raise
        self.breaker.success(probe)
        return got

    def _start_upstream(self, route: Route, job: Job) -> None:
        assert self.upstream is not None and route.upstream_model is not None
        probe = self.breaker.begin()
        self.count(route)
        request = forward_body(job.request, route.upstream_model)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run_upstream(route, job, job.request.kind, request, probe))
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            # Cancelled (the client left, or shutdown) or a bug: no verdict on the upstream, so free the
            # probe slot. Here, not in the coroutine: a task cancelled before it ran never enters its try.
            self._tasks.discard(t)
            error = None if t.cancelled() else t.exception()
            if not t.cancelled() and error is None:
                if not t.result():  # True: the local worker took the job and ends its account
                    job.worker_done()
                return
            self.breaker.abandon(probe)
            if error is not None:
                log.error("%s: upstream relay failed", job.id, exc_info=error)
                job.sink(Failed(error))
            elif self._closing:
                job.sink(Failed(ShuttingDown("The server is shutting down")))
            job.worker_done()

        task.add_done_callback(done)

        def cancel_task() -> None:  # any thread: the client left or the server cancels the job
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to cancel
                loop.call_soon_threadsafe(task.cancel)

        job.cancel.on_cancel(cancel_task)

    async def _run_upstream(self, route: Route, job: Job, kind: Endpoint, request: dict, probe: bool) -> bool:
        """Relay one upstream reply into the job. True when it failed before its first token and the
        local worker took the job over."""
        assert self.upstream is not None
        reader = ChunkReader(kind, time.monotonic(), _max_tokens(request))
        try:
            await relay(
                self.upstream,
                kind,
                request,
                _accounted(job),
                reader,
                stall_s=self.upstream_stall_s,
                deadline_s=self.upstream_deadline_s,
            )
        except UpstreamFailure as failure:
            self._failed(failure, probe, job.id)
            if reader.started:
                job.sink(Failed(to_simmer_error(failure, mid_reply=True, retry_in_s=None)))
            elif route.fallback and not self._closing:
                return self._fall_back(route, job, failure)
            else:
                retry_in = self.breaker.view().retry_in_s or None
                job.sink(Failed(to_simmer_error(failure, mid_reply=False, retry_in_s=retry_in)))
        else:
            self.breaker.success(probe)
        return False

    def _failed(self, failure: UpstreamFailure, probe: bool, rid: str) -> None:
        self.failures[failure.kind] += 1
        if failure.counts:
            self.breaker.failure(failure.kind, failure.retry_after_s, probe)
        else:
            self.breaker.success(probe)  # the upstream answered: it is up, the request was the problem
        # Kind and status only: an upstream's message may quote the request.
        log.warning(
            "%s: upstream failed: %s%s (breaker %s)",
            rid,
            failure.kind,
            f" HTTP {failure.status}" if failure.status else "",
            self.breaker.state,
        )

    def _fall_back(self, route: Route, job: Job, failure: UpstreamFailure) -> bool:
        """Before the first token: serve locally, as if the request had been local from the start. True
        when the local worker took the job."""
        route.side, route.reason, route.fallback = "local", "upstream_failed", False
        log.info("%s: serving locally after the upstream failed before the first token", job.id)
        job.enqueued_at = time.monotonic()
        try:
            self.local.submit(job)
        except SimmerError as err:
            job.sink(Failed(err))
            return False
        self.count(route)
        return True

    def count(self, route: Route) -> None:
        """A request started on its side (routing's counters; a fallback counts on both)."""
        self.requests[(route.side, route.reason)] += 1
        log.debug("routed %s (%s)", route.side, route.reason)

    async def aclose(self) -> None:
        """Shutdown: end upstream replies in flight (error event + [DONE]), close the pool."""
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.upstream is not None:
            await self.upstream.aclose()


def _accounted(job: Job) -> Callable[[object], None]:
    """The job's sink, also feeding what the upstream produced into the job's account (the worker's half)."""
    sink, account = job.sink, job.account
    if account is None:
        return sink

    def feed(item: object) -> None:
        if isinstance(item, TokenEvent):
            account.token(item)
        elif isinstance(item, FinishEvent):
            account.finished(item)
        sink(item)

    return feed


def _max_tokens(request: dict) -> int | None:
    """The reply cap the client asked for (forwarded, and applied to what comes back)."""
    value = request.get("max_completion_tokens") or request.get("max_tokens")
    return value if isinstance(value, int) else None


def _parse_header(value: str | None) -> Mode | None:
    if value is None or not value.strip():
        return None
    mode = value.strip().lower()
    if mode not in MODES:
        raise InvalidParameter(
            f"{HEADER} must be one of local, auto, upstream, not {value.strip()!r}", param=HEADER
        )
    return mode  # type: ignore[return-value]


def build_router(
    settings: Settings,
    local: LocalSide,
    device: Callable[[], DeviceState | None],
    *,
    breaker: Breaker | None = None,
) -> Router:
    """The router for these settings. No connection opens until a request goes upstream."""
    upstream = None
    if settings.upstream_url:
        key = settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None
        upstream = UpstreamClient(
            settings.upstream_url,
            key,
            ca_bundle=settings.upstream_ca_bundle,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            read_timeout_s=settings.upstream_read_timeout_s,
            max_connections=settings.upstream_max_connections,
        )
    return Router(
        policy=settings.route,
        local=local,
        device=device,
        upstream=upstream,
        upstream_models=settings.upstream_models,
        breaker=breaker or Breaker(settings.upstream_breaker_failures, settings.upstream_breaker_cooldown_s),
        min_local_tok_s=settings.route_min_local_tok_s,
        max_local_wait_s=settings.route_max_local_wait_s,
        upstream_stall_s=settings.upstream_read_timeout_s,
        upstream_deadline_s=settings.upstream_reply_timeout_s,
    )
