"""The simulated device and the real governor in one loop on a fake clock: does governing keep it cool?

The scripted load obeys the limits the way the worker will: busy cores = min(threads, cores), paced to the
CPU budget, 0 when paused, and slowed by the device's own throttling (throttle_delay after each pass).
"""

from dataclasses import dataclass

import pytest

from governor.governor import Governor
from governor.limits import Limits, build_ladder
from governor.sensors import SimulatedThermalSource
from tests.governor.fakes import make_sim

LADDER = build_ladder([("m", "q4", 0.014, 1.0, 230_000_000), ("m", "q4-a8", 0.010, 0.95, 200_000_000)])
COST = {r.variant: r.cpu_s_per_token for r in LADDER}


@dataclass
class Run:
    peak_c: float
    kills: int
    seconds_above_throttle: int
    tokens: float
    levels: list[str]
    temps: list[float]


def busy_cores(limits: Limits, cores: int = 2) -> float:
    if limits.pause_running:
        return 0.0
    busy = float(min(limits.threads or cores, cores))
    if limits.tokens_per_second is not None:
        busy = min(busy, limits.tokens_per_second * COST[limits.variant or "q4"])
    elif limits.cpu_budget_cores is not None:  # no ladder: the worker paces with Limits.pace_delay
        busy = min(busy, busy / (1.0 + limits.pace_delay(1.0)))
    return busy


def run(profile: str, *, governed: bool, seconds: int = 600, ladder=LADDER) -> Run:
    sim, load, _ = make_sim(profile, max_cores=2)
    gov = Governor(thermal=SimulatedThermalSource(sim), usable_cpus=2, ladder=ladder, enforce=governed)
    result = Run(sim.temperature_c, 0, 0, 0.0, [], [])
    for _ in range(seconds):
        snap = gov.tick()
        result.levels.append(snap.level)
        result.temps.append(sim.temperature_c)
        busy = 0.0 if gov.device_killed else busy_cores(snap.limits)
        # the device's own throttling: after a pass of 1 s the worker idles throttle_delay(1) s
        busy /= 1.0 + gov.throttle_delay(1.0)
        result.tokens += busy / COST[snap.limits.variant or "q4"]
        load.run(busy, 1.0)
        result.seconds_above_throttle += sim.temperature_c >= sim.profile.t_throttle
    result.peak_c, result.kills = sim.peak_c, sim.kills
    return result


@pytest.mark.parametrize("ladder", [LADDER, ()], ids=["ladder", "no-ladder"])
def test_closed_loop_when_phone_governed_for_10_minutes_then_stays_below_throttle(ladder):
    governed = run("phone", governed=True, ladder=ladder)
    assert governed.kills == 0
    assert governed.peak_c < 43 + 1
    assert governed.seconds_above_throttle == 0
    # it settles near, not far below, T_throttle: the last 5 minutes stay within 5 C of it
    assert min(governed.temps[300:]) > 38.0
    assert "serious" in governed.levels  # it had to pace, not just halve the threads


def test_closed_loop_when_phone_ungoverned_then_same_load_overheats_and_throttles():
    ungoverned = run("phone", governed=False)
    assert ungoverned.peak_c > 43
    assert ungoverned.seconds_above_throttle > 300  # settles throttled, ~46 C
    assert ungoverned.temps[-1] == pytest.approx(46.3, abs=0.5)


@pytest.mark.parametrize("profile", ["phone-heatwave", "car-head-unit"])
def test_closed_loop_when_hot_profiles_governed_then_never_critical(profile):
    governed = run(profile, governed=True)
    ungoverned = run(profile, governed=False)
    t_throttle = {"phone-heatwave": 43, "car-head-unit": 70}[profile]
    assert governed.kills == 0
    assert governed.peak_c < t_throttle + 1
    assert ungoverned.peak_c > t_throttle


def test_closed_loop_when_heatwave_ungoverned_then_the_device_kills_the_app():
    assert run("phone-heatwave", governed=False).kills >= 1
