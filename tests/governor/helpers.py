"""A governor on fakes (sensor and clock) with a two-rung ladder."""

from governor.governor import Governor
from governor.limits import build_ladder
from tests.governor.fakes import FakeClock, FakeSensor

LADDER = build_ladder([("m", "q4", 0.014, 1.0, 230_000_000), ("m", "q4-a8", 0.010, 0.95, 200_000_000)])


def make_governor(sensor=None, clock=None, **kw) -> tuple[Governor, FakeSensor, FakeClock]:
    clock = clock or FakeClock()
    sensor = sensor or FakeSensor(30.0)
    gov = Governor(thermal=sensor, clock=clock, usable_cpus=2, **{"ladder": LADDER, **kw})
    return gov, sensor, clock
