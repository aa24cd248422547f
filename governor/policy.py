"""The policy: a pure function from (previous state, readings, config, now) to the next state.

No clock, no I/O, no logging: the governor loop reads sensors, calls decide(), then acts and logs. Tests
drive it table by table with a fake clock.

Levels follow Apple's ProcessInfo.ThermalState names. What they correspond to elsewhere (the temperature
band is for a thermal cause; headroom as in Android's getThermalHeadroom, 1.0 = the throttling threshold):

| simmer   | headroom (default) | Android PowerManager thermal status    | OpenHarmony ThermalLevel          |
|----------|--------------------|----------------------------------------|-----------------------------------|
| nominal  | < 0.80             | NONE, LIGHT                            | COOL, NORMAL                      |
| fair     | 0.80 .. 0.95       | MODERATE                               | WARM                              |
| serious  | 0.95 .. 1.00       | SEVERE (approaching)                   | HOT                               |
| critical | emergency (below)  | SEVERE reached, CRITICAL, EMERGENCY,   | OVERHEATED, WARNING, EMERGENCY,   |
|          |                    | SHUTDOWN                               | ESCAPE                            |

The thermal steady state is held by pace, not by pauses: a PI controller on headroom (decide_pace below)
gives the CPU budget (busy cores) that keeps the device a little below headroom 1.0, so the device's own
throttling never starts and replies never stop. Critical, the level that pauses, is left for emergencies:
the device within emergency_margin_c of the temperature at which it kills the app (now or forecast). A
sensor that names no such temperature gets the old rule: critical at headroom 1.0, the one limit we know.
With pace_control off the policy is the level machine alone (critical, and so a pause, at headroom 1.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from governor.sensors import BatteryReading, MemoryReading, TemperatureReading

Level = Literal["nominal", "fair", "serious", "critical"]
LEVELS: tuple[Level, ...] = ("nominal", "fair", "serious", "critical")
Cause = Literal["none", "thermal", "memory", "battery", "lifecycle"]
Lifecycle = Literal["foreground", "background"]

ANDROID_THERMAL_STATUS: dict[str, tuple[str, ...]] = {
    "nominal": ("NONE", "LIGHT"),
    "fair": ("MODERATE",),
    "serious": ("SEVERE",),
    "critical": ("CRITICAL", "EMERGENCY", "SHUTDOWN"),
}
OPENHARMONY_THERMAL_LEVEL: dict[str, tuple[str, ...]] = {
    "nominal": ("COOL", "NORMAL"),
    "fair": ("WARM",),
    "serious": ("HOT",),
    "critical": ("OVERHEATED", "WARNING", "EMERGENCY", "ESCAPE"),
}


def level_index(level: str) -> int:
    return LEVELS.index(level)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Readings:
    """One poll's worth of inputs. Any sensor may be None (absent)."""

    temperature: TemperatureReading | None = None
    memory: MemoryReading | None = None
    battery: BatteryReading | None = None
    lifecycle: Lifecycle = "foreground"
    busy_cores: float | None = None  # this process's CPU seconds per second since the last poll
    loading: bool = False  # a model was being loaded since the last poll (its CPU is not paced work)


@dataclass(frozen=True)
class PolicyConfig:
    # thermal
    throttle_c: float | None = None  # overrides the sensor's trip point (headroom 1.0)
    default_throttle_c: float = 85.0  # for sensors that report no trip point
    headroom_span_c: float = 30.0  # headroom 0.0 is this far below the throttling threshold
    forecast_s: float = 10.0
    forecast_min_span_s: float = 5.0  # no trend from fewer seconds of samples (a coarse sensor's one step)
    history_s: float = 30.0  # samples kept for the forecast regression
    fair_headroom: float = 0.80
    serious_headroom: float = 0.95
    critical_headroom: float = 1.00  # critical when no T_critical is known, or pace_control is off
    critical_c: float | None = None  # overrides the sensor's T_critical (where the device kills the app)
    emergency_margin_c: float = 1.0  # with pace control: critical this far below T_critical
    hysteresis_c: float = 2.0  # leave a level only this far below its entry threshold
    min_dwell_s: float = 10.0  # time at a level before stepping down
    # memory: fraction of the budget still available, and PSI avg10 percentages
    memory_budget_bytes: int | None = None  # None: the effective (cgroup or host) limit
    memory_fair_fraction: float = 0.20
    memory_serious_fraction: float = 0.10
    memory_critical_fraction: float = 0.05
    psi_some_fair: float = 10.0
    psi_full_serious: float = 5.0
    psi_full_critical: float = 20.0
    # battery and lifecycle
    battery_low_percent: float = 20.0
    # heavy work nobody waits for (governor/background.py): "always" runs it whatever the device's state
    background_work: Literal["auto", "always"] = "auto"
    background_min_battery_percent: float = 50.0  # below this, unplugged, it waits for the charger
    background_action: Literal["pause", "low_priority"] = "pause"
    lifecycle_ttl_s: float = 30.0  # a background report's lease (governor/lifecycle.py): default and maximum
    max_leases: int = 64  # distinct clients holding background leases at once
    max_transitions: int = 20
    # the pace controller (decide_pace): a PI law on headroom whose output is a CPU budget in busy cores
    pace_control: bool = True
    # the steady state is held this far below T_throttle: pace_margin_c, or pace_margin_steps of the
    # sensor's resolution where that is more, at most pace_margin_max_c (pace_margin_c())
    pace_margin_c: float = 0.1
    pace_margin_steps: float = 0.6
    pace_margin_max_c: float = 0.6
    pace_kp: float = 12.0  # busy cores per unit of headroom error (0.4 core per C)
    pace_ki: float = 0.15  # busy cores per unit of headroom error per second (integral time 80 s)
    pace_min_cores: float = 0.05  # the slowest pace; below it is a pause, which only an emergency earns
    pace_max_cores: float | None = None  # None: the governor's usable CPUs
    pace_max_dt_s: float = 5.0  # a late poll integrates at most this long
    pace_binding: float = 0.75  # the budget is in use when the process is this busy (of the budget) or more
    # no model loads while headroom now or forecast is at least this (load_room), and once a load waited,
    # until the device is this much further below it, at most half the pace's margin (a paced device that
    # waits on a bigger model must get there)
    load_headroom: float = 1.0
    load_hysteresis_c: float = 0.3
    # a change of threads builds a new onnxruntime session (seconds of full CPU for a 1.5B model, the reply
    # stalled): the configuration the pace picked stays at least this long, and at least this many times
    # what the last build took (limits.pick_config's hold; Governor._config_dwell_s): at most a tenth of
    # the time goes on building
    config_dwell_s: float = 20.0
    config_dwell_builds: float = 10.0

    def __post_init__(self) -> None:
        if not self.fair_headroom <= self.serious_headroom <= self.critical_headroom:
            raise ValueError("headroom thresholds must be ordered fair <= serious <= critical")
        if not 0.0 < self.pace_min_cores <= (self.pace_max_cores or math.inf):
            raise ValueError("pace bounds must satisfy 0 < pace_min_cores <= pace_max_cores")
        if not (0 < self.pace_margin_c <= self.pace_margin_max_c and self.pace_margin_steps >= 0):
            raise ValueError("pace margins must satisfy 0 < pace_margin_c <= pace_margin_max_c, steps >= 0")
        if self.pace_kp < 0 or self.pace_ki < 0:
            raise ValueError("pace gains must be >= 0")
        if self.background_action not in ("pause", "low_priority"):
            raise ValueError(f"background_action: pause or low_priority, not {self.background_action!r}")
        if not (self.lifecycle_ttl_s > 0 and math.isfinite(self.lifecycle_ttl_s)):
            raise ValueError(
                f"lifecycle_ttl_s must be a positive number of seconds, not {self.lifecycle_ttl_s}"
            )


@dataclass(frozen=True)
class Transition:
    time: float
    old: Level
    new: Level
    reason: str


@dataclass(frozen=True)
class GovernorState:
    level: Level = "nominal"
    reason: str = "no pressure"
    cause: Cause = "none"
    since: float = -math.inf  # when `level` was entered
    thermal_level: Level = "nominal"
    thermal_since: float = -math.inf
    memory_level: Level = "nominal"
    memory_since: float = -math.inf
    samples: tuple[tuple[float, float], ...] = ()  # (time, C), the last history_s seconds
    sensor_step_c: float | None = None  # the smallest change between two readings seen (sensor_step)
    temperature_c: float | None = None
    throttle_c: float | None = None
    headroom: float | None = None
    forecast_headroom: float | None = None
    critical_headroom: float | None = None  # where critical (a pause) starts for this sensor
    transitions: tuple[Transition, ...] = field(default=())
    pace_cores: float | None = None  # the pace controller's CPU budget (None: no temperature to control on)
    pace_integral: float = 0.0
    pace_time: float | None = None  # when the controller last ran


def headroom(celsius: float, throttle_c: float, span_c: float) -> float:
    """Android's getThermalHeadroom scale: 1.0 at the throttling threshold, 0.0 span_c below it."""
    return 1.0 - (throttle_c - celsius) / span_c


def forecast_c(samples: tuple[tuple[float, float], ...], now_c: float, seconds: float) -> float:
    """Now plus the least-squares slope of the recent samples times `seconds`."""
    if len(samples) < 2:
        return now_c
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_c = sum(c for _, c in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var <= 0:
        return now_c
    slope = sum((t - mean_t) * (c - mean_c) for t, c in samples) / var
    return now_c + slope * seconds


def _threshold_level(h: float, config: PolicyConfig, critical_h: float) -> Level:
    if h >= critical_h:
        return "critical"
    if h >= config.serious_headroom:
        return "serious"
    if h >= config.fair_headroom:
        return "fair"
    return "nominal"


def _entry_c(level: Level, throttle_c: float, config: PolicyConfig, critical_h: float) -> float:
    """The temperature at which `level` is entered."""
    h = {
        "nominal": -math.inf,
        "fair": config.fair_headroom,
        "serious": config.serious_headroom,
        "critical": critical_h,
    }[level]
    return throttle_c - config.headroom_span_c * (1.0 - h)


def critical_entry(throttle_c: float, critical_c: float | None, config: PolicyConfig) -> float:
    """Where the critical level (a pause) starts. With pace control and a known T_critical: the emergency,
    emergency_margin_c below it (never below critical_headroom). Otherwise critical_headroom."""
    if not config.pace_control or critical_c is None:
        return config.critical_headroom
    emergency = headroom(critical_c - config.emergency_margin_c, throttle_c, config.headroom_span_c)
    return max(config.critical_headroom, emergency)


def _step_down(level: Level) -> Level:
    return LEVELS[max(0, level_index(level) - 1)]


# The thermal rule table, applied to the previous thermal level L (after gov_step_wise.c):
#
#   trend: the worse of headroom now and headroom forecast_s ahead, mapped through the thresholds
#          (critical: critical_entry(), the emergency when pace control is on and T_critical is known).
#
#   trend level >  L                                         -> that level, at once (may skip levels)
#   T_now and T_forecast < entry(L) - hysteresis_c
#                    and at L for at least min_dwell_s       -> L - 1 (one step at a time)
#   otherwise                                                -> L
#   no temperature reading                                   -> nominal (nothing to govern on)
#
# The other inputs give a floor each; the governing level is the worst of them:
#   memory: available/budget < 20 % or PSI some avg10 >= 10 -> fair; < 10 % or PSI full >= 5 -> serious;
#           < 5 % or PSI full >= 20 -> critical. Escalates at once, steps down one level per min_dwell_s.
#   battery: not plugged in and <= battery_low_percent      -> fair
#   lifecycle: background                                    -> critical (pause) or serious (low_priority)
# Ties name the first cause in the order thermal, memory, battery, lifecycle.
def decide(prev: GovernorState, readings: Readings, config: PolicyConfig, now: float) -> GovernorState:
    state = prev
    thermal_level, thermal_reason, state = _decide_thermal(state, readings.temperature, config, now)
    memory_level, memory_reason = _decide_memory(prev, readings.memory, config, now)
    if memory_level != prev.memory_level:
        state = replace(state, memory_level=memory_level, memory_since=now)

    candidates: list[tuple[Level, Cause, str]] = [(thermal_level, "thermal", thermal_reason)]
    candidates.append((memory_level, "memory", memory_reason))
    battery = readings.battery
    if battery is not None and battery.plugged is False and battery.percent <= config.battery_low_percent:
        candidates.append(("fair", "battery", f"battery: {battery.percent:.0f} %, not plugged in"))
    if readings.lifecycle == "background":
        lifecycle_level: Level = "critical" if config.background_action == "pause" else "serious"
        action = "pause" if config.background_action == "pause" else "low priority"
        candidates.append((lifecycle_level, "lifecycle", f"lifecycle: background ({action})"))

    state = decide_pace(state, config, now, readings.busy_cores, readings.loading)
    level, cause, reason = max(candidates, key=lambda c: level_index(c[0]))  # max keeps the first of ties
    if level == "nominal":
        cause = "none"
        reason = thermal_reason if readings.temperature is not None else "no pressure"

    transitions = prev.transitions
    since = prev.since
    if level != prev.level:
        transitions = (*transitions, Transition(now, prev.level, level, reason))[-config.max_transitions :]
        since = now
    return replace(state, level=level, cause=cause, reason=reason, since=since, transitions=transitions)


def _decide_thermal(
    state: GovernorState, reading: TemperatureReading | None, config: PolicyConfig, now: float
) -> tuple[Level, str, GovernorState]:
    if reading is None:
        state = replace(
            state,
            temperature_c=None,
            headroom=None,
            forecast_headroom=None,
            throttle_c=None,
            critical_headroom=None,
            samples=(),
        )
        if state.thermal_level != "nominal":
            state = replace(state, thermal_level="nominal", thermal_since=now)
        return "nominal", "thermal: no sensor", state

    t_now = reading.celsius
    throttle_c = config.throttle_c or reading.throttle_c or config.default_throttle_c
    samples = tuple(s for s in state.samples if s[0] > now - config.history_s and s[0] < now)
    samples = (*samples, (now, t_now))
    span = samples[-1][0] - samples[0][0]
    t_fc = forecast_c(samples, t_now, config.forecast_s) if span >= config.forecast_min_span_s else t_now
    h_now = headroom(t_now, throttle_c, config.headroom_span_c)
    h_fc = headroom(t_fc, throttle_c, config.headroom_span_c)
    critical_h = critical_entry(throttle_c, config.critical_c or reading.critical_c, config)

    prev_level = state.thermal_level
    trend = _threshold_level(max(h_now, h_fc), config, critical_h)
    level = prev_level
    if level_index(trend) > level_index(prev_level):
        level = trend
    elif (
        max(t_now, t_fc) < _entry_c(prev_level, throttle_c, config, critical_h) - config.hysteresis_c
        and now - state.thermal_since >= config.min_dwell_s
    ):
        level = _step_down(prev_level)

    reason = f"thermal: {t_now:.1f} C, headroom {h_now:.2f} (forecast {h_fc:.2f})"
    state = replace(
        state,
        samples=samples,
        temperature_c=t_now,
        throttle_c=throttle_c,
        headroom=h_now,
        forecast_headroom=h_fc,
        critical_headroom=critical_h,
        sensor_step_c=sensor_step(state.sensor_step_c, state.temperature_c, t_now),
    )
    if level != prev_level:
        state = replace(state, thermal_level=level, thermal_since=now)
    return level, reason, state


STEP_FLOOR_C = 0.001  # sysfs reports millidegrees: a smaller difference is float rounding, not a step


def sensor_step(step_c: float | None, before_c: float | None, now_c: float) -> float | None:
    """The sensor's resolution as far as its readings show it: the smallest change between two successive
    readings (a whole-degree sensor never moves by less than 1 C; a fine one soon shows a small change)."""
    if before_c is None or abs(now_c - before_c) < STEP_FLOOR_C:
        return step_c
    return abs(now_c - before_c) if step_c is None else min(step_c, abs(now_c - before_c))


def pace_margin_c(state: GovernorState, config: PolicyConfig) -> float:
    """How far below T_throttle the pace holds the device. Every tenth of a degree of margin costs busy
    cores the envelope allows: on phone-heatwave, whose idle device sits 2.6 C below T_throttle, 0.6 C of
    margin cost a quarter of them. A coarse sensor needs more: its reading lags the truth by up to half a
    step, and the pace then cycles one step either side of the setpoint (0.6 steps keeps a whole-degree
    sensor below T_throttle: tests/governor/test_closed_loop.py). At most pace_margin_max_c: a fine sensor
    whose first readings jumped (a late poll) looks coarse until it moves by less, and none needs more."""
    by_step = config.pace_margin_steps * (state.sensor_step_c or 0.0)
    return min(max(config.pace_margin_c, by_step), config.pace_margin_max_c)


# The pace controller, run on every reading: a PI law on headroom whose output is the CPU budget (average
# busy cores) the device can sustain. It limits only where it binds: a cool device's budget is all the cores.
#
#   setpoint = 1 - pace_margin_c() / headroom_span_c               (0.1 C below T_throttle; more on a
#                                                                   coarse sensor)
#   e = setpoint - headroom now                                    (> 0: room to spare)
#   u = clamp(pace_kp * e + I, pace_min_cores, pace_max_cores)     the budget
#   I += pace_ki * e * dt  (dt: since the last reading, at most pace_max_dt_s), only
#        - while u is inside its bounds, or e pulls it back inside (conditional integration: a cold device
#          stores up no credit, a hot one no debt), and
#        - upwards only while the budget is in use: the process was at least pace_binding x the last
#          budget busy (tracking anti-windup: an idle server earns no credit for the burst that
#          follows); no load reading: as if in use
#        - not at all while a model loads (loading): loading keeps the process busy, but the budget
#          does not govern it (the gate paces forward passes only), so it is neither credit nor debt;
#          the proportional term still answers the heat it makes
#   I stays within [0, pace_max_cores]
#   no temperature reading, or pace_control off                    -> no budget, I = 0
#
# Headroom now, not the forecast: the forecast's 30 s regression lags a step in load, and the proportional
# term already answers a rise at once. The gains were tuned in closed loop with the simulator
# (tests/governor/test_closed_loop.py): no overshoot past the setpoint from cold on phone, phone-heatwave
# and car-head-unit, and a steady state within 0.1 C of it.
def decide_pace(
    state: GovernorState,
    config: PolicyConfig,
    now: float,
    busy_cores: float | None = None,
    loading: bool = False,
) -> GovernorState:
    if not config.pace_control or state.headroom is None:
        return replace(state, pace_cores=None, pace_integral=0.0, pace_time=None)
    lo, hi = config.pace_min_cores, max(config.pace_min_cores, config.pace_max_cores or 1.0)
    e = 1.0 - pace_margin_c(state, config) / config.headroom_span_c - state.headroom
    integral = state.pace_integral
    dt = 0.0 if state.pace_time is None else min(max(0.0, now - state.pace_time), config.pace_max_dt_s)
    raw = config.pace_kp * e + integral
    in_use = (
        busy_cores is None or state.pace_cores is None or busy_cores >= config.pace_binding * state.pace_cores
    )
    inside = lo < raw < hi or (raw >= hi and e < 0) or (raw <= lo and e > 0)
    if inside and (e < 0 or in_use) and not loading:
        integral = min(max(integral + config.pace_ki * e * dt, 0.0), hi)
    u = min(max(config.pace_kp * e + integral, lo), hi)
    return replace(state, pace_cores=u, pace_integral=integral, pace_time=now)


@dataclass(frozen=True)
class LoadRoom:
    """What the device can take of a model load now (limits.choose_rung decides with it)."""

    below_throttle: bool  # the hotter of now and the forecast is below load_headroom (T_throttle)
    room_c: float  # degrees from the hotter of now and the forecast to where critical (a pause) starts


# The room a load has. A load is seconds of full CPU that no pace governs: on a device past its throttling
# point it is heat the device cannot shed, and one that heats it into the emergency pauses every reply.
#
#   no temperature reading                                      -> None (nothing to govern on: any load)
#   memory at serious or critical                               -> None (a smaller model is what frees
#                                                                  memory; the OS kills first)
#   otherwise -> LoadRoom(below_throttle: max(headroom now, forecast) < load_headroom, or, while a load
#                                         waits already (`waiting`), load_hysteresis_c further below it,
#                                         at most half pace_margin_c() (a device hovering at T_throttle
#                                         must not flip the rung each poll; a paced one must get there),
#                         room_c: (critical entry - max(headroom now, forecast)) x headroom_span_c)
def load_room(state: GovernorState, config: PolicyConfig, waiting: bool = False) -> LoadRoom | None:
    if state.headroom is None or state.critical_headroom is None:
        return None
    if level_index(state.memory_level) >= level_index("serious"):
        return None
    forecast = state.forecast_headroom if state.forecast_headroom is not None else state.headroom
    hotter = max(state.headroom, forecast)
    room = (state.critical_headroom - hotter) * config.headroom_span_c
    hysteresis_c = min(config.load_hysteresis_c, pace_margin_c(state, config) / 2) if waiting else 0.0
    limit = config.load_headroom - hysteresis_c / config.headroom_span_c
    return LoadRoom(below_throttle=hotter < limit, room_c=room)


def _decide_memory(
    prev: GovernorState, reading: MemoryReading | None, config: PolicyConfig, now: float
) -> tuple[Level, str]:
    if reading is None:
        return "nominal", "memory: unknown"
    budget = config.memory_budget_bytes or reading.limit_bytes
    available = reading.available_bytes
    if config.memory_budget_bytes is not None and reading.rss_bytes is not None:
        available = min(available, config.memory_budget_bytes - reading.rss_bytes)
    fraction = available / budget if budget > 0 else 1.0
    some, full = reading.psi_some_avg10 or 0.0, reading.psi_full_avg10 or 0.0

    raw: Level = "nominal"
    if fraction < config.memory_critical_fraction or full >= config.psi_full_critical:
        raw = "critical"
    elif fraction < config.memory_serious_fraction or full >= config.psi_full_serious:
        raw = "serious"
    elif fraction < config.memory_fair_fraction or some >= config.psi_some_fair:
        raw = "fair"

    level = prev.memory_level
    if level_index(raw) > level_index(level):
        level = raw
    elif level_index(raw) < level_index(level) and now - prev.memory_since >= config.min_dwell_s:
        level = _step_down(level)
    reason = (
        f"memory: {max(available, 0) / 2**20:.0f} MiB available of {budget / 2**20:.0f} MiB "
        f"({reading.source}), PSI some {some:.1f} % full {full:.1f} %"
    )
    return level, reason
