"""Operational endpoints: /health (healthy at once, "loading" while the start model loads) and /metrics
(Prometheus)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from models.errors import SimmerError
from models.store.store import ModelStore
from server.http.errors import RETRY_AFTER_S
from server.http.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from server.api.context import Runtime

router = APIRouter()


def model_problem(rt: Runtime) -> dict[str, Any] | None:
    """The store's word on the served model when its current version is marked bad (a file changed after
    it was verified): which version, which files, what serves instead, the command that fixes it."""
    if rt.store_home is None:
        return None
    try:
        return ModelStore(rt.store_home).problem(rt.model)
    except (SimmerError, OSError):  # not a store id (a folder served directly), or an unreadable store
        return None


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 from the start on: the model loaded at start is built beside the worker and requests queue for
    it meanwhile (or start on a smaller stand-in), so the server is healthy while `status` says "loading",
    as Ollama answers while its runner loads. 503 once that load failed (until one succeeds) and at
    shutdown."""
    rt: Runtime = request.app.state.runtime
    worker = rt.worker
    if worker.state == "closed":
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    start, error = worker.start_load()
    if start == "failed":
        body = {"status": "error", "error": str(error), "model_problem": model_problem(rt)}
        retry = {"Retry-After": str(RETRY_AFTER_S["model_loading"])}
        return JSONResponse(body, status_code=503, headers=retry)
    last = rt.served.pool.last_served()  # the device's view: what ran last, warm now
    body: dict = {
        "status": "loading" if start == "loading" else "ok",
        "model": last.model_id if last is not None else rt.model,
        "variant": last.variant if last is not None else None,
        "loaded": sorted(rt.served.pool.loaded()),
        "queue_depth": worker.queue_depth,
        "busy": worker.busy,
        "model_problem": model_problem(rt),
    }
    if rt.governor is not None:
        snap = rt.governor.snapshot()
        body["governor"] = {
            "level": snap.level,
            "reason": snap.reason,
            "enforced": snap.enforced,
            "paused": snap.limits.pause_running or snap.limits.pause_new,
            "device_killed": snap.device_killed,
        }
    return JSONResponse(body)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    return Response(rt.metrics.render(), media_type=CONTENT_TYPE)
