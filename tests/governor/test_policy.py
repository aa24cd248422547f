import itertools
import math
import random
from dataclasses import replace

import pytest

from governor.policy import (
    LEVELS,
    GovernorState,
    PolicyConfig,
    Readings,
    decide,
    decide_pace,
    forecast_c,
    headroom,
    load_room,
    pace_margin_c,
    sensor_step,
)
from governor.sensors import BatteryReading, MemoryReading, TemperatureReading

CFG = PolicyConfig()  # fair at 37 C, serious at 41.5 C, critical at 43 C for T_throttle 43
GiB = 2**30


def temp(celsius: float, throttle_c: float | None = 43.0) -> Readings:
    return Readings(temperature=TemperatureReading(celsius, "psutil", "fake", throttle_c))


def run(temps: list[float], config: PolicyConfig = CFG, dt: float = 1.0, start: float = 0.0):
    """Feed a temperature series one sample per dt; return every state."""
    state, states = GovernorState(), []
    for i, c in enumerate(temps):
        state = decide(state, temp(c), config, start + i * dt)
        states.append(state)
    return states


def test_headroom_when_at_threshold_then_one_and_30_c_below_then_zero():
    assert headroom(43, 43, 30) == 1.0
    assert headroom(13, 43, 30) == 0.0
    assert headroom(46, 43, 30) == pytest.approx(1.1)


def test_forecast_when_linear_rise_then_extrapolates_slope():
    samples = tuple((float(t), 30 + 0.2 * t) for t in range(30))
    assert forecast_c(samples, 35.8, 10) == pytest.approx(37.8)
    assert forecast_c(((0.0, 30.0),), 30.0, 10) == 30.0


# One steady temperature from a fresh state: where each level starts (escalation needs no dwell).
@pytest.mark.parametrize(
    ("celsius", "level"),
    [
        (20.0, "nominal"),
        (36.9, "nominal"),
        (37.0, "fair"),
        (41.4, "fair"),
        (41.5, "serious"),
        (42.9, "serious"),
        (43.0, "critical"),
        (50.0, "critical"),
    ],
)
def test_decide_when_steady_temperature_then_level_from_headroom(celsius, level):
    state = run([celsius] * 3)[-1]
    assert state.level == level
    assert state.cause == ("none" if level == "nominal" else "thermal")
    assert state.headroom == pytest.approx(1 - (43 - celsius) / 30)


def test_decide_when_throttle_threshold_from_config_then_it_overrides_the_sensor():
    cfg = PolicyConfig(throttle_c=60.0)
    assert run([50.0] * 3, cfg)[-1].level == "nominal"  # 10 C below 60: headroom 0.67
    no_trip = GovernorState()
    no_trip = decide(no_trip, temp(84.0, throttle_c=None), CFG, 0.0)
    assert no_trip.throttle_c == 85.0 and no_trip.level == "serious"


def test_decide_when_temperature_rises_fast_then_forecast_escalates_before_the_threshold():
    # 0.5 C/s: at 34 C the forecast is 39 C -> fair while the headroom now is only 0.70.
    states = run([29 + 0.5 * t for t in range(11)])
    last = states[-1]
    assert last.temperature_c == 34.0
    assert last.headroom == pytest.approx(0.70)
    assert last.forecast_headroom == pytest.approx(0.8667, abs=1e-3)
    assert last.level == "fair"
    assert "forecast 0.87" in last.reason and last.reason.startswith("thermal: 34.0 C")


def test_decide_when_jump_then_escalates_at_once_skipping_levels():
    states = run([30.0] * 20 + [44.0])
    assert states[-2].level == "nominal"
    assert states[-1].level == "critical"
    assert [(t.old, t.new) for t in states[-1].transitions] == [("nominal", "critical")]


def test_decide_when_cooling_then_steps_down_one_level_at_a_time_after_dwell():
    hot = run([44.0] * 5)[-1]
    assert hot.level == "critical"
    state, levels = hot, []
    for i in range(60):
        state = decide(state, temp(20.0), CFG, 5 + i)
        levels.append(state.level)
    # each level is held for min_dwell_s, and no level is skipped on the way down
    changes = [t for t in state.transitions if t.time >= 5]
    assert [(t.old, t.new) for t in changes] == [
        ("critical", "serious"),
        ("serious", "fair"),
        ("fair", "nominal"),
    ]
    gaps = [b.time - a.time for a, b in itertools.pairwise(changes)]
    assert all(g >= CFG.min_dwell_s for g in gaps)
    assert levels[-1] == "nominal"


@pytest.mark.parametrize(
    ("celsius", "stays"),
    [
        (41.1, True),  # below critical's 43 but not 2 C below it
        (40.9, False),  # more than hysteresis_c below the entry threshold: step down
    ],
)
def test_decide_when_slightly_below_entry_then_hysteresis_holds_the_level(celsius, stays):
    state = run([43.5] * 3)[-1]
    for i in range(40):  # well past the dwell, temperature flat so the forecast agrees
        state = decide(state, temp(celsius), CFG, 3 + i)
    assert (state.level == "critical") == stays


def sawtooth(low: float, high: float, period: int, noise: float, seconds: int = 600) -> list[float]:
    rng = random.Random(7)
    return [low + (high - low) * ((t % period) / period) + rng.uniform(-noise, noise) for t in range(seconds)]


def transitions(temps: list[float], config: PolicyConfig) -> int:
    return len(run(temps, replace(config, max_transitions=10_000))[-1].transitions)


NAIVE = PolicyConfig(hysteresis_c=0.0, min_dwell_s=0.0)


def test_decide_when_noisy_sawtooth_inside_the_hysteresis_band_then_no_flapping():
    # 42..44 C around the critical threshold (43) with +-0.5 C noise: the naive policy flaps on every
    # crossing; hysteresis (leave critical only below 41 C) holds critical after entering it once.
    temps = sawtooth(42.0, 44.0, period=8, noise=0.5)
    assert transitions(temps, NAIVE) > 100
    governed = run(temps)
    assert len(governed[-1].transitions) <= 2
    assert all(s.level == "critical" for s in governed[10:])


def test_decide_when_noisy_sawtooth_wider_than_the_band_then_at_most_two_changes_per_period():
    # 39..44 C, 30 s period, +-0.7 C noise: a real swing, so the level may follow it, but noise must not
    # add changes: at most up once and down once per period, and never faster than the dwell on the way down.
    period = 30
    temps = sawtooth(39.0, 44.0, period=period, noise=0.7)
    governed = run(temps, replace(CFG, max_transitions=10_000))[-1].transitions
    assert transitions(temps, NAIVE) > 3 * len(governed)
    # (+1: the first rise, before the forecast has forecast_min_span_s of samples, may pass through serious)
    assert len(governed) <= 2 * len(temps) // period + 1
    downs = [t for t in governed if LEVELS.index(t.new) < LEVELS.index(t.old)]
    entered = {t.time: t for t in governed}
    for down in downs:
        previous = max(t for t in entered if t < down.time)
        assert down.time - previous >= CFG.min_dwell_s


def test_decide_when_transitions_exceed_bound_then_only_recent_kept():
    cfg = PolicyConfig(hysteresis_c=0.0, min_dwell_s=0.0, max_transitions=5)
    states = run([30.0, 44.0] * 20, cfg)
    transitions = states[-1].transitions
    assert len(transitions) == 5
    assert transitions[-1].time == 39.0


def test_decide_when_samples_older_than_history_then_dropped():
    state = run([30.0] * 100)[-1]
    assert len(state.samples) == 30
    assert state.samples[0][0] == 70.0


def test_decide_when_no_temperature_then_nominal_and_no_pressure():
    state = decide(GovernorState(), Readings(), CFG, 0.0)
    assert (state.level, state.cause, state.reason) == ("nominal", "none", "no pressure")
    assert state.temperature_c is None and state.headroom is None


def mem(available_gib: float, limit_gib: float = 4.0, some: float = 0.0, full: float = 0.0) -> MemoryReading:
    return MemoryReading(
        limit_bytes=int(limit_gib * GiB),
        used_bytes=int((limit_gib - available_gib) * GiB),
        available_bytes=int(available_gib * GiB),
        source="cgroup-v2",
        psi_some_avg10=some,
        psi_full_avg10=full,
        rss_bytes=GiB // 2,
    )


@pytest.mark.parametrize(
    ("reading", "level"),
    [
        (mem(2.0), "nominal"),
        (mem(0.7), "fair"),  # 17.5 % of the limit available
        (mem(0.3), "serious"),  # 7.5 %
        (mem(0.1), "critical"),  # 2.5 %
        (mem(3.0, some=15.0), "fair"),
        (mem(3.0, full=8.0), "serious"),
        (mem(3.0, full=25.0), "critical"),
    ],
)
def test_decide_when_memory_pressure_then_level_and_cause_memory(reading, level):
    state = decide(GovernorState(), Readings(memory=reading), CFG, 0.0)
    assert state.level == level
    if level != "nominal":
        assert state.cause == "memory" and state.reason.startswith("memory: ")


def test_decide_when_memory_budget_configured_then_rss_counts_against_it():
    cfg = PolicyConfig(memory_budget_bytes=GiB)  # rss is 0.5 GiB: 50 % of the budget left
    assert decide(GovernorState(), Readings(memory=mem(3.0)), cfg, 0.0).level == "nominal"
    tight = PolicyConfig(memory_budget_bytes=int(0.55 * GiB))  # 0.05 GiB left of 0.55: 9 %
    assert decide(GovernorState(), Readings(memory=mem(3.0)), tight, 0.0).level == "serious"


def test_decide_when_memory_recovers_then_dwell_before_stepping_down():
    state = decide(GovernorState(), Readings(memory=mem(0.1)), CFG, 0.0)
    state = decide(state, Readings(memory=mem(3.0)), CFG, 5.0)
    assert state.level == "critical"
    state = decide(state, Readings(memory=mem(3.0)), CFG, 10.0)
    assert state.level == "serious"


@pytest.mark.parametrize(
    ("battery", "level"),
    [
        (None, "nominal"),
        (BatteryReading(15.0, plugged=False), "fair"),
        (BatteryReading(20.0, plugged=False), "fair"),
        (BatteryReading(21.0, plugged=False), "nominal"),
        (BatteryReading(5.0, plugged=True), "nominal"),
        (BatteryReading(5.0, plugged=None), "nominal"),
    ],
)
def test_decide_when_battery_then_low_and_unplugged_is_at_least_fair(battery, level):
    state = decide(GovernorState(), Readings(battery=battery), CFG, 0.0)
    assert state.level == level
    assert state.cause == ("battery" if level == "fair" else "none")


@pytest.mark.parametrize(("action", "level"), [("pause", "critical"), ("low_priority", "serious")])
def test_decide_when_background_then_lifecycle_sets_the_floor(action, level):
    cfg = PolicyConfig(background_action=action)
    state = decide(GovernorState(), Readings(lifecycle="background"), cfg, 0.0)
    assert (state.level, state.cause) == (level, "lifecycle")
    back = decide(state, Readings(lifecycle="foreground"), cfg, 1.0)
    assert back.level == "nominal"  # returning to the foreground resumes at once, no dwell


def test_decide_when_several_inputs_then_worst_wins_and_names_its_cause():
    readings = Readings(
        temperature=TemperatureReading(38.0, "psutil", "fake", 43.0),  # fair
        memory=mem(0.3),  # serious
        battery=BatteryReading(10.0, plugged=False),  # fair
    )
    state = decide(GovernorState(), readings, CFG, 0.0)
    assert (state.level, state.cause) == ("serious", "memory")
    tie = Readings(temperature=readings.temperature, battery=readings.battery)
    assert decide(GovernorState(), tie, CFG, 0.0).cause == "thermal"


def test_decide_is_pure_when_called_twice_then_same_result_and_prev_untouched():
    prev = run([30.0, 31.0, 33.0])[-1]
    before = (prev.level, prev.samples, prev.transitions)
    a = decide(prev, temp(40.0), CFG, 3.0)
    b = decide(prev, temp(40.0), CFG, 3.0)
    assert a == b
    assert (prev.level, prev.samples, prev.transitions) == before


def test_policy_config_when_thresholds_unordered_then_value_error():
    with pytest.raises(ValueError):
        PolicyConfig(fair_headroom=0.99, serious_headroom=0.9)
    with pytest.raises(ValueError):
        PolicyConfig(background_action="sleep")  # type: ignore[arg-type]


def test_levels_are_ordered_mildest_first():
    assert LEVELS == ("nominal", "fair", "serious", "critical")
    assert math.isinf(GovernorState().since)


# -- the pace controller (decide_pace) ---------------------------------------------------------------------
# the law with a fixed margin of 0.6 C: setpoint 0.98 (42.4 C for T_throttle 43), kp 12, ki 0.15/s
PACE = PolicyConfig(pace_max_cores=2.0, pace_margin_c=0.6)


def at(celsius: float) -> GovernorState:
    """A state whose headroom now is that of `celsius` (T_throttle 43, span 30)."""
    return GovernorState(headroom=headroom(celsius, 43, 30))


def pace_run(temps: list[float], config: PolicyConfig = PACE, dt: float = 1.0) -> list[GovernorState]:
    state, states = GovernorState(), []
    for i, c in enumerate(temps):
        state = decide(state, temp(c), config, i * dt)
        states.append(state)
    return states


@pytest.mark.parametrize(
    ("celsius", "cores"),
    [
        (30.0, 2.0),  # far below the setpoint: every core (clamped at pace_max_cores)
        (42.0, 12 * (0.98 - headroom(42.0, 43, 30))),  # 0.4 C below it: kp * e = 0.16 core
        (42.4, 0.05),  # at the setpoint with no integral yet: the floor
        (45.0, 0.05),  # above: the floor, never 0 (a pause is the emergency's, not the controller's)
    ],
)
def test_decide_pace_when_first_reading_then_proportional_term_clamped(celsius, cores):
    state = decide_pace(at(celsius), PACE, 0.0)
    assert state.pace_cores == pytest.approx(cores)
    assert state.pace_integral == 0.0  # dt = 0 on the first reading
    assert state.pace_time == 0.0


def test_decide_pace_when_inside_bounds_then_integral_grows_by_ki_e_dt():
    prev = replace(at(42.0), pace_integral=0.3, pace_time=10.0)
    e = 0.98 - headroom(42.0, 43, 30)
    state = decide_pace(prev, PACE, 12.0)
    assert state.pace_integral == pytest.approx(0.3 + 0.15 * e * 2.0)
    assert state.pace_cores == pytest.approx(12 * e + state.pace_integral)


def test_decide_pace_when_poll_late_then_integrates_at_most_pace_max_dt_s():
    prev = replace(at(42.0), pace_integral=0.3, pace_time=0.0)
    e = 0.98 - headroom(42.0, 43, 30)
    assert decide_pace(prev, PACE, 600.0).pace_integral == pytest.approx(0.3 + 0.15 * e * 5.0)


@pytest.mark.parametrize(
    ("celsius", "integral", "moves"),
    [
        (30.0, 0.5, False),  # saturated high and still cold: no credit stored (anti-windup)
        (44.0, 1.9, True),  # saturated high but too hot: the integral comes down at once
        (46.0, 0.0, False),  # saturated low and hot: no debt below 0
        (42.3, 0.0, True),  # at the floor and just cool enough: the integral climbs out
    ],
)
def test_decide_pace_when_saturated_then_integrates_only_back_into_bounds(celsius, integral, moves):
    prev = replace(at(celsius), pace_integral=integral, pace_time=0.0)
    state = decide_pace(prev, PACE, 1.0)
    assert (state.pace_integral != integral) == moves
    assert 0.0 <= state.pace_integral <= 2.0
    assert 0.05 <= state.pace_cores <= 2.0


def test_decide_pace_when_steady_at_setpoint_then_output_is_the_integral():
    prev = replace(at(42.4), pace_integral=0.89, pace_time=0.0)
    state = decide_pace(prev, PACE, 1.0)
    assert state.pace_cores == pytest.approx(0.89, abs=1e-9)
    assert state.pace_integral == pytest.approx(0.89, abs=1e-9)


@pytest.mark.parametrize(
    ("step_c", "before_c", "now_c", "expected"),
    [
        (None, None, 42.0, None),  # the first reading: nothing to compare
        (None, 42.0, 42.0, None),  # no change: nothing learned
        (None, 42.0, 43.0, 1.0),  # the first change
        (1.0, 43.0, 42.0, 1.0),  # a whole-degree sensor never shows less
        (1.0, 42.0, 42.13, 0.13),  # a finer change: it was no whole-degree sensor
        (0.13, 42.13, 42.1305, 0.13),  # under a millidegree: float rounding, not a step
        (0.13, 42.0, 44.0, 0.13),  # a jump (a late poll) never makes the sensor coarser
    ],
)
def test_sensor_step_is_the_smallest_change_between_readings(step_c, before_c, now_c, expected):
    assert sensor_step(step_c, before_c, now_c) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("step_c", "margin_c"),
    [
        (None, 0.1),  # nothing seen yet: a fine sensor's margin
        (0.01, 0.1),  # a fine sensor (or the simulator): pace_margin_c
        (0.5, 0.3),  # half-degree steps: 0.6 steps
        (1.0, 0.6),  # whole degrees: 0.6 C, the margin tested with whole-degree readings
        (3.0, 0.6),  # no sensor needs more than pace_margin_max_c
    ],
)
def test_pace_margin_follows_the_sensors_resolution(step_c, margin_c):
    assert pace_margin_c(GovernorState(sensor_step_c=step_c), PolicyConfig()) == pytest.approx(margin_c)


def test_decide_when_readings_step_then_the_setpoint_follows_the_sensor():
    fine = pace_run([42.85, 42.86, 42.9], config=PolicyConfig(pace_max_cores=2.0))
    coarse = pace_run([42.0, 43.0, 42.0], config=PolicyConfig(pace_max_cores=2.0))
    assert fine[-1].sensor_step_c == pytest.approx(0.01) and coarse[-1].sensor_step_c == pytest.approx(1.0)
    # at 42.9 C the fine sensor's pace is at its setpoint (the floor, no integral yet); 42.0 C on the
    # coarse one is 0.4 C below its 42.4 C setpoint
    assert fine[-1].pace_cores == pytest.approx(0.05)
    assert coarse[-1].pace_cores == pytest.approx(12 * 0.4 / 30 + coarse[-1].pace_integral)


def test_decide_pace_when_no_reading_or_control_off_then_no_budget_and_integral_reset():
    prev = replace(at(42.0), pace_integral=0.7, pace_time=0.0, pace_cores=0.8)
    off = decide_pace(prev, replace(PACE, pace_control=False), 1.0)
    assert (off.pace_cores, off.pace_integral, off.pace_time) == (None, 0.0, None)
    gone = decide(prev, Readings(), PACE, 1.0)  # the sensor went away
    assert (gone.pace_cores, gone.pace_integral) == (None, 0.0)


def test_decide_when_warming_then_budget_falls_as_the_setpoint_nears():
    # 1 C per 10 s from 36 to 42.4 C: the budget is all the cores while far, then shrinks every poll
    temps = [36 + 0.1 * t for t in range(65)]
    budgets = [s.pace_cores for s in pace_run(temps)]
    assert budgets[0] == 2.0
    assert all(b1 <= b0 + 1e-9 for b0, b1 in itertools.pairwise(budgets))
    assert budgets[-1] < 0.8


def test_decide_when_pace_control_then_no_transition_from_pace_alone_and_pure():
    states = pace_run([42.0] * 30)
    assert {s.level for s in states} == {"serious"}
    a = decide(states[-1], temp(42.5), PACE, 30.0)
    b = decide(states[-1], temp(42.5), PACE, 30.0)
    assert a == b and a.pace_cores < states[-1].pace_cores


# -- critical is the emergency ------------------------------------------------------------------------------
def temp_crit(celsius: float, critical_c: float | None = 48.0) -> Readings:
    return Readings(temperature=TemperatureReading(celsius, "psutil", "fake", 43.0, critical_c))


@pytest.mark.parametrize(
    ("celsius", "critical_c", "pace_control", "level"),
    [
        (43.0, 48.0, True, "serious"),  # T_throttle: the device throttles, the pace answers; no pause
        (46.9, 48.0, True, "serious"),
        (47.0, 48.0, True, "critical"),  # within emergency_margin_c (1 C) of T_critical: pause
        (43.0, None, True, "critical"),  # no T_critical known: the throttling point is the emergency
        (43.0, 48.0, False, "critical"),  # the level machine: critical at headroom 1.0
        (44.0, 43.5, True, "critical"),  # T_critical barely above T_throttle: never later than headroom 1
    ],
)
def test_decide_when_steady_hot_then_critical_only_near_t_critical(celsius, critical_c, pace_control, level):
    cfg = replace(CFG, pace_control=pace_control)
    state = GovernorState()
    for i in range(3):
        state = decide(state, temp_crit(celsius, critical_c), cfg, float(i))
    assert state.level == level


def test_decide_when_forecast_crosses_t_critical_then_critical_before_it_is_reached():
    # 0.3 C/s from 42 C: at 44.7 C the forecast (10 s) is 47.7 C, within 1 C of T_critical
    temps = [42 + 0.3 * t for t in range(10)]
    state = GovernorState()
    for i, c in enumerate(temps):
        state = decide(state, temp_crit(c), CFG, float(i))
    assert state.level == "critical" and state.temperature_c < 45.0
    assert state.critical_headroom == pytest.approx(headroom(47.0, 43, 30))


def test_decide_when_emergency_passes_then_leaves_critical_below_its_entry_minus_hysteresis():
    state = GovernorState()
    for i in range(3):
        state = decide(state, temp_crit(47.5), CFG, float(i))
    assert state.level == "critical"
    for i, c in enumerate([45.5] * 20 + [44.9] * 20):  # 47 - 2 = 45: held above it, left below it
        state = decide(state, temp_crit(c), CFG, 3.0 + i)
        if i == 19:
            assert state.level == "critical"
    assert state.level == "serious"


@pytest.mark.parametrize(
    ("celsius", "busy", "moves"),
    [
        (42.0, 0.1, False),  # room to spare but the budget (1.0) is not in use: no credit
        (42.0, 0.8, True),  # in use (>= 0.75 of it): integrates up
        (42.0, None, True),  # no load reading: as before
        (42.8, 0.0, True),  # too hot: always integrates down, in use or not
    ],
)
def test_decide_pace_when_budget_unused_then_integrates_up_only_while_in_use(celsius, busy, moves):
    prev = replace(at(celsius), pace_integral=0.8, pace_time=0.0, pace_cores=1.0)
    state = decide_pace(prev, PACE, 1.0, busy)
    assert (state.pace_integral != 0.8) == moves


@pytest.mark.parametrize(
    ("celsius", "busy", "loading", "moves"),
    [
        (42.0, 1.0, False, True),  # room to spare, the budget in use: credit
        (42.0, 1.0, True, False),  # the same CPU is a model loading: no credit
        (42.0, None, True, False),  # no load reading, loading: no credit either
        (42.8, 1.0, False, True),  # too hot: debt
        (42.8, 1.0, True, False),  # too hot because of a load the budget does not govern: no debt
    ],
)
def test_decide_pace_when_loading_then_the_integral_holds_both_ways(celsius, busy, loading, moves):
    prev = replace(at(celsius), pace_integral=0.8, pace_time=0.0, pace_cores=1.0)
    state = decide_pace(prev, PACE, 1.0, busy, loading)
    assert (state.pace_integral != 0.8) == moves
    e = 0.98 - headroom(celsius, 43, 30)
    assert state.pace_cores == pytest.approx(12 * e + state.pace_integral)  # P still answers the heat
    assert state.pace_time == 1.0


def test_decide_pace_when_a_load_ends_then_only_the_time_after_it_integrates():
    # a 30 s load, polled every second, then one poll of paced work: one second of credit, not 31
    state = replace(at(42.0), pace_integral=0.8, pace_time=0.0, pace_cores=1.0)
    for t in range(1, 31):
        state = decide_pace(state, PACE, float(t), 1.0, loading=True)
    assert state.pace_integral == 0.8
    state = decide_pace(state, PACE, 31.0, 1.0)
    assert state.pace_integral == pytest.approx(0.8 + 0.15 * (0.98 - headroom(42.0, 43, 30)) * 1.0)


# -- load_room: what the device can take of a model load --------------------------------------------------
def hot(h, fc=None, memory="nominal", critical_h=1.1333):  # critical (the emergency) at 47 C, T_throttle 43 C
    return GovernorState(headroom=h, forecast_headroom=fc, critical_headroom=critical_h, memory_level=memory)


@pytest.mark.parametrize(
    ("state", "below", "room_c"),
    [
        (GovernorState(), None, None),  # no temperature reading
        (hot(0.8333, 0.8333), True, 9.0),  # 38 C: 9 C below the emergency
        (hot(0.97, 0.99), True, 4.3),  # below T_throttle now and ahead: the hotter one counts
        (hot(1.0, 0.9), False, 4.0),  # at T_throttle now
        (hot(0.97, 1.02), False, 3.4),  # heading past it
        (hot(1.1), False, 1.0),  # too few samples for a forecast: now decides
        (hot(1.1, 1.1, "fair"), False, 1.0),
        (hot(1.1, 1.1, "serious"), None, None),  # memory first: a smaller model is what frees it
        (hot(1.1, 1.1, "critical"), None, None),
    ],
)
def test_load_room_when_state_then_the_rule_table_says(state, below, room_c):
    room = load_room(state, CFG)
    if below is None:
        assert room is None
    else:
        assert (
            room is not None
            and room.below_throttle is below
            and room.room_c == pytest.approx(room_c, abs=0.01)
        )


def test_load_room_when_decided_from_readings_then_it_follows_the_temperature_and_the_critical_point():
    hot_state = decide(GovernorState(), temp_critical(44.0), CFG, 0.0)
    cool_state = decide(GovernorState(), temp_critical(42.0), CFG, 0.0)
    hot_room, cool_room = load_room(hot_state, CFG), load_room(cool_state, CFG)
    assert hot_room is not None and not hot_room.below_throttle and hot_room.room_c == pytest.approx(3.0)
    assert cool_room is not None and cool_room.below_throttle and cool_room.room_c == pytest.approx(5.0)
    lower = load_room(cool_state, replace(CFG, load_headroom=0.95))  # 42 C is headroom 0.967
    assert lower is not None and not lower.below_throttle


def temp_critical(celsius: float) -> Readings:
    return Readings(temperature=TemperatureReading(celsius, "psutil", "fake", 43.0, 48.0))


# The hysteresis is load_hysteresis_c (0.3 C) or half the pace's margin, the smaller: a fine sensor's pace
# holds 0.1 C below T_throttle, so a waiting load needs 0.05 C; a whole-degree sensor's holds 0.6 C below.
@pytest.mark.parametrize(
    ("celsius", "step_c", "waiting", "below"),
    [
        (42.9, None, False, True),
        (42.96, None, True, False),  # within half the fine sensor's margin of T_throttle
        (42.9, None, True, True),  # at the paced setpoint: a waiting load gets its turn
        (42.9, 1.0, False, True),
        (42.9, 1.0, True, False),  # a coarse sensor: the full 0.3 C
        (42.6, 1.0, True, True),
    ],
)
def test_load_room_when_a_load_waits_already_then_it_needs_the_hysteresis_below_t_throttle(
    celsius, step_c, waiting, below
):
    state = replace(decide(GovernorState(), temp_critical(celsius), CFG, 0.0), sensor_step_c=step_c)
    room = load_room(state, CFG, waiting)
    assert room is not None and room.below_throttle is below
