"""What simmer's own endpoints answer: /health and the governor's state (/v1/thermal, /v1/lifecycle, and
each event of /v1/thermal/events) (server/api/common/reply.py says what these models are for)."""

from __future__ import annotations

from typing import Any, Literal

from server.api.common.reply import Reply, absent

Level = Literal["nominal", "fair", "serious", "critical"]


class HealthGovernor(Reply):
    level: Level
    reason: str
    enforced: bool
    paused: bool
    device_killed: bool


class Health(Reply):
    """ok (200); loading, error or shutting_down (503, with Retry-After while loading). `model` and `variant`
    are what ran last (warm now)."""

    status: Literal["ok", "loading", "error", "shutting_down"]
    model: str = absent()
    variant: str | None = absent()
    loaded: list[str] = absent()
    queue_depth: int = absent()
    busy: bool = absent()
    model_problem: dict[str, Any] | None = absent("the store's word on a served model marked bad")
    governor: HealthGovernor = absent()
    error: str = absent("why the model failed to load")


class Lease(Reply):
    client: str
    expires_in: float
    ttl_s: float = absent()


class Rung(Reply):
    model: str
    variant: str
    current: bool


class BackgroundWorkState(Reply):
    """Whether heavy work nobody waits for (a pull's conversion, a summary) runs now
    (governor/background.py)."""

    runs: bool
    why: str
    waiting: list[str] = absent("what waits now, e.g. `pull <model>`, `summary` (not in the event stream)")


class SessionBuildsState(Reply):
    """Sessions that new limits of a loaded model needed (a thread change): built beside the worker before
    they applied, or inside the reply they came to (no room for two sessions in the memory budget)."""

    beside: int
    inside: int
    building: bool


class ThermalState(Reply):
    """The governor's snapshot (docs/governor.md), what runs now and the gate's counters."""

    time: float
    level: Level
    reason: str
    cause: str
    temperature: dict[str, Any]
    headroom: float | None
    forecast: float | None
    memory: dict[str, Any] | None
    battery: dict[str, Any] | None
    background_work: BackgroundWorkState
    session_builds: SessionBuildsState | None = absent("since the start (not in the event stream)")
    lifecycle: Literal["foreground", "background"]
    leases: list[Lease]
    limits: dict[str, Any]
    enforced: bool
    device_killed: bool
    transitions: list[dict[str, Any]]
    model: str
    variant: str | None
    threads: int | None
    pauses: int
    ladder: list[Rung]
    routing: dict[str, Any] | None
    lease: Lease | None = absent("/v1/lifecycle: this client's lease, or null")
