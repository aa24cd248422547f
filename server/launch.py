"""The server process: `serve(settings)` builds the app and uvicorn, serves until SIGINT/SIGTERM and exits
0 after a graceful SIGTERM (`simmer serve` and `python -m server` are server/cli/serve.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from models.protocol import Engine
from server.app import create_app
from server.http.connections import (
    ConnectionGuard,
    fd_budget,
    guarded_protocol,
    rate_limited_exception_handler,
    widen_listen_queue,
)
from server.http.security import check_bind
from server.logs import setup_logging
from server.serving.contracts import Gate
from server.serving.model_choice import ModelChoice
from server.settings import Settings

log = logging.getLogger("simmer.server")

# uvicorn waits this long for open connections after SIGTERM; our streams end at once (Worker.close), so
# this only bounds stragglers. With the worker join (1 s) the process is gone within 5 s.
GRACEFUL_SHUTDOWN_S = 3


class _Server(uvicorn.Server):
    """uvicorn's server, plus: on SIGINT/SIGTERM, end open streams (error chunk + [DONE]) right away, and
    after a graceful shutdown on SIGTERM exit 0: uvicorn would raise the signal again once it is done, so the
    process would die of it (status -15 / 143) although nothing went wrong. SIGINT keeps uvicorn's way
    (KeyboardInterrupt, exit 130)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # accept() failing for want of descriptors is logged once in a while, not thousands of times a second
        asyncio.get_running_loop().set_exception_handler(rate_limited_exception_handler())
        await super().startup(sockets)
        for server in getattr(self, "servers", []):
            widen_listen_queue(list(server.sockets))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            captured = getattr(self, "_captured_signals", None)  # what uvicorn re-raises after shutdown
            if isinstance(captured, list):
                captured[:] = [s for s in captured if s != signal.SIGTERM]


def build_server(
    settings: Settings,
    *,
    engine_factory: Callable[[], Engine] | None = None,
    served: ModelChoice | None = None,
    governor: Gate | None = None,
) -> uvicorn.Server:
    """Check the bind address, build the app and a uvicorn server for it (not started). Without
    `engine_factory` or `served`, it serves the model store; without `governor`, the governor from settings
    on the ladder (SIMMER_LADDER, checked here: a model that is not installed stops the start)."""
    check_bind(settings.host, settings.api_key)
    if engine_factory is None and served is None:
        from server.serving.model_setup import serve_store  # lazy: heavy (onnxruntime)

        served = serve_store(settings)
    if governor is None:
        governor = gate_for(settings, served)
    app = create_app(settings, engine_factory=engine_factory, served=served, governor=governor)
    budget = fd_budget(settings.max_connections)
    guard = ConnectionGuard(
        cap=budget.cap,
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
    )
    config = uvicorn.Config(
        app,
        http=guarded_protocol(guard),  # timeouts for unfinished requests, a cap on connections
        backlog=budget.burst,  # what asyncio accepts in one go; the kernel's queue is widened after
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep our logging setup (plain or JSON)
        access_log=False,  # one line per request comes from server/logs.py instead
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="on",
    )
    return _Server(config, on_exit=app.state.runtime.worker.close)


def gate_for(settings: Settings, served: ModelChoice | None) -> Gate:
    """The governor from settings, on the served ladder and its start rung (the memory tier)."""
    from server.serving.governor_setup import build_gate

    if served is None:
        return build_gate(settings)
    start = served.start.index if served.start is not None else 0
    return build_gate(settings, ladder=served.ladder, start_rung=start)


def serve(
    settings: Settings,
    *,
    engine_factory: Callable[[], Engine] | None = None,
    governor: Gate | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM. The model loads in the background; /health says when it is ready."""
    setup_logging(settings.log_level, json_lines=settings.log_json)
    server = build_server(settings, engine_factory=engine_factory, governor=governor)
    log.info("simmer listening on http://%s:%d (model %s)", settings.host, settings.port, settings.model)
    server.run()
