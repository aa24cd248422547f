"""`create_app`: wires settings, the worker, middleware, error handlers and routes into one FastAPI app."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from models.protocol import Engine
from models.store.store import ModelStore
from server.cli import hub_config
from server.errors import ErrorMiddleware, install_handlers
from server.governor_headers import LEVEL_HEADER, PAUSED_HEADER, GovernorHeadersMiddleware
from server.metrics import Metrics, MetricsMiddleware
from server.openapi import install_openapi
from server.routes import llamacpp, ollama, ops, responses, thermal, ui, v1
from server.routing.breaker import Breaker
from server.routing.metrics import RoutingCollector
from server.routing.router import Router, build_router, device_view, local_side
from server.schemas import SamplingDefaults
from server.security import CorsMiddleware, SecurityMiddleware
from server.settings import Settings
from server.worker import Gate, NoGate, Worker

SHUTDOWN_JOIN_S = 2.0  # how long shutdown waits for the worker to leave the engine


@dataclass
class Runtime:
    """What handlers need, as plain values (handlers never read Settings)."""

    model: str
    worker: Worker
    metrics: Metrics
    gate: Gate
    stream_interval_s: float
    keepalive_ping_s: float
    stream_start_wait_s: float
    started: int
    sampling_defaults: SamplingDefaults
    router: Router | None = None  # set by create_app; where each request is served (server/routing/)
    store_home: Path | None = None  # the model store, for /health's model_problem (None: not from a store)
    model_store: ModelStore | None = None  # installed models: Ollama's /api/tags, /api/show, pull, delete

    def model_id(self) -> str:
        engine = self.worker.engine
        return engine.model_id if engine is not None else self.model

    def served_ids(self) -> set[str]:
        return {self.model, self.model_id()}


def create_app(
    settings: Settings,
    engine: Engine | None = None,
    *,
    engine_factory: Callable[[], Engine] | None = None,
    governor: Gate | None = None,
    breaker: Breaker | None = None,
) -> FastAPI:
    """Build the app. Pass a ready `engine`, or an `engine_factory` that the worker thread calls at
    startup (GET /health answers 503 "loading" until it returns). `governor` is the worker's gate;
    `breaker` replaces the upstream breaker built from settings (tests pass one on a fake clock)."""
    if (engine is None) == (engine_factory is None):
        raise ValueError("pass exactly one of engine or engine_factory")
    load = engine_factory if engine_factory is not None else (lambda: engine)
    gate = governor or NoGate()
    worker_box: list[Worker] = []
    metrics = Metrics(queue_depth=lambda: worker_box[0].queue_depth if worker_box else 0)
    worker = Worker(
        load,  # type: ignore[arg-type]
        max_queue=settings.max_queue,
        gate=gate,
        metrics=metrics,
        keep_alive_s=settings.keep_alive_s,
    )
    worker_box.append(worker)
    subscribe = getattr(governor, "subscribe", None)
    if callable(subscribe):
        subscribe(worker.publish_governor)
    if hasattr(governor, "governor") and hasattr(governor, "snapshot"):  # a GovernorGate: export its state
        metrics.watch_governor(governor, lambda: worker.engine.variant if worker.engine else None)

    # A governor gate has its own polling thread; plain gates (NoGate, test fakes) do not.
    gate_start = getattr(gate, "start", None)
    gate_stop = getattr(gate, "stop", None)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if callable(gate_start):
            gate_start()
        worker.start()  # loads the model in the background
        try:
            yield
        finally:
            await runtime.router.aclose()  # type: ignore[union-attr]
            worker.close()
            worker.join(SHUTDOWN_JOIN_S)
            if callable(gate_stop):
                gate_stop()

    app = FastAPI(title="simmer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime = Runtime(
        model=settings.model,
        worker=worker,
        metrics=metrics,
        gate=gate,
        stream_interval_s=settings.stream_interval_ms / 1000,
        keepalive_ping_s=settings.keepalive_ping_s,
        stream_start_wait_s=settings.keepalive_ping_s,
        started=int(time.time()),
        sampling_defaults=SamplingDefaults(
            temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p
        ),
        store_home=settings.home,
        model_store=ModelStore(settings.home, hub=hub_config(settings)),
    )
    # routing: a read-only view of the worker and of the governor; nothing leaves unless settings say so
    runtime.router = build_router(
        settings, local_side(worker, runtime.served_ids, runtime.model_id), device_view(gate), breaker=breaker
    )
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
    app.add_middleware(
        SecurityMiddleware,
        allowed_hosts=settings.allowed_hosts,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
    )
    app.add_middleware(ErrorMiddleware)
    snapshot = getattr(gate, "snapshot", None)
    app.add_middleware(GovernorHeadersMiddleware, snapshot=snapshot if callable(snapshot) else None)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
