"""Fakes that plug into the governor's real seams: a clock, a CPU-time counter, a thermal source."""

from __future__ import annotations

from governor.sensors import TemperatureReading
from governor.thermal_sim import ThermalSimulator


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScriptedLoad:
    """A CPU-time counter (cpu_time_fn) driven by a scripted number of busy cores."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.cpu_seconds = 0.0

    def __call__(self) -> float:
        return self.cpu_seconds

    def run(self, busy_cores: float, seconds: float) -> None:
        """Spend `busy_cores` cores for `seconds` of wall time."""
        self.cpu_seconds += busy_cores * seconds
        self.clock.advance(seconds)


def make_sim(profile_name: str = "phone", *, max_cores: float = 2, time_scale: float = 1.0, **kw):
    from governor.thermal_sim import get_profile

    clock = FakeClock()
    load = ScriptedLoad(clock)
    sim = ThermalSimulator(
        get_profile(profile_name),
        clock=clock,
        cpu_time_fn=load,
        max_cores=max_cores,
        time_scale=time_scale,
        **kw,
    )
    return sim, load, clock


class FakeSensor:
    """A thermal source whose temperature a test sets."""

    source = "psutil"
    simulator = None

    def __init__(
        self, celsius: float | None = 30.0, throttle_c: float | None = 43.0, critical_c: float | None = None
    ) -> None:
        self.celsius = celsius
        self.throttle_c = throttle_c
        self.critical_c = critical_c

    def read(self) -> TemperatureReading | None:
        if self.celsius is None:
            return None
        return TemperatureReading(self.celsius, self.source, "fake", self.throttle_c, self.critical_c)
