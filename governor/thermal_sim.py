"""A device in software: one lumped thermal node (the skin), heated by the CPU time this process spends.

docs/governor.md ("The thermal model") describes it with the profiles and what they mean. The model is

    C * dT/dt = P(t) - (T - T_amb) / R
    P(t)      = P_idle + u(t) * P_core * (1 + leak * (T - T_amb))

with u(t) the busy cores of the process (CPU seconds per wall second, clamped to the usable cores).
For a constant u the equation is linear in x = T - T_amb, so each update applies the exact exponential
solution: stable for any step length, which matters when a benchmark runs at time_scale 10.

Leakage (1 %/C by default) raises the steady states: on the phone profile 2 busy cores settle at 68.8 C
and 1 core at 44.6 C (56.2 C and 41.8 C without it); `steady_state_c()` gives the exact value for any load.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    t_amb: float  # C
    r: float  # C/W, skin to ambient
    c: float  # J/C, heat capacity
    p_idle: float  # W
    p_core: float  # W per busy core at T_amb
    t_throttle: float  # C, the device starts slowing the app (headroom 1.0)
    t_critical: float  # C, the device kills the app
    leak: float = 0.01  # leakage growth per C above ambient
    k_throttle: float = 0.25  # slowdown factor growth per C above T_throttle

    @property
    def tau(self) -> float:
        """Time constant without leakage, seconds."""
        return self.r * self.c

    def power_w(self, u: float, t: float) -> float:
        return self.p_idle + u * self.p_core * (1.0 + self.leak * (t - self.t_amb))

    def steady_state_c(self, u: float) -> float:
        """Equilibrium temperature under a constant load u (inf if leakage runs away)."""
        g = 1.0 / self.r - u * self.p_core * self.leak
        if g <= 0:
            return math.inf
        return self.t_amb + (self.p_idle + u * self.p_core) / g

    def sustainable_cores(self, t: float | None = None) -> float:
        """The busy cores that hold the device at `t` (default T_throttle) for good, leakage included: the
        inverse of steady_state_c. This is the thermal envelope's limit: what any governor can spend."""
        t = self.t_throttle if t is None else t
        x = t - self.t_amb
        return max(0.0, (x / self.r - self.p_idle) / (self.p_core * (1.0 + self.leak * x)))

    def slowdown(self, t: float) -> float:
        """Device throttling factor s >= 1: the process gets 1/s of its normal speed."""
        if t < self.t_throttle:
            return 1.0
        return 1.0 + self.k_throttle * (t - self.t_throttle)


PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("phone", t_amb=25, r=12, c=5, p_idle=0.2, p_core=1.2, t_throttle=43, t_critical=48),
        DeviceProfile(
            "phone-heatwave", t_amb=38, r=12, c=5, p_idle=0.2, p_core=1.2, t_throttle=43, t_critical=48
        ),
        DeviceProfile(
            "car-head-unit", t_amb=40, r=6, c=40, p_idle=1.0, p_core=2.5, t_throttle=70, t_critical=80
        ),
        DeviceProfile("desktop", t_amb=25, r=1.5, c=200, p_idle=5, p_core=10, t_throttle=90, t_critical=100),
    )
}


def get_profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown thermal profile {name!r} (known: {known})") from None


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads.

    The same quantity as psutil.Process().cpu_times() user + system, read with nanosecond resolution
    instead of clock ticks: the worker asks for a throttle delay after every forward pass, a few ms apart.
    """
    return time.process_time()


class ThermalSimulator:
    """The simulated device. Thread-safe: the governor polls it, the worker asks for throttle delays.

    `clock` gives wall seconds, `cpu_time_fn` cumulative CPU seconds of the process. Each update turns
    their deltas into the load u and advances simulated time by wall delta * time_scale.
    """

    def __init__(
        self,
        profile: DeviceProfile,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu_time_fn: Callable[[], float] = process_cpu_seconds,
        time_scale: float = 1.0,
        max_cores: float = 1.0,
        start_c: float | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.profile = profile
        self.time_scale = time_scale
        self.max_cores = max(1.0, float(max_cores))
        self._clock = clock
        self._cpu_time_fn = cpu_time_fn
        self._lock = threading.Lock()
        self._temp = profile.t_amb if start_c is None else float(start_c)
        self._peak = self._temp
        self._sim_time = 0.0
        self._load = 0.0
        self._killed = False
        self._kills = 0
        self._last_wall = clock()
        self._last_cpu = cpu_time_fn()

    # -- reading ---------------------------------------------------------------------------------------
    @property
    def temperature_c(self) -> float:
        return self.update()

    @property
    def sim_time(self) -> float:
        """Simulated seconds since the simulator started (the policy's clock when simulating)."""
        with self._lock:
            self._advance_locked()
            return self._sim_time

    @property
    def killed(self) -> bool:
        """True from T >= T_critical until T falls below T_throttle again."""
        with self._lock:
            self._advance_locked()
            return self._killed

    @property
    def cpu_time_fn(self) -> Callable[[], float]:
        """The CPU-seconds counter that heats this device."""
        return self._cpu_time_fn

    @property
    def clock(self) -> Callable[[], float]:
        """The wall clock the device runs on."""
        return self._clock

    @property
    def kills(self) -> int:
        return self._kills

    @property
    def peak_c(self) -> float:
        return self._peak

    @property
    def load(self) -> float:
        """Busy cores measured over the last update."""
        return self._load

    def update(self) -> float:
        """Advance to the clock's now using the CPU time spent since the last update; return T."""
        with self._lock:
            self._advance_locked()
            return self._temp

    def throttle_delay(self, pass_seconds: float) -> float:
        """Seconds the worker must idle after a forward pass of `pass_seconds`: (s - 1) * pass."""
        with self._lock:
            self._advance_locked()
            return (self.profile.slowdown(self._temp) - 1.0) * max(0.0, pass_seconds)

    # -- physics ---------------------------------------------------------------------------------------
    def _advance_locked(self) -> None:
        wall, cpu = self._clock(), self._cpu_time_fn()
        dwall = wall - self._last_wall
        if dwall <= 0:
            return
        u = min(max((cpu - self._last_cpu) / dwall, 0.0), self.max_cores)
        self._last_wall, self._last_cpu = wall, cpu
        self._load = u
        self._step(u, dwall * self.time_scale)

    def _step(self, u: float, dt: float) -> None:
        p = self.profile
        x0 = self._temp - p.t_amb
        drive = p.p_idle + u * p.p_core  # W at ambient
        g = 1.0 / p.r - u * p.p_core * p.leak  # net conductance, W/C
        if abs(g) < 1e-12:
            x = x0 + drive / p.c * dt
        else:
            x_inf = drive / g
            x = x_inf + (x0 - x_inf) * math.exp(-g * dt / p.c)
        self._temp = p.t_amb + x
        self._sim_time += dt
        # Under a constant load T moves monotonically, so checking the end of the step is exact.
        self._peak = max(self._peak, self._temp)
        if self._temp >= p.t_critical and not self._killed:
            self._killed = True
            self._kills += 1
        elif self._killed and self._temp < p.t_throttle:
            self._killed = False
