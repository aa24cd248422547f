import math
from dataclasses import replace

import pytest

from governor.thermal_sim import PROFILES, ThermalSimulator, get_profile
from tests.governor.fakes import FakeClock, ScriptedLoad, make_sim

PHONE = PROFILES["phone"]


@pytest.mark.parametrize(
    ("name", "t_amb", "r", "c", "tau", "p_idle", "p_core", "t_throttle", "t_critical"),
    [
        ("phone", 25, 12, 5, 60, 0.2, 1.2, 43, 48),
        ("phone-heatwave", 38, 12, 5, 60, 0.2, 1.2, 43, 48),
        ("car-head-unit", 40, 6, 40, 240, 1.0, 2.5, 70, 80),
        ("desktop", 25, 1.5, 200, 300, 5, 10, 90, 100),
    ],
)
def test_profiles_when_looked_up_then_match_the_design_table(
    name, t_amb, r, c, tau, p_idle, p_core, t_throttle, t_critical
):
    p = get_profile(name)
    assert (p.t_amb, p.r, p.c, p.p_idle, p.p_core, p.t_throttle, p.t_critical) == (
        t_amb,
        r,
        c,
        p_idle,
        p_core,
        t_throttle,
        t_critical,
    )
    assert p.tau == pytest.approx(tau)
    assert (p.leak, p.k_throttle) == (0.01, 0.25)


def test_get_profile_when_unknown_then_value_error_lists_profiles():
    with pytest.raises(ValueError, match="phone-heatwave"):
        get_profile("toaster")


def test_power_when_two_cores_busy_at_ambient_then_about_2_6_watts():
    assert PHONE.power_w(2, PHONE.t_amb) == pytest.approx(2.6)
    assert PHONE.power_w(1, PHONE.t_amb) == pytest.approx(1.4)


def test_steady_state_when_no_leakage_then_worked_example_56_and_42_c():
    no_leak = replace(PHONE, leak=0.0)
    sim, load, _ = make_sim(max_cores=2)
    sim.profile = no_leak
    load.run(2, 3600)  # 60 tau
    assert sim.temperature_c == pytest.approx(56.2, abs=0.01)
    assert no_leak.steady_state_c(1) == pytest.approx(41.8)


@pytest.mark.parametrize(
    ("name", "cores"), [("phone", 0.918), ("phone-heatwave", 0.172), ("car-head-unit", 1.231)]
)
def test_sustainable_cores_when_at_t_throttle_then_inverse_of_the_steady_state(name, cores):
    p = get_profile(name)
    assert p.sustainable_cores() == pytest.approx(cores, abs=5e-4)
    assert p.steady_state_c(p.sustainable_cores()) == pytest.approx(p.t_throttle)
    assert p.steady_state_c(p.sustainable_cores(p.t_throttle - 1)) == pytest.approx(p.t_throttle - 1)
    assert p.sustainable_cores(p.t_amb) == 0.0  # idle power alone warms it above ambient


def test_steady_state_when_leaking_then_matches_closed_form():
    # x = R (P_idle + u P_core) / (1 - R u P_core leak)
    expected = 25 + 12 * (0.2 + 2 * 1.2) / (1 - 12 * 2 * 1.2 * 0.01)
    sim, load, _ = make_sim(max_cores=2)
    load.run(2, 3600)
    assert sim.temperature_c == pytest.approx(expected, abs=0.01)
    assert PHONE.steady_state_c(2) == pytest.approx(expected)


def test_time_constant_when_one_tau_elapsed_then_63_percent_of_the_rise():
    sim, load, _ = make_sim(max_cores=2)
    sim.profile = replace(PHONE, leak=0.0)
    load.run(2, 60)  # tau = R*C = 60 s
    rise = sim.temperature_c - 25
    assert rise / (56.2 - 25) == pytest.approx(1 - math.exp(-1), abs=0.001)


def test_integration_when_one_big_step_or_many_small_then_same_temperature():
    big, big_load, _ = make_sim()
    small, small_load, _ = make_sim()
    big_load.run(1.5, 90)
    for _ in range(900):
        small_load.run(1.5, 0.1)
    assert big.temperature_c == pytest.approx(small.temperature_c, abs=1e-9)


def test_phone_when_two_cores_from_cold_then_reaches_throttle_within_about_50_s():
    sim, load, _ = make_sim(max_cores=2)
    seconds = 0
    while sim.temperature_c < PHONE.t_throttle:
        load.run(2, 1)
        seconds += 1
    assert 35 <= seconds <= 52  # 52 s without leakage; leakage makes it a little faster


def test_load_when_more_cpu_than_cores_then_clamped_to_usable_cores():
    sim, load, _ = make_sim(max_cores=2)
    load.run(8, 10)
    assert sim.update() > 25
    assert sim.load == pytest.approx(2.0)


def test_time_scale_when_10_then_one_wall_second_is_ten_device_seconds():
    fast, fast_load, _ = make_sim(time_scale=10)
    slow, slow_load, _ = make_sim()
    fast_load.run(2, 6)
    slow_load.run(2, 60)
    assert fast.temperature_c == pytest.approx(slow.temperature_c)
    assert fast.sim_time == pytest.approx(60)


@pytest.mark.parametrize(
    ("start_c", "pass_s", "expected"),
    [
        (40.0, 0.1, 0.0),  # below T_throttle: no slowdown
        (43.0, 0.1, 0.0),  # s = 1 at the threshold
        (45.0, 0.1, 0.05),  # s = 1 + 0.25 * 2 = 1.5 -> idle half the pass
        (47.0, 0.2, 0.2),  # s = 2
    ],
)
def test_throttle_delay_when_hot_then_idle_s_minus_one_times_the_pass(start_c, pass_s, expected):
    sim, _, _ = make_sim(start_c=start_c)
    assert sim.throttle_delay(pass_s) == pytest.approx(expected)


def test_killed_when_critical_then_flag_set_until_below_throttle():
    sim, load, _ = make_sim(start_c=47.5)
    assert not sim.killed
    load.run(2, 5)
    assert sim.temperature_c >= PHONE.t_critical
    assert sim.killed and sim.kills == 1
    # cooling: still killed between T_throttle and T_critical
    while sim.temperature_c >= 44:
        load.run(0, 1)
    assert sim.killed
    while sim.temperature_c >= PHONE.t_throttle:
        load.run(0, 1)
    assert not sim.killed
    assert sim.peak_c >= PHONE.t_critical


def test_simulator_when_driven_by_wall_clock_cpu_then_idle_process_stays_cool():
    clock = FakeClock()
    load = ScriptedLoad(clock)
    sim = ThermalSimulator(PHONE, clock=clock, cpu_time_fn=load, max_cores=2)
    clock.advance(600)  # no CPU spent
    assert sim.temperature_c == pytest.approx(25 + 12 * 0.2, abs=0.01)
