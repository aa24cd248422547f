"""The Gate: the governor's decisions applied on the worker thread, before every job and between every
token / prefill chunk. (Settings -> Governor is server/serving/governor_setup.py.)

The governor decides (its own thread); the gate acts on the worker thread:
- new work waits while the governor pauses it, up to pause_timeout_s from when it was queued, then
  fails with device_paused (503 + Retry-After);
- a running reply blocks while paused (its SSE stream gets `event: governor`) and goes on with no token
  lost; the client leaving ends the wait at once; a pause longer than pause_timeout_s fails the reply;
- the simulated device's own throttling is emulated by idling after each forward pass, and a device that
  killed the app (T >= T_critical) fails the reply with device_overheated until it cools;
- the pace: the gate idles after each pass to hold the governor's tokens_per_second, or without a known
  cost per token its CPU budget (Limits.pace_delay): one mechanism, fed by the pace controller, and the
  only place that sleeps for a pace (a reply's generation and the batch loop never wait on their own; the
  engine hears of pacing only as `spin`: its pools do not spin through the idles);
- a meter measures the process CPU time per step of each configuration the engine runs, and per token of
  each batch size (the worker says what a pass made: note_pass), and tells the governor
  (serving/cost_meter.py): the budget then buys the configuration that is really cheapest here, and a
  batch's cheaper tokens raise its pace at the same CPU;
- a model load is wrapped in Governor.loading() (loading(), around the pool's every load): the pace
  controller credits none of its CPU;
- limits go to the worker only when they change (it places them on the request's rung, serving/ladder.py).
Each step is decided first (decide_step, pure) and applied after, in one place (GovernorGate._apply).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Any

from governor.background import BackgroundWork
from governor.governor import Governor, Snapshot
from governor.limits import Limits, Rung, merge_cost
from models.errors import Cancelled, DeviceOverheated
from models.protocol import EngineLimits, pool_spins
from models.types import CancelToken
from server.refusals import DevicePaused
from server.serving.cost_meter import CostMeter

log = logging.getLogger("simmer.governor")


def to_engine_limits(limits: Limits) -> EngineLimits:
    """The engine's part of the governor's limits, with the rung (model, variant) the governor runs on; the
    worker maps that rung onto each request's own (server/serving/ladder.py place). Every EngineLimits field
    is the Limits field of the same name: a new lever is one field on each, never a copy here."""
    return EngineLimits(**{f.name: getattr(limits, f.name) for f in fields(EngineLimits)})


def pace_idle(tokens: int, tokens_per_second: float, pass_s: float) -> float:
    """How long to idle after a pass of pass_s that made `tokens` tokens, so that the pass and the idle take
    1 / tokens_per_second per token (a batch's pass of n replies: n tokens; a prefill chunk of a batch: 0)."""
    return max(0.0, max(0, tokens) / tokens_per_second - pass_s)


@dataclass(frozen=True)
class StepDecision:
    """What the gate does at one step, decided before anything is done."""

    idle_s: float  # idle this long first (the longer of the device's own throttling and the pace)
    throttle_s: float  # of which the device's throttling (counted apart)
    killed: bool  # the device killed the app: fail the reply
    pause: bool  # wait until the governor lets this work go on
    limits: EngineLimits | None  # new limits for the worker, None when unchanged


# The rule table for one step, after a forward pass of pass_s (None: no pass before it, a job's start) that
# made `tokens` tokens (1 for the one-reply engine's steps; a batch's pass: its replies, a prefill chunk 0):
#
#   idle     = max(throttle, pace): two lower bounds on the idle after a pass
#     throttle: the simulated device's own throttling, a multiple of the pass (0 on real devices)
#     pace:     enforced, a tokens/s pace: the rest of tokens / pace after the pass (pace_idle); this idle
#               is the only wait that holds a pace (the engine and the batch loop never sleep for one),
#               so the meter sees passes of work alone, without the idle
#               enforced, no tokens/s pace (no cost per token known): the CPU budget's idle
#               (Limits.pace_delay of the pass)
#   killed   = the device killed the app (T >= T_critical, until it cools below T_throttle)
#   pause    = a running reply: pause_running; a new job: pause_new
#   limits   = the governor's limits when they differ from the last handed out, else None (the engine's
#              part: to_engine_limits; the pace is not in it, so a pace moving on every poll is no new limit)
# Applied in that order (_apply): idle (the client leaving wakes it), killed -> device_overheated,
# pause -> wait (bounded; then killed is looked at again), limits -> returned to the worker.
def decide_batch(
    limits: Limits, *, pass_s: float | None, throttle_s: float, killed: bool, enforce: bool
) -> StepDecision:
    """decide_step for a batch of an embedding job: it makes no tokens, so a tokens/s pace does not
    measure it; the CPU budget's idle (Limits.pace_delay of the pass) does, and the device's throttling,
    its killing the app and the pause apply as to a reply (pause_new before the job's first batch). The
    limits are never handed out here: they are for the generation engine, which takes them at its next
    step (the gate's `applied` stays what that engine has)."""
    return StepDecision(
        idle_s=max(throttle_s, limits.pace_delay(pass_s) if enforce and pass_s is not None else 0.0),
        throttle_s=throttle_s,
        killed=killed,
        pause=limits.pause_new if pass_s is None else limits.pause_running,
        limits=None,
    )


def decide_step(
    limits: Limits,
    *,
    pass_s: float | None,
    throttle_s: float,
    killed: bool,
    enforce: bool,
    new_job: bool,
    applied: EngineLimits | None,
    tokens: int = 1,
) -> StepDecision:
    pace = 0.0
    if pass_s is not None and enforce and limits.tokens_per_second:
        pace = pace_idle(tokens, limits.tokens_per_second, pass_s)
    elif pass_s is not None and enforce:
        pace = limits.pace_delay(pass_s)
    engine_limits = to_engine_limits(limits)
    return StepDecision(
        idle_s=max(throttle_s, pace),
        throttle_s=throttle_s,
        killed=killed,
        pause=limits.pause_new if new_job else limits.pause_running,
        limits=None if engine_limits == applied else engine_limits,
    )


class GovernorGate:
    """Implements serving.contracts.Gate on top of a Governor. Also what the routes read (/v1/thermal,
    /health, /metrics) and what create_app subscribes the worker to."""

    def __init__(
        self,
        governor: Governor,
        *,
        pause_timeout_s: float = 60.0,
        sleep: Callable[[float], None] | None = None,
        spin: str = "auto",
        cpu_time: Callable[[], float] = time.process_time,
        meter: CostMeter | None = None,
    ) -> None:
        self.governor = governor
        self.pause_timeout_s = pause_timeout_s
        self._sleep = sleep
        self._spin = spin  # the engine's setting: which steps ran on a spinning pool
        self._cpu_time = cpu_time
        self.meter = meter or CostMeter()
        self._last_cpu = 0.0
        self._lock = threading.Lock()
        self._applied: EngineLimits | None = None
        self._job: CancelToken | None = None
        self._job_wake = threading.Event()
        self._last_step: float | None = None
        self._pass_tokens = 1  # what the pass before the next step made (note_pass)
        self._aside = (0.0, 0.0)  # wall and CPU seconds of other work since the last step (note_aside)
        self.pauses = 0  # times the governor entered a pause
        self.paused_seconds = 0.0  # worker time spent waiting out pauses
        self.throttled_seconds = 0.0  # worker time spent idling for the device's own throttling
        self._was_paused = False
        governor.subscribe(self._count_pauses)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.governor.start()

    def stop(self) -> None:
        self.governor.stop()

    # -- what the routes read ---------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return self.governor.snapshot()

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """`callback(state_dict)` on every change (the worker forwards it to streams that opted in)."""
        return self.governor.subscribe(lambda snap: callback(snap.to_dict()))

    def set_lifecycle(self, state: str, client: str = "anonymous", ttl_s: float | None = None) -> Snapshot:
        return self.governor.set_lifecycle(state, client, ttl_s)  # type: ignore[arg-type]

    def loading(self, model_id: str | None) -> AbstractContextManager[None]:
        """Wraps a model load (the pool's, on the loader thread or the worker's): the pace controller
        credits none of it, and the governor measures its heat (not with None: a loaded engine building
        another session)."""
        return self.governor.loading(model_id)

    def models_loaded(self, models: frozenset[str]) -> None:
        """After every load and unload of the pool: what is loaded now (a rung whose model must load counts
        its heat first)."""
        self.governor.models_loaded(models)

    @property
    def memory_pressure(self) -> bool:
        """The governing level comes from memory: a model the reply leaves is unloaded at once."""
        return self.governor.snapshot().cause == "memory"

    @property
    def pauses_new(self) -> bool:
        """New work waits now: a batch admits no reply beside its running ones (before_job would hold it
        there, and every running row with it)."""
        return self.governor.limits.pause_new

    @property
    def rung(self) -> str | None:
        """The model of the governor's rung now (the worker unloads idle models above it)."""
        return self.governor.limits.model_id

    @property
    def background(self) -> BackgroundWork:
        return self.governor.snapshot().background

    @property
    def ladder(self) -> list[Rung]:
        return list(self.governor.ladder)

    def _count_pauses(self, snap: Snapshot) -> None:
        paused = snap.limits.pause_running or snap.limits.pause_new
        if paused and not self._was_paused:
            self.pauses += 1
        self._was_paused = paused

    # -- the worker's side (worker thread) --------------------------------------------------------------
    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        self._job = cancel
        self._job_wake = wake = threading.Event()
        cancel.on_cancel(wake.set)
        self._last_step = None
        self._pass_tokens = 1
        self._aside = (0.0, 0.0)
        return self._apply(self._decide(None, new_job=True), cancel, enqueued_at + self.pause_timeout_s)

    def note_pass(self, tokens: int) -> None:
        """The worker's word on the pass before the next step: it made `tokens` tokens (a batch's pass of
        that many replies; 0: a prefill chunk). Unsaid, a step is one token (the one-reply engine's)."""
        self._pass_tokens = tokens

    def note_aside(self, wall_s: float, cpu_s: float) -> None:
        """Other work ran since the last step (an embedding slice): the meter prices the engine's
        configuration, so the step's cost leaves it out; the pace does not (its CPU is the budget's too)."""
        wall, cpu = self._aside
        self._aside = (wall + wall_s, cpu + cpu_s)

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        if cancel is not self._job:  # a caller that skipped before_job (engine used directly)
            self._job, self._job_wake, self._last_step = cancel, threading.Event(), None
            cancel.on_cancel(self._job_wake.set)
        now = time.monotonic()
        pass_s = None if self._last_step is None else now - self._last_step
        tokens, self._pass_tokens = self._pass_tokens, 1
        (aside_wall, aside_cpu), self._aside = self._aside, (0.0, 0.0)
        if pass_s is not None:
            self._measure(
                self._cpu_time() - self._last_cpu - aside_cpu, max(0.0, pass_s - aside_wall), tokens
            )
        decision = self._decide(pass_s, new_job=False, tokens=tokens)
        limits = self._apply(decision, cancel, None)
        # the next call measures the forward pass alone; the CPU clock is read first, so the pass measured
        # does not include reading it
        self._last_cpu = self._cpu_time()
        self._last_step = time.monotonic()
        return limits

    def before_batch(self, cancel: CancelToken, enqueued_at: float, pass_s: float | None) -> int | None:
        """An embedding batch's gate (decide_batch). The job's passes are not metered: the meter prices the
        generation engine's configurations, and an encoder's pass is none of them. The generation job's
        step state (its last step, its wake) is left as it is: a batch runs between jobs."""
        governor = self.governor
        decision = decide_batch(
            governor.limits,
            pass_s=pass_s,
            throttle_s=governor.throttle_delay(pass_s) if pass_s is not None else 0.0,
            killed=governor.device_killed,
            enforce=governor.enforce,
        )
        wake = threading.Event()
        cancel.on_cancel(wake.set)
        deadline = enqueued_at + self.pause_timeout_s if pass_s is None else None
        self._apply(decision, cancel, deadline, wake=wake, hand_out=False)
        return governor.limits.threads  # after a pause: what holds now

    def _measure(self, cpu_s: float, wall_s: float, tokens: int = 1) -> None:
        """One step of the configuration the engine runs (the limits last handed out), which made `tokens`
        tokens, into the meter."""
        with self._lock:
            applied = self._applied
        if applied is None or applied.variant is None or not applied.threads:
            return
        # The engine's session key, except at one thread, where the engine builds no pool: the meter keeps
        # keying it by the setting (as before), because config_costs lets the manifest's prior stand in next
        # to a "spinning" measurement only, and a quiet one-thread entry would change what an unpaced
        # server picks (a one-thread measurement on a busy machine against a two-thread prior).
        spinning = pool_spins(self._spin, applied.spin, max(2, applied.threads))
        cost = self.meter.step(
            applied.variant,
            applied.threads,
            spinning,
            cpu_s,
            wall_s,
            model_id=applied.model_id,
            tokens=tokens,
        )
        if cost is not None:
            self.governor.costs = merge_cost(self.governor.costs, cost)

    def _decide(self, pass_s: float | None, *, new_job: bool, tokens: int = 1) -> StepDecision:
        governor = self.governor
        with self._lock:
            applied = self._applied
        return decide_step(
            governor.limits,
            pass_s=pass_s,
            throttle_s=governor.throttle_delay(pass_s) if pass_s is not None else 0.0,
            killed=governor.device_killed,
            enforce=governor.enforce,
            new_job=new_job,
            applied=applied,
            tokens=tokens,
        )

    def _apply(
        self,
        decision: StepDecision,
        cancel: CancelToken,
        deadline: float | None,
        *,
        wake: threading.Event | None = None,
        hand_out: bool = True,
    ) -> EngineLimits | None:
        """The one place a decision is acted on (the rule table over decide_step). `wake` ends the idle
        early (the job's own; by default the generation job's); without `hand_out` no limits are handed
        out, not even after a pause (an embedding batch's: decide_batch)."""
        if decision.idle_s > 0 and not cancel.cancelled:
            self.throttled_seconds += decision.throttle_s
            if self._sleep is not None:
                self._sleep(decision.idle_s)
            else:
                (wake or self._job_wake).wait(decision.idle_s)  # wakes early when the client leaves
        if decision.killed:
            self._raise_killed()
        if decision.pause:
            new = deadline is not None
            self._wait_unpaused(cancel, deadline if new else time.monotonic() + self.pause_timeout_s, new=new)
            if not hand_out:
                return None
            decision = self._decide(None, new_job=new)  # what holds after the pause
        if decision.limits is None:
            return None
        with self._lock:
            if decision.limits == self._applied:
                return None
            self._applied = decision.limits
        return decision.limits

    def _raise_killed(self) -> None:
        snap = self.governor.snapshot()
        t = snap.temperature
        where = f" at {t.celsius:.1f} C" if t else ""
        raise DeviceOverheated(
            f"The device overheated{where} and stopped the app; the model is unavailable until it "
            "cools below its throttling point. Retry later."
        )

    def _wait_unpaused(self, cancel: CancelToken, deadline: float, *, new: bool) -> None:
        started = time.monotonic()
        log.info("%s paused: %s", "new request" if new else "running reply", self.governor.snapshot().reason)
        ok = self.governor.wait_while_paused(
            lambda: cancel.cancelled, timeout=max(0.0, deadline - time.monotonic()), new=new
        )
        self.paused_seconds += time.monotonic() - started
        if cancel.cancelled:
            raise Cancelled("the request was cancelled while paused")
        if not ok:
            reason = self.governor.snapshot().reason
            raise DevicePaused(
                f"The device is paused by the governor ({reason}) and did not resume within "
                f"{self.pause_timeout_s:g} s. Retry later."
            )
        if self.governor.device_killed:
            self._raise_killed()
        log.info("%s resumed", "new request" if new else "running reply")
