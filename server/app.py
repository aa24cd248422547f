"""`create_app`: wires settings, the worker, middleware, error handlers and routes into one FastAPI app."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from models.protocol import Engine
from models.store.store import ModelStore
from server.api.context import Runtime
from server.api.llamacpp import routes as llamacpp
from server.api.ollama import routes as ollama
from server.api.openai import routes as v1
from server.api.responses import routes as responses
from server.api.simmer import ops, thermal, ui
from server.http.connections import fd_budget
from server.http.errors import ErrorMiddleware, install_handlers
from server.http.governor_headers import LEVEL_HEADER, PAUSED_HEADER, GovernorHeadersMiddleware
from server.http.metrics import Metrics, MetricsMiddleware
from server.http.openapi import install_openapi
from server.http.security import CorsMiddleware, NoCorsMiddleware, SecurityMiddleware
from server.http.stream_slots import StreamSlots, stream_limits
from server.routing.breaker import Breaker
from server.routing.metrics import RoutingCollector
from server.routing.router import build_router
from server.routing.sides import device_view, local_side
from server.serving.contracts import Gate, NoGate
from server.serving.engine_config import engine_threads
from server.serving.governor_gate import GovernorGate
from server.serving.grammars import LLGUIDANCE, Grammars
from server.serving.model_choice import ModelChoice
from server.serving.model_pool import LoadedView
from server.serving.model_setup import serve_single
from server.serving.request import SamplingDefaults
from server.serving.summary import Summarizer, summary_models
from server.serving.worker import Worker
from server.settings import Settings, hub_config

__all__ = ["Runtime", "create_app"]

SHUTDOWN_JOIN_S = 2.0  # how long shutdown waits for the worker to leave the engine


def create_app(
    settings: Settings,
    engine: Engine | None = None,
    *,
    engine_factory: Callable[[], Engine] | None = None,
    served: ModelChoice | None = None,
    governor: Gate | None = None,
    breaker: Breaker | None = None,
    grammars: Grammars = LLGUIDANCE,
) -> FastAPI:
    """Build the app over what it serves: `served` (serving/model_choice.py: the served models, their pool
    and ladder; serving/model_setup.py builds it), or one ready `engine`, or an `engine_factory` that the
    worker thread calls at startup (GET /health answers 503 "loading" until it returns). `governor` is the
    worker's gate; `breaker` replaces the upstream breaker built from settings (tests pass one on a fake
    clock); `grammars` the seam every request's grammar is converted and checked through
    (server/serving/grammars.py)."""
    if sum(x is not None for x in (engine, engine_factory, served)) != 1:
        raise ValueError("pass exactly one of engine, engine_factory or served")
    if served is None:
        load = engine_factory if engine_factory is not None else (lambda: engine)
        served = serve_single(settings, load)  # type: ignore[arg-type]
    gate: Gate = governor or NoGate()
    governed = gate if isinstance(gate, GovernorGate) else None
    worker_box: list[Worker] = []
    metrics = Metrics(queue_depth=lambda: worker_box[0].queue_depth if worker_box else 0)

    # The sliding window's summary: the smallest loaded chat model of the ladder writes it, in idle time only,
    # and only while the governor lets heavy background work run (nominal, foreground, charged or plugged in).
    summarizer = (
        Summarizer(
            lambda: summary_models(served.ladder_models(), served.default_model, served.can_chat),
            allowed=lambda: gate.background.runs,
        )
        if settings.summary
        else None
    )
    worker = Worker(
        served.pool,
        max_queue=settings.max_queue,
        gate=gate,
        metrics=metrics,
        place=served.place,
        preload=served.preload,
        window=summarizer,
        ladder=served.ladder,
        max_batch=settings.max_batch,
        encoder_threads=engine_threads(settings),
        encoder_variant=settings.variant,
        stand_in=served.stand_in if settings.cold_start == "stand_in" else None,
        stand_in_at_start=served.start_stand_in if settings.cold_start == "stand_in" else lambda start: None,
        # idle bigger models stay loaded above the rung while memory keeps the start's headroom
        keep_warm=served.start.headroom_bytes if served.start is not None else None,
    )
    if summarizer is not None:
        worker.add_idle_work(summarizer)
        metrics.watch_summaries(summarizer)
    worker_box.append(worker)
    gate.subscribe(worker.publish_governor)
    if governed is not None:  # its pace controller hears of every load; export its state
        served.pool.loading = governed.loading
        served.pool.on_loaded = governed.models_loaded
        governed.models_loaded(served.pool.loaded_ids())  # nothing yet: the start rung counts its load's heat
        metrics.watch_governor(governed, lambda: _variant(served.pool.last_served()))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if governed is not None:  # its own polling thread
            governed.start()
        worker.start()  # loads the model in the background
        try:
            yield
        finally:
            await runtime.router.aclose()  # type: ignore[union-attr]
            worker.close()
            worker.join(SHUTDOWN_JOIN_S)
            if governed is not None:
                governed.stop()
            runtime.store_executor.shutdown(wait=False, cancel_futures=True)  # pulls not started yet
            runtime.tokenizer_executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="simmer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime = Runtime(
        model=served.default_model,
        worker=worker,
        served=served,
        metrics=metrics,
        governor=governed,
        stream_interval_s=settings.stream_interval_ms / 1000,
        keepalive_ping_s=settings.keepalive_ping_s,
        stream_start_wait_s=settings.keepalive_ping_s,
        started=int(time.time()),
        sampling_defaults=SamplingDefaults(
            temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p
        ),
        store_home=settings.home,
        model_store=ModelStore(
            settings.home,
            hub=hub_config(settings),
            # a pull's conversion runs in this process: it may take what the loaded models leave
            memory_free=lambda: served.pool.budget.free(sum(m.bytes for m in served.pool.loaded().values())),
            memory_budget=served.pool.budget.describe() + ", less the loaded models,",
        ),
        summarizer=summarizer,
        pull_dirs=tuple(settings.pull_dirs),
        api_key_set=bool(settings.api_key),
        batch_fast=settings.batch == "fast",
        grammars=grammars,
        event_streams=StreamSlots(*stream_limits(fd_budget(settings.max_connections).cap)),
    )
    # routing: a read-only view of the worker and of the governor; nothing leaves unless settings say so
    runtime.router = build_router(
        settings,
        local_side(worker, served.ids, served.default_model),
        device_view(governed),
        breaker=breaker,
    )
    if governed is not None and runtime.router.offloads:  # a pause sends queued auto work upstream
        governed.subscribe(lambda _state: runtime.router.device_changed())  # type: ignore[union-attr]
    metrics.registry.register(RoutingCollector(runtime.router))
    install_handlers(app)
    install_openapi(app, api_key=bool(settings.api_key))
    app.include_router(v1.router)
    app.include_router(responses.router)
    app.include_router(ollama.router)
    app.include_router(llamacpp.router)
    app.include_router(ops.router)
    app.include_router(thermal.router)
    app.include_router(ui.router)
    ui.mount_static(app)

    # Middleware: last added runs first. From the outside in:
    #   Metrics  counts every response by status, refusals and 500s included;
    #   Governor the governor's level and pause as headers on every API response, refusals included;
    #   Errors   turns any exception that escapes into an OpenAI-shaped answer (never a dropped connection);
    #   Security refuses foreign Hosts, missing keys and big bodies before any work;
    #   CORS     answers preflights for configured origins only.
    if settings.cors_origins:
        app.add_middleware(
            CorsMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "HEAD", "POST", "DELETE", "OPTIONS"],  # DELETE: Ollama's /api/delete
            allow_headers=["Authorization", "Content-Type", "X-Simmer-Route"],
            # so a web app can tell where a reply was served, and what the governor did
            expose_headers=["X-Simmer-Route", LEVEL_HEADER, PAUSED_HEADER],
        )
    else:  # CORS off: every preflight gets the documented 403, not the router's 405
        app.add_middleware(NoCorsMiddleware)
    app.add_middleware(
        SecurityMiddleware,
        allowed_hosts=settings.allowed_hosts,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
    )
    app.add_middleware(ErrorMiddleware)
    app.add_middleware(
        GovernorHeadersMiddleware, snapshot=governed.snapshot if governed is not None else None
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def _variant(view: LoadedView | None) -> str | None:
    return view.variant if view is not None else None
