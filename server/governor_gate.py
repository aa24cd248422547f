"""The governor, wired into the server: Settings -> Governor, the start rung that fits memory, and the Gate
the worker calls before every job and between every token / prefill chunk.

The governor decides (its own thread); the gate acts on the worker thread:
- new work waits while the governor pauses it, up to pause_timeout_s from when it was queued, then
  fails with device_paused (503 + Retry-After);
- a running reply blocks while paused (its SSE stream gets `event: governor`) and goes on with no token
  lost; the client leaving ends the wait at once; a pause longer than pause_timeout_s fails the reply;
- the simulated device's own throttling is emulated by idling after each forward pass, and a device that
  killed the app (T >= T_critical) fails the reply with device_overheated until it cools;
- the pace: the gate idles after each pass to hold the governor's tokens_per_second, or without a known
  cost per token its CPU budget (Limits.pace_delay): one mechanism, fed by the pace controller;
- a meter measures the process CPU time per step of each configuration the engine runs and tells the
  governor (CostMeter): the budget then buys the configuration that is really cheapest here;
- limits go to the engine only when they change.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from governor.cgroup import usable_cpus
from governor.governor import Governor, Snapshot
from governor.limits import (
    ConfigCost,
    Limits,
    NoRungFits,
    Rung,
    build_ladder,
    merge_cost,
    pick_rung,
    rungs_from_manifest,
)
from governor.policy import PolicyConfig
from governor.sensors import ThermalSource, make_thermal_source, read_battery, read_memory
from models.errors import Cancelled, DeviceOverheated, InsufficientMemory, InvalidParameter
from models.protocol import Engine, EngineLimits
from models.runtime.session import kv_bytes_per_token as session_kv_bytes_per_token
from models.types import CancelToken
from server.errors import DevicePaused
from server.settings import Settings

log = logging.getLogger("simmer.governor")

# onnxruntime arenas and thread pools, the tokenizer and the interpreter around them: what a loaded model
# costs besides its weights and KV cache (RSS of the server with the tiny model is ~120 MiB; we keep margin).
RUNTIME_BYTES = 128 << 20
PACE_STEP = 1.1  # the engine hears of the pace in steps of 10 %


# -- Settings -> Governor ----------------------------------------------------------------------------------
def build_governor(
    settings: Settings,
    *,
    thermal: ThermalSource | None = None,
    ladder: Sequence[Rung] = (),
    start_rung: int = 0,
) -> Governor:
    """The Governor for these settings. `thermal` replaces settings.thermal_source (tests script one)."""
    cpus = usable_cpus(settings.cgroup_root, settings.proc_root)
    threads = max(1, min(settings.threads or cpus, cpus))
    if thermal is None:
        thermal = make_thermal_source(
            settings.thermal_source,
            sysfs_root=settings.sysfs_root,
            sensor_name=settings.thermal_sensor,
            sim_time_scale=settings.sim_time_scale,
            max_cores=cpus,
        )
    config = PolicyConfig(
        memory_budget_bytes=_mb(settings.memory_budget_mb),
        background_action=settings.background_action,  # type: ignore[arg-type]
        pace_control=settings.pace_control,
    )
    return Governor(
        thermal=thermal,
        read_memory=lambda: read_memory(settings.cgroup_root, settings.proc_root),
        read_battery=read_battery,
        config=config,
        usable_cpus=threads,
        ladder=ladder,
        start_rung=start_rung,
        poll_s=settings.governor_poll_s,
        enforce=settings.governor,
    )


def _mb(value: int | None) -> int | None:
    return None if value is None else value << 20


# -- memory: the start rung --------------------------------------------------------------------------
@dataclass(frozen=True)
class StartPlan:
    ladder: list[Rung]
    start_rung: int
    variant: str
    budget_bytes: int | None
    need_bytes: int


def kv_slots(
    context_length: int, kv_bytes_per_token: int, prefix_slots: int, prefix_budget_bytes: int
) -> int:
    """How many full-context KV buffers the engine keeps (as LlamaEngine._slot_for sizes them)."""
    slot = max(1, kv_bytes_per_token * context_length)
    return max(1, min(prefix_slots, prefix_budget_bytes // slot))


def kv_bytes_per_token(manifest: Mapping[str, Any]) -> int:
    if isinstance(manifest.get("kv_bytes_per_token"), int):
        return manifest["kv_bytes_per_token"]
    arch = manifest.get("architecture") or {}
    try:
        layers, kv_heads, head_dim = int(arch["n_layers"]), int(arch["n_kv_heads"]), int(arch["head_dim"])
    except (KeyError, TypeError, ValueError):
        return 0
    return session_kv_bytes_per_token(layers, kv_heads, head_dim)


def plan_start(
    model_id: str,
    manifest: Mapping[str, Any],
    *,
    budget_bytes: int | None,
    context_length: int,
    prefix_slots: int,
    prefix_budget_bytes: int,
    preferred_variant: str | None = None,
) -> StartPlan:
    """The ladder of this model's variants and the best rung whose weights + KV (for the context cap, all
    prefix slots) + runtime fit `budget_bytes`. Raises InsufficientMemory when none fits: refusing to load
    beats being OOM-killed mid-reply."""
    variants = manifest.get("variants") or {}
    measured = rungs_from_manifest(model_id, variants)
    ladder = build_ladder(measured)
    if preferred_variant is not None and preferred_variant in variants:
        # An explicit variant is the top rung; cheaper measured rungs below it stay available to the governor.
        own = [Rung(*r) for r in measured if r[1] == preferred_variant]
        top = (
            own[0]
            if own
            else Rung(model_id, preferred_variant, 0.0, 1.0, _weights(variants, preferred_variant))
        )
        cheaper = [r for r in ladder if r.variant != top.variant and r.cpu_s_per_token < top.cpu_s_per_token]
        ladder = [top, *cheaper]
    if not ladder:  # unmeasured variants: the engine's own choice, no ladder to step down on
        first = manifest.get("default_variant") or next(iter(variants), None)
        if first is None:
            raise InsufficientMemory(f"{model_id}: the manifest lists no variants")
        ladder = [Rung(model_id, first, 0.0, 1.0, _weights(variants, first))]
    kv = kv_bytes_per_token(manifest) * min(context_length, int(manifest.get("context_length") or 1 << 30))
    slots = kv_slots(context_length, kv_bytes_per_token(manifest), prefix_slots, prefix_budget_bytes)

    def estimate(rung: Rung) -> int:
        return rung.bytes + kv * slots + RUNTIME_BYTES

    if budget_bytes is None:
        index = 0
    else:
        try:
            index = pick_rung(ladder, budget_bytes, estimate)
        except NoRungFits as err:
            raise InsufficientMemory(
                f"{err}. Free memory, lower SIMMER_CONTEXT_LENGTH or SIMMER_PREFIX_CACHE_MB, or raise "
                "SIMMER_MEMORY_BUDGET_MB."
            ) from err
    rung = ladder[index]
    return StartPlan(ladder, index, rung.variant, budget_bytes, estimate(rung))


def _weights(variants: Mapping[str, Any], name: str) -> int:
    entry = variants.get(name) or {}
    return int(entry.get("weights_bytes") or 0)


def memory_budget_bytes(settings: Settings) -> int | None:
    """settings.memory_budget_mb, else what the cgroup (or the system) has available now."""
    if settings.memory_budget_mb is not None:
        return settings.memory_budget_mb << 20
    reading = read_memory(settings.cgroup_root, settings.proc_root)
    return None if reading is None else reading.available_bytes


def governed_engine_factory(
    settings: Settings,
    gate: GovernorGate,
    *,
    model_dir: Path | None = None,
) -> Callable[[], Engine]:
    """The worker's loader: plan the start rung against memory, hand the ladder to the governor, open the
    engine on that rung. `model_dir` (a converted folder with manifest.json) bypasses the store."""

    def load() -> Engine:
        with gate.governor.loading():  # the pace controller credits none of a load's CPU
            return _load()

    def _load() -> Engine:
        import json

        from models.runtime.engine import LlamaEngine
        from models.store.store import ModelStore
        from server.engine_factory import chat_template_override

        if model_dir is not None:
            manifest = json.loads((Path(model_dir) / "manifest.json").read_text())
            path, model_id = Path(model_dir), str(manifest.get("id") or Path(model_dir).name)
        else:
            installed = ModelStore(settings.home).load(settings.model)
            manifest, path, model_id = installed.manifest, installed.path, installed.id
        plan = plan_start(
            model_id,
            manifest,
            budget_bytes=memory_budget_bytes(settings),
            context_length=settings.context_length,
            prefix_slots=settings.prefix_cache_slots,
            prefix_budget_bytes=settings.prefix_cache_mb << 20,
            preferred_variant=settings.variant,
        )
        budget = "unknown" if plan.budget_bytes is None else f"{plan.budget_bytes / 2**20:.0f} MiB"
        log.info(
            "start rung %s/%s: needs ~%.0f MiB of %s; ladder %s",
            model_id,
            plan.variant,
            plan.need_bytes / 2**20,
            budget,
            " > ".join(r.variant for r in plan.ladder),
        )
        gate.set_ladder(plan.ladder, plan.start_rung)
        limits = gate.governor.limits
        return LlamaEngine(
            path,
            manifest,
            model_id=model_id,
            variant=limits.variant or plan.variant,
            threads=limits.threads or 1,
            context_length=settings.context_length,
            prefill_chunk=settings.prefill_chunk,
            prefix_slots=settings.prefix_cache_slots,
            prefix_budget_bytes=settings.prefix_cache_mb << 20,
            chat_template=chat_template_override(settings),
        )

    return load


# -- the meter: what a step really costs -----------------------------------------------------------------
class CostMeter:
    """Process CPU seconds (all threads: the engine's pool, the HTTP thread, everything that heats the
    device) and wall seconds per pass of each configuration (variant, threads, spinning) the engine runs.
    A pass is what lies between two steps without the gate's idle: one decode token (a forward pass, the
    sampling, the hand-off), or now and then a prefill chunk, which the medians over the last `window`
    passes leave out. Every `publish_every` passes the configuration's ConfigCost is published: CPU per
    token, and tokens per second unpaced (1 / wall per pass). One pass is one token today; a pass that
    verifies several speculated tokens will have to be divided by the tokens it accepted."""

    def __init__(self, window: int = 32, publish_every: int = 4) -> None:
        self.window = window
        self.publish_every = publish_every
        self._cpu: dict[tuple[str, int, bool], deque[float]] = {}
        self._wall: dict[tuple[str, int, bool], deque[float]] = {}
        self._since: dict[tuple[str, int, bool], int] = {}

    def step(
        self, variant: str, threads: int, spinning: bool, cpu_s: float, wall_s: float
    ) -> ConfigCost | None:
        key = (variant, threads, spinning)
        cpu = self._cpu.setdefault(key, deque(maxlen=self.window))
        wall = self._wall.setdefault(key, deque(maxlen=self.window))
        cpu.append(max(0.0, cpu_s))
        wall.append(max(0.0, wall_s))
        self._since[key] = self._since.get(key, 0) + 1
        if self._since[key] < self.publish_every or len(cpu) < self.publish_every:
            return None
        self._since[key] = 0
        per_token, per_pass = statistics.median(cpu), statistics.median(wall)
        if per_token <= 0:
            return None
        return ConfigCost(variant, threads, spinning, per_token, 1.0 / per_pass if per_pass > 0 else 0.0)


# -- the Gate ------------------------------------------------------------------------------------------
def to_engine_limits(limits: Limits, model_id: str | None = None) -> EngineLimits:
    """The engine's part of the governor's limits. A rung of another model is not this engine's to switch
    to (the variant is left alone)."""
    same_model = model_id is None or limits.model_id in (None, model_id)
    variant = limits.variant if same_model else None
    return EngineLimits(
        threads=limits.threads,
        variant=variant,
        context_cap=limits.context_cap,
        max_tokens=limits.max_tokens,
        tokens_per_second=limits.tokens_per_second,
    )


class GovernorGate:
    """Implements server.worker.Gate on top of a Governor. Also what the routes read (/v1/thermal, /health,
    /metrics) and what create_app subscribes the worker to."""

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
        self._model_id: str | None = None
        self._job: CancelToken | None = None
        self._job_wake = threading.Event()
        self._last_step: float | None = None
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

    def set_ladder(self, ladder: Sequence[Rung], start_rung: int = 0) -> None:
        """The variants to step down on (from the loaded model's manifest) and where to start."""
        self.governor.ladder = list(ladder)
        self.governor.start_rung = start_rung
        model_id = ladder[start_rung].model_id if ladder else None
        if model_id != self._model_id:  # measured costs are per variant name: another model's do not apply
            self.governor.costs = ()
            self.meter = CostMeter(self.meter.window, self.meter.publish_every)
        self._model_id = model_id
        with self._lock:
            self._applied = None  # the engine starts on the rung: tell it everything once
        self.governor.tick()

    # -- what the routes read ---------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return self.governor.snapshot()

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """`callback(state_dict)` on every change (the worker forwards it to streams that opted in)."""
        return self.governor.subscribe(lambda snap: callback(snap.to_dict()))

    def set_lifecycle(self, state: str) -> Snapshot:
        return self.governor.set_lifecycle(state)  # type: ignore[arg-type]

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
        self._check_killed()
        deadline = enqueued_at + self.pause_timeout_s
        self._wait_unpaused(cancel, deadline, new=True)
        return self._changed_limits()

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        if cancel is not self._job:  # a caller that skipped before_job (engine used directly)
            self._job, self._job_wake, self._last_step = cancel, threading.Event(), None
            cancel.on_cancel(self._job_wake.set)
        now = time.monotonic()
        if self._last_step is not None:
            self._measure(self._cpu_time() - self._last_cpu, now - self._last_step)
            self._idle_after_pass(now - self._last_step, cancel)
        self._check_killed()
        self._wait_unpaused(cancel, time.monotonic() + self.pause_timeout_s, new=False)
        limits = self._changed_limits()
        self._last_cpu = self._cpu_time()
        self._last_step = time.monotonic()  # the next call measures the forward pass alone
        return limits

    def _measure(self, cpu_s: float, wall_s: float) -> None:
        """One step of the configuration the engine runs (the limits last applied) into the meter."""
        applied = self._applied
        if applied is None or applied.variant is None or not applied.threads:
            return
        paced = applied.tokens_per_second is not None
        spinning = self._spin == "on" or (self._spin == "auto" and not paced)  # the engine's session_key
        cost = self.meter.step(applied.variant, applied.threads, spinning, cpu_s, wall_s)
        if cost is not None:
            self.governor.costs = merge_cost(self.governor.costs, cost)

    def _idle_after_pass(self, pass_s: float, cancel: CancelToken) -> None:
        # Two lower bounds on the idle after a pass, so the longer one: the device's own throttling
        # (simulated devices: (s - 1) x the pass) and the governor's pace. The pace is held here, for the
        # engine and the meter alike: tokens_per_second (the pass plus the idle take 1 / pace; the engine's
        # own wait then finds nothing left to wait), or without a cost per token the CPU budget
        # (Limits.pace_delay). The meter then sees passes without the idle.
        throttle = self.governor.throttle_delay(pass_s)
        limits = self.governor.limits
        pace = 0.0
        if self.governor.enforce and limits.tokens_per_second:
            pace = max(0.0, 1.0 / limits.tokens_per_second - pass_s)
        elif self.governor.enforce:
            pace = limits.pace_delay(pass_s)
        delay = max(throttle, pace)
        if delay <= 0 or cancel.cancelled:
            return
        self.throttled_seconds += throttle
        if self._sleep is not None:
            self._sleep(delay)
        else:
            self._job_wake.wait(delay)  # wakes early when the client leaves

    def _check_killed(self) -> None:
        if self.governor.device_killed:
            snap = self.governor.snapshot()
            t = snap.temperature
            where = f" at {t.celsius:.1f} C" if t else ""
            raise DeviceOverheated(
                f"The device overheated{where} and stopped the app; the model is unavailable until it "
                "cools below its throttling point. Retry later."
            )

    def _wait_unpaused(self, cancel: CancelToken, deadline: float, *, new: bool) -> None:
        limits = self.governor.limits
        if not (limits.pause_new if new else limits.pause_running):
            return
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
        self._check_killed()
        log.info("%s resumed", "new request" if new else "running reply")

    def _changed_limits(self) -> EngineLimits | None:
        limits = to_engine_limits(self.governor.limits, self._model_id)
        if limits.tokens_per_second:
            # The gate holds the exact pace itself (_idle_after_pass). The engine is told it in 10 % steps,
            # rounded up so its own wait never binds: a continuous pace would be a new limit, and a log
            # line, on every poll.
            step = math.ceil(math.log(limits.tokens_per_second) / math.log(PACE_STEP))
            limits = replace(limits, tokens_per_second=round(PACE_STEP**step, 3))
        with self._lock:
            if limits == self._applied:
                return None
            self._applied = limits
        return limits


def build_gate(settings: Settings, *, thermal: ThermalSource | None = None) -> GovernorGate:
    """The gate for `simmer serve`: the governor from settings, observe-only when settings.governor is False
    (the device still throttles and kills: that is what an ungoverned app suffers)."""
    try:
        governor = build_governor(settings, thermal=thermal)
    except ValueError as err:  # an unknown thermal source or profile, background_action: configuration
        raise InvalidParameter(str(err), param="thermal_source") from err
    return GovernorGate(governor, pause_timeout_s=settings.pause_timeout_s, spin=settings.spin)
