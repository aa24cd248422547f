"""Governor endpoints: GET /v1/thermal, GET /v1/thermal/events (SSE), POST /v1/lifecycle."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse

from governor.governor import Snapshot
from governor.lifecycle import TooManyLeases
from server.http.errors import ApiError
from server.http.stream_slots import client_key

if TYPE_CHECKING:
    from server.api.context import Runtime
    from server.serving.governor_gate import GovernorGate

router = APIRouter(prefix="/v1")


class LifecycleRequest(BaseModel):
    """A lifecycle report. Background is a lease held by `client` for `ttl_s` seconds (default and maximum:
    SIMMER_LIFECYCLE_TTL_S), renewed by reporting background again; foreground from the client ends it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    state: Literal["foreground", "background"]
    # A name, not a secret: it is logged and shown in /v1/thermal (so: short, no spaces, no control bytes).
    client: str = Field("anonymous", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:@-]+$")
    ttl_s: float | None = Field(None, gt=0, allow_inf_nan=False)


def governor_gate(rt: Runtime) -> GovernorGate:
    if rt.governor is None:
        raise ApiError(404, "not_found", "This server runs without a governor")
    return rt.governor


def thermal_state(rt: Runtime, snap: Snapshot) -> dict[str, Any]:
    """The snapshot plus what runs now (the engine's variant and threads) and the gate's counters."""
    gate = governor_gate(rt)
    last = rt.served.pool.last_served()  # the device's view: what ran last, warm now
    body = snap.to_dict()
    body["model"] = last.model_id if last is not None else rt.model
    body["variant"] = last.variant if last is not None else None
    body["threads"] = last.threads if last is not None else None
    body["pauses"] = gate.pauses
    # the ladder across models and where the governor stands on it (the rung its limits name)
    rung = (snap.limits.model_id, snap.limits.variant)
    body["ladder"] = [
        {"model": r.model_id, "variant": r.variant, "current": (r.model_id, r.variant) == rung}
        for r in gate.ladder
    ]
    body["leases"] = gate.governor.active_leases()  # now, not as of the last poll
    body["routing"] = rt.router.state() if rt.router else None  # where new work goes (server/routing/)
    # what heavy work waits for the governor's leave now (a pull's conversion, the summary)
    body["background_work"]["waiting"] = rt.deferred.names() + rt.worker.deferred_work()
    body["session_builds"] = rt.worker.session_builds()
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
    client = client_key(request.client.host if request.client else None, request.headers.get("authorization"))
    refused = rt.event_streams.take(client)
    if refused is not None:
        raise ApiError(429, "too_many_streams", f"{refused}: close one, or poll GET /v1/thermal")
    try:
        queue, unsubscribe = gate.governor.subscribe_async(asyncio.get_running_loop())
    except BaseException:
        rt.event_streams.release(client)
        raise

    async def events() -> AsyncIterator[dict[str, str]]:
        try:
            snap = gate.snapshot()
            while True:
                yield {"event": "thermal", "data": json.dumps(thermal_state(rt, snap), separators=(",", ":"))}
                snap = await queue.get()
        finally:
            unsubscribe()
            rt.event_streams.release(client)

    # Started here, so that its `finally` runs (when it is closed, or collected) even if the client leaves
    # before the response iterates it: an async generator never started skips its `finally`.
    stream = events()
    first = await anext(stream)

    async def started() -> AsyncIterator[dict[str, str]]:
        yield first
        async for event in stream:
            yield event

    return EventSourceResponse(started(), ping=rt.keepalive_ping_s)


@router.post("/lifecycle")
async def lifecycle(body: LifecycleRequest, request: Request) -> dict[str, Any]:
    """foreground | background, as a mobile app reports it; background pauses (or lowers priority) while
    any client's lease holds. The answer is the state, plus `lease`: this client's, or null."""
    rt: Runtime = request.app.state.runtime
    gate = governor_gate(rt)
    limit = gate.governor.config.lifecycle_ttl_s
    # A longer lease than the server grants is capped, as a DHCP server grants a shorter lease than asked:
    # the answer's `lease.ttl_s` says what was granted (a limit per server cannot be in the schema).
    ttl_s = None if body.ttl_s is None else min(body.ttl_s, limit)
    try:
        # set_lifecycle polls the sensors once (a simulator update): cheap, but keep it off the event loop.
        snap = await asyncio.to_thread(gate.set_lifecycle, body.state, body.client, ttl_s)
    except TooManyLeases as err:
        raise ApiError(
            429,
            "too_many_leases",
            f"{err}; report foreground from one of them, or wait for a lease to expire",
            param="client",
        ) from err
    state = thermal_state(rt, snap)
    mine = next((lease for lease in state["leases"] if lease["client"] == body.client), None)
    ttl = ttl_s or limit
    state["lease"] = None if mine is None else {**mine, "ttl_s": ttl}
    return state
