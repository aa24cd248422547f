"""The governor loop: read sensors, decide(), publish a snapshot, tell subscribers. Decide first, act after.

It runs in its own thread (start()/stop()), or a test calls tick() on a fake clock. With a simulated
device the policy runs on simulated time and polls time_scale times as often, so the forecast and the
dwell mean the same thing at any time_scale. Lifecycle leases (governor/lifecycle.py) always run on the
clock itself: clients renew them in wall time, however fast a simulated device heats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from governor.background import BackgroundWork, background_work
from governor.lifecycle import Lease, expire, lifecycle_of, report
from governor.limits import DEFAULT_TABLE, ConfigCost, LevelLimits, Limits, Rung, resolve_limits
from governor.load_heat import LoadHeat, with_priors
from governor.policy import (
    GovernorState,
    Level,
    Lifecycle,
    PolicyConfig,
    Readings,
    Transition,
    decide,
    load_room,
    pace_margin_c,
)
from governor.sensors import (
    BatteryReading,
    MemoryReading,
    NoThermalSource,
    ProcessLoad,
    TemperatureReading,
    ThermalSource,
)

log = logging.getLogger("simmer.governor")


UNDECIDED = BackgroundWork(True, "not decided yet")  # before the first poll


@dataclass(frozen=True)
class Snapshot:
    """Everything /v1/thermal shows; immutable, so it can be handed to any thread."""

    time: float
    level: Level
    reason: str
    cause: str
    temperature: TemperatureReading | None
    temperature_source: str
    headroom: float | None
    forecast_headroom: float | None
    throttle_c: float | None
    memory: MemoryReading | None
    battery: BatteryReading | None
    lifecycle: Lifecycle
    limits: Limits
    enforced: bool
    device_killed: bool
    transitions: tuple[Transition, ...]
    leases: tuple[tuple[str, float], ...] = ()  # (client, seconds left) when the snapshot was taken
    pace_setpoint_c: float | None = None  # where the pace holds the device (None: no pace control)
    background: BackgroundWork = UNDECIDED

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of GET /v1/thermal."""
        t = self.temperature
        m = self.memory
        return {
            "time": round(self.time, 3),  # the governor's clock, the same one transitions use
            "level": self.level,
            "reason": self.reason,
            "cause": self.cause,
            "temperature": {
                "celsius": _round(t.celsius) if t else None,
                "source": self.temperature_source,
                "sensor": t.sensor if t else None,
                "throttle_c": _round(self.throttle_c),
                "critical_c": _round(t.critical_c) if t else None,
                "pace_setpoint_c": _round(self.pace_setpoint_c),
            },
            "headroom": _round(self.headroom, 3),
            "forecast": _round(self.forecast_headroom, 3),
            "memory": None
            if m is None
            else {
                "limit": m.limit_bytes,
                "used": m.used_bytes,
                "available": m.available_bytes,
                "source": m.source,
                "rss": m.rss_bytes,
                "psi": None
                if m.psi_some_avg10 is None
                else {"some_avg10": m.psi_some_avg10, "full_avg10": m.psi_full_avg10},
            },
            "battery": None if self.battery is None else asdict(self.battery),
            "background_work": {"runs": self.background.runs, "why": self.background.why},
            "lifecycle": self.lifecycle,
            "leases": [{"client": c, "expires_in": round(left, 1)} for c, left in self.leases],
            "limits": asdict(self.limits),
            "enforced": self.enforced,
            "device_killed": self.device_killed,
            "transitions": [
                {"time": round(tr.time, 3), "old": tr.old, "new": tr.new, "reason": tr.reason}
                for tr in self.transitions
            ],
        }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


Subscriber = Callable[[Snapshot], None]


class Governor:
    def __init__(
        self,
        *,
        thermal: ThermalSource | None = None,
        read_memory: Callable[[], MemoryReading | None] = lambda: None,
        read_battery: Callable[[], BatteryReading | None] = lambda: None,
        config: PolicyConfig | None = None,
        usable_cpus: int = 1,
        table: Mapping[Level, LevelLimits] = DEFAULT_TABLE,
        ladder: Sequence[Rung] = (),
        start_rung: int = 0,
        costs: Sequence[ConfigCost] = (),
        read_load: Callable[[], float | None] | None = None,
        poll_s: float = 1.0,
        enforce: bool = True,
        clock: Callable[[], float] = time.monotonic,
        load_heat: LoadHeat | None = None,
    ) -> None:
        """`load_heat`: what model loads heated this device by, kept across restarts (None: measured in
        this process only)."""
        self.thermal: ThermalSource = thermal or NoThermalSource()
        self._read_memory = read_memory
        self._read_battery = read_battery
        self._read_load = read_load or ProcessLoad.for_source(self.thermal).read
        self.config = config or PolicyConfig()
        if self.config.pace_max_cores is None:  # the pace controller may spend every usable core
            self.config = replace(self.config, pace_max_cores=float(max(1, usable_cpus)))
        self.usable_cpus = usable_cpus
        self.table = table
        self.ladder = list(ladder)
        # what each model's load reads, for load_heat.with_priors: its biggest variant (any may load)
        self._model_bytes: dict[str, int] = {}
        for rung in self.ladder:
            self._model_bytes[rung.model_id] = max(self._model_bytes.get(rung.model_id, 0), rung.bytes)
        self.start_rung = start_rung
        self.costs: Sequence[ConfigCost] = costs  # measured CPU s/token per configuration, if any
        self.enforce = enforce
        self.load_heat = load_heat or LoadHeat()
        self._clock = clock
        sim = self.thermal.simulator
        # Poll in simulated seconds: poll_s of device time, however fast the simulation runs.
        self.poll_interval_s = poll_s / sim.time_scale if sim else poll_s
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._subscribers: dict[int, Subscriber] = {}
        self._next_id = 0
        self._leases: tuple[Lease, ...] = ()
        self._loads = 0  # models loading now
        self._loaded_since_poll = False  # a load ended after the last poll: its tail is in this poll's CPU
        self._models: frozenset[str] | None = None  # the models loaded now (None: not told; no hold)
        self._threads_since = -math.inf  # when the limits last named another thread count
        self._build_s = 0.0  # how long the last load or session build took, on the governor's clock
        self._state = GovernorState()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._readings = Readings()
        self._snapshot = self._build_snapshot(self._now(), self._readings, self._state)

    # -- the loop ----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self.tick()
        self._thread = threading.Thread(target=self._run, name="simmer-governor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.tick()
            except Exception:  # a sensor bug must not kill governing; the next poll tries again
                log.exception("governor poll failed")

    def _now(self) -> float:
        sim = self.thermal.simulator
        return sim.sim_time if sim is not None else self._clock()

    def tick(self) -> Snapshot:
        """One poll: read, decide, publish. Returns the new snapshot."""
        with self._lock:
            self._expire_leases()
            readings = Readings(
                temperature=self.thermal.read(),
                memory=self._read_memory(),
                battery=self._read_battery(),
                lifecycle=lifecycle_of(self._leases),
                busy_cores=self._read_load(),
                loading=self._loads > 0 or self._loaded_since_poll,
            )
            self._loaded_since_poll = False
            now = self._now()
            old = self._state
            self._state = decide(old, readings, self.config, now)
            if self._state.level != old.level:
                log.info("%s -> %s: %s", old.level, self._state.level, self._state.reason)
            self._readings = readings
            snap, subscribers = self._publish(now)
        _tell(subscribers, snap)
        return snap

    def _publish(self, now: float) -> tuple[Snapshot, list[Subscriber]]:
        """The snapshot of the state decided last (under the lock), and who must hear of it."""
        previous = self._snapshot
        self._snapshot = snap = self._build_snapshot(now, self._readings, self._state)
        if snap.limits.threads != previous.limits.threads:
            self._threads_since = now
        old_rung, new_rung = _rung(previous.limits), _rung(snap.limits)
        if old_rung != new_rung and previous.limits.variant is not None:
            held = "; held on a loaded model while the device cools" if snap.limits.rung_held else ""
            log.info("rung %s -> %s: %s (%s%s)", old_rung, new_rung, snap.level, self._state.reason, held)
        changed = _differs(previous, snap)
        if changed:
            self._changed.notify_all()
        return snap, list(self._subscribers.values()) if changed else []

    def _build_snapshot(self, now: float, readings: Readings, state: GovernorState) -> Snapshot:
        level: Level = state.level if self.enforce else "nominal"
        previous = getattr(self, "_snapshot", None)
        running = previous.limits if previous is not None else None
        waiting = running is not None and running.rung_held
        room = load_room(state, self.config, waiting) if self.enforce else None
        reading = readings.temperature
        rises = {}  # read only where choose_rung will use them: a room, a ladder, what is loaded known
        if room is not None and reading is not None and self._models is not None and self.ladder:
            rises = with_priors(self.load_heat.rises(self._device(reading)), self._model_bytes)
        limits = resolve_limits(
            level,
            usable_cpus=self.usable_cpus,
            table=self.table,
            ladder=self.ladder,
            start_rung=self.start_rung,
            pace_cores=state.pace_cores if self.enforce else None,
            thermal=state.cause == "thermal",
            costs=self.costs,
            current=(running.variant, running.threads)
            if running and running.variant and running.threads
            else None,
            hold=now - self._threads_since < self._config_dwell_s(),
            loaded=self._models,
            room=room,
            rises=rises,
            # on battery, tokens per CPU-second (the charge), not per second
            frugal=self.enforce and readings.battery is not None and readings.battery.plugged is False,
        )
        return Snapshot(
            time=now,
            level=state.level,
            reason=state.reason,
            cause=state.cause,
            temperature=readings.temperature,
            temperature_source=self.thermal.source,
            headroom=state.headroom,
            forecast_headroom=state.forecast_headroom,
            throttle_c=state.throttle_c,
            memory=readings.memory,
            battery=readings.battery,
            lifecycle=readings.lifecycle,
            limits=limits,
            enforced=self.enforce,
            device_killed=self.device_killed,
            transitions=state.transitions,
            leases=self._lease_view(),
            pace_setpoint_c=None
            if state.throttle_c is None or state.pace_cores is None
            else state.throttle_c - pace_margin_c(state, self.config),
            background=background_work(
                level=state.level,
                lifecycle=readings.lifecycle,
                battery=readings.battery,
                mode=self.config.background_work,
                min_battery_percent=self.config.background_min_battery_percent,
            ),
        )

    # -- for the server ----------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    @property
    def limits(self) -> Limits:
        return self.snapshot().limits

    def set_lifecycle(
        self, state: Lifecycle, client: str = "anonymous", ttl_s: float | None = None
    ) -> Snapshot:
        """`client` reports foreground | background. Background takes (or renews) that client's lease for
        `ttl_s` (default and maximum: config.lifecycle_ttl_s); foreground ends it. Takes effect at once (a
        fresh poll), not at the next tick. Raises TooManyLeases when max_leases other clients hold one."""
        if state not in ("foreground", "background"):
            raise ValueError(f"lifecycle must be foreground or background, not {state!r}")
        limit = self.config.lifecycle_ttl_s
        ttl = limit if ttl_s is None else ttl_s
        if not 0 < ttl <= limit:
            raise ValueError(f"ttl_s must be above 0 and at most {limit:g} seconds, not {ttl_s!r}")
        with self._lock:
            self._expire_leases()
            before = self._leases
            self._leases = report(before, client, state, self._clock(), ttl, self.config.max_leases)
            self._log_report(before, client, state, ttl)
        return self.tick()

    @contextlib.contextmanager
    def loading(self, model_id: str | None = None) -> Iterator[None]:
        """Wraps a model load: the polls during it, and the first one after it, tell the pace controller
        that the process's CPU is a load's, not paced work (policy.decide_pace holds its integral). With
        `model_id`, the temperature before and after it is the heat of that model's load (load_heat)."""
        with self._lock:
            self._loads += 1
            before = self._read_for_load() if model_id else None
            started = self._now()
        loaded = False
        try:
            yield
            loaded = True
        finally:
            with self._lock:
                self._loads -= 1
                self._loaded_since_poll = True
                if loaded:
                    self._build_s = max(0.0, self._now() - started)
                after = self._read_for_load() if before is not None and loaded else None
            if model_id and before is not None and after is not None:
                self.load_heat.record(self._device(after), model_id, after.celsius - before.celsius)

    def _config_dwell_s(self) -> float:
        """How long a thread count stays once changed: config_dwell_s, or config_dwell_builds times what the
        last build took where that is longer (on a simulated device, in its seconds: a build's wall time is
        time_scale times as long to the device, so at time scale 10 a 2.2 s build outlasts a 20 s dwell)."""
        return max(self.config.config_dwell_s, self.config.config_dwell_builds * self._build_s)

    def _read_for_load(self) -> TemperatureReading | None:
        try:
            return self.thermal.read()
        except Exception:  # a sensor that fails here costs one measurement, never the load
            log.exception("reading the temperature around a load failed")
            return None

    def _device(self, reading: TemperatureReading) -> str:
        """The key load_heat keeps a device's measurements under: its sensor, and for a simulated device
        its time scale (a device with 1/time_scale of the heat capacity)."""
        sim = self.thermal.simulator
        scale = f"@x{sim.time_scale:g}" if sim is not None else ""
        return f"{reading.source}:{reading.sensor}{scale}"

    def models_loaded(self, models: frozenset[str]) -> Snapshot:
        """The worker's pool loaded or unloaded a model: `models` are loaded now; a rung whose model is not
        among them counts its load's heat first (limits.choose_rung). The limits follow at once (the last
        poll's decision, no new reading), so the rung never names a model just unloaded, nor leaves one just
        loaded, until the next poll."""
        with self._lock:
            self._models = frozenset(models)
            snap, subscribers = self._publish(self._snapshot.time)
        _tell(subscribers, snap)
        return snap

    def active_leases(self) -> list[dict[str, Any]]:
        """The background leases held now: [{"client", "expires_in"}] (seconds, on the governor's clock)."""
        with self._lock:
            return [{"client": c, "expires_in": round(left, 1)} for c, left in self._lease_view()]

    def _lease_view(self) -> tuple[tuple[str, float], ...]:
        now = self._clock()
        return tuple((lease.client, max(0.0, lease.expires_at - now)) for lease in self._leases)

    def _expire_leases(self) -> None:
        """Drop the leases whose time is up, and say so (under the lock)."""
        self._leases, gone = expire(self._leases, self._clock())
        if not gone:
            return
        names = ", ".join(lease.client for lease in gone)
        plural = "s" if len(gone) > 1 else ""
        if self._leases:
            log.info("lease%s from %s expired; still background (%s)", plural, names, _holders(self._leases))
        else:
            log.info("background -> foreground: lease%s from %s expired", plural, names)

    def _log_report(self, before: tuple[Lease, ...], client: str, state: Lifecycle, ttl: float) -> None:
        was, now = lifecycle_of(before), lifecycle_of(self._leases)
        renewal = any(lease.client == client for lease in before)
        if was != now and now == "background":
            log.info("foreground -> background: lease from %s for %g s", client, ttl)
        elif was != now:
            log.info("background -> foreground: %s reported foreground", client)
        elif state == "background" and not renewal:
            log.info("lease from %s for %g s; already background", client, ttl)
        elif state == "foreground" and renewal:
            log.info("lease from %s ended; still background (%s)", client, _holders(self._leases))

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(snapshot)` on every change of level, limits, lifecycle or kill state. It runs on
        the governor's thread and must not block. Returns an unsubscribe function."""
        with self._lock:
            key = self._next_id
            self._next_id += 1
            self._subscribers[key] = callback

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers.pop(key, None)

        return unsubscribe

    def subscribe_async(
        self, loop: asyncio.AbstractEventLoop, maxsize: int = 16
    ) -> tuple[asyncio.Queue[Snapshot], Callable[[], None]]:
        """For an SSE endpoint: an asyncio.Queue on `loop` fed with changes. When a slow reader lets it
        fill up, the oldest snapshot is dropped: only the latest state matters."""
        queue: asyncio.Queue[Snapshot] = asyncio.Queue(maxsize=maxsize)

        def put(snap: Snapshot) -> None:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(snap)

        def on_change(snap: Snapshot) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(put, snap)

        return queue, self.subscribe(on_change)

    # -- for the worker ----------------------------------------------------------------------------------
    def wait_while_paused(
        self,
        cancel_check: Callable[[], bool] = lambda: False,
        timeout: float | None = None,
        *,
        new: bool = False,
    ) -> bool:
        """Block while the running reply is paused (new=True: while new requests are held).
        True when work may go on; False on timeout or when cancel_check() says so. Waits in wall time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                limits = self._snapshot.limits
                if not (limits.pause_new if new else limits.pause_running):
                    return True
                if cancel_check():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                # Wake up now and then to look at cancel_check even if nothing changes.
                self._changed.wait(0.1 if remaining is None else min(remaining, 0.1))

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def throttle_delay(self, pass_seconds: float) -> float:
        """Seconds to idle after a forward pass: the simulated device's own throttling (0 on real ones,
        where the hardware does it)."""
        sim = self.thermal.simulator
        return sim.throttle_delay(pass_seconds) if sim is not None else 0.0

    @property
    def device_killed(self) -> bool:
        """The simulated device killed the app (T >= T_critical) and it has not cooled below T_throttle."""
        sim = self.thermal.simulator
        return sim.killed if sim is not None else False


def _tell(subscribers: list[Subscriber], snap: Snapshot) -> None:
    """Outside the lock: a subscriber may read the governor."""
    for callback in subscribers:
        try:
            callback(snap)
        except Exception:
            log.exception("governor subscriber failed")


def _rung(limits: Limits) -> str:
    return f"{limits.model_id}/{limits.variant}"


def _holders(leases: tuple[Lease, ...]) -> str:
    return "leases from " + ", ".join(lease.client for lease in leases)


def _differs(a: Snapshot, b: Snapshot) -> bool:
    """A change worth telling subscribers: not a lease renewal (only who holds one)."""
    return (
        a.level,
        _coarse(a.limits),
        a.lifecycle,
        a.device_killed,
        a.cause,
        _clients(a),
        a.background.runs,
    ) != (
        b.level,
        _coarse(b.limits),
        b.lifecycle,
        b.device_killed,
        b.cause,
        _clients(b),
        b.background.runs,
    )


def _coarse(limits: Limits) -> Limits:
    """The pace controller moves the budget a little on every poll: subscribers (SSE, the UI) hear of a
    change of pace only when it crosses a 10 % step. The worker reads the exact limits on every token."""

    def step(x: float | None) -> float | None:
        return None if x is None or x <= 0 else round(math.log(x) / math.log(1.1))

    return replace(
        limits,
        tokens_per_second=step(limits.tokens_per_second),
        cpu_budget_cores=step(limits.cpu_budget_cores),
    )


def _clients(snap: Snapshot) -> tuple[str, ...]:
    return tuple(sorted(client for client, _ in snap.leases))
