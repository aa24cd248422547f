"""What routing reads from the two things it does not own: the local worker (`LocalSide`, what it reads
from and hands to the worker) and the governor (`device_view`, its public snapshot as a DeviceState). Both
read-only views, built by the app's wiring (server/app.py); the router asks them before every decision."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.errors import InsufficientMemory
from server.routing.decision import DeviceState, LocalState
from server.serving.contracts import Job


@dataclass(frozen=True)
class LocalSide:
    """What routing reads from, and hands to, the local worker."""

    served_ids: Callable[[], set[str]]  # every model id served here (the catalog's ids)
    default_model: Callable[[], str]  # the model a request that names none means
    state: Callable[[], LocalState]
    queue_full: Callable[[], bool]
    submit: Callable[[Job], None]
    tokens_ahead: Callable[[], int] = lambda: 0  # what the worker generates before a job submitted now
    take_back: Callable[[Job], bool] = lambda job: False  # out of the queue, unstarted, for another side


def local_side(worker: Any, served_ids: Callable[[], set[str]], default_model: str) -> LocalSide:
    """A LocalSide over the worker (server/serving/worker.py)."""

    def state() -> LocalState:
        if worker.state == "closed":
            return "closed"
        start, error = worker.start_load()
        if start == "failed":
            return "no_memory" if isinstance(error, InsufficientMemory) else "failed"
        return start

    return LocalSide(
        served_ids=served_ids,
        default_model=lambda: default_model,
        state=state,
        queue_full=lambda: worker.queue_depth >= worker.max_queue,
        submit=worker.submit,
        tokens_ahead=worker.tokens_ahead,
        take_back=worker.take_back,
    )


def device_view(gate: Any) -> Callable[[], DeviceState | None]:
    """The governor's state for routing, from the gate's public snapshot (None without a governor)."""
    if gate is None:
        return lambda: None

    def read() -> DeviceState:
        snap = gate.snapshot()
        limits = snap.limits
        # Heat paces the device: the governing cause is thermal and its CPU budget binds (the budget is
        # dropped when it covers every usable core); tokens_per_second is that budget over the measured cost
        # of a token (governor/limits.py pick_config), None while no cost is known.
        heat_paced = snap.cause == "thermal" and limits.cpu_budget_cores is not None
        return DeviceState(
            level=snap.level,
            paused=limits.pause_new,
            lifecycle=snap.lifecycle,
            cause=snap.cause,
            killed=snap.device_killed,
            pace_tok_s=limits.tokens_per_second if heat_paced and snap.enforced else None,
        )

    return read
