"""Operational endpoints: /health (llama.cpp-style loading state) and /metrics (Prometheus)."""

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
    rt: Runtime = request.app.state.runtime
    worker = rt.worker
    last = rt.served.pool.last_served()  # the device's view: what ran last, warm now
    if worker.state == "ready":  # models load on demand: none loaded (keep_alive ran out) is fine too
        body: dict = {
            "status": "ok",
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
    retry = {"Retry-After": str(RETRY_AFTER_S["model_loading"])}
    if worker.state == "loading":
        return JSONResponse({"status": "loading"}, status_code=503, headers=retry)
    if worker.state == "failed":
        body = {"status": "error", "error": str(worker.load_error), "model_problem": model_problem(rt)}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "shutting_down"}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    return Response(rt.metrics.render(), media_type=CONTENT_TYPE)
