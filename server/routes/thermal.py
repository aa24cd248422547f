"""Governor endpoints: GET /v1/thermal, GET /v1/thermal/events (SSE), POST /v1/lifecycle."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from sse_starlette import EventSourceResponse

from governor.governor import Snapshot
from server.errors import ApiError

if TYPE_CHECKING:
    from server.governor_gate import GovernorGate
    from server.runtime import Runtime

router = APIRouter(prefix="/v1")


class LifecycleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: Literal["foreground", "background"]


def governor_gate(rt: Runtime) -> GovernorGate:
    if rt.governor is None:
        raise ApiError(404, "not_found", "This server runs without a governor")
    return rt.governor


def thermal_state(rt: Runtime, snap: Snapshot) -> dict[str, Any]:
    """The snapshot plus what runs now (the engine's variant and threads) and the gate's counters."""
    gate = governor_gate(rt)
    engine = rt.worker.engine
    body = snap.to_dict()
    body["model"] = rt.model_id()
    body["variant"] = engine.variant if engine is not None else None
    body["threads"] = engine.threads if engine is not None else None
    body["pauses"] = gate.pauses
    # the ladder across models and where the governor stands on it (the rung its limits name)
    rung = (snap.limits.model_id, snap.limits.variant)
    body["ladder"] = [
        {"model": r.model_id, "variant": r.variant, "current": (r.model_id, r.variant) == rung}
        for r in gate.ladder
    ]
    body["routing"] = rt.router.state() if rt.router else None  # where new work goes (server/routing/)
    return body


@router.get("/thermal")
async def thermal(request: Request) -> dict[str, Any]:
    rt: Runtime = request.app.state.runtime
    return thermal_state(rt, governor_gate(rt).snapshot())


@router.get("/thermal/events")
async def thermal_events(request: Request) -> EventSourceResponse:
    """`event: thermal` with the state now, then one per change of level, limits, lifecycle or kill state."""
    rt: Runtime = request.app.state.runtime
    gate = governor_gate(rt)
    queue, unsubscribe = gate.governor.subscribe_async(asyncio.get_running_loop())

    async def events() -> AsyncIterator[dict[str, str]]:
        try:
            snap = gate.snapshot()
            while True:
                yield {"event": "thermal", "data": json.dumps(thermal_state(rt, snap), separators=(",", ":"))}
                snap = await queue.get()
        finally:
            unsubscribe()

    return EventSourceResponse(events(), ping=rt.keepalive_ping_s)


@router.post("/lifecycle")
async def lifecycle(body: LifecycleRequest, request: Request) -> dict[str, Any]:
    """foreground | background, as a mobile app reports it; background pauses (or lowers priority)."""
    rt: Runtime = request.app.state.runtime
    gate = governor_gate(rt)
    # set_lifecycle polls the sensors once (a simulator update): cheap, but keep it off the event loop.
    snap = await asyncio.to_thread(gate.set_lifecycle, body.state)
    return thermal_state(rt, snap)
