"""What the governor can see: temperature, memory, battery, CPUs. Every sensor is optional.

A missing or unreadable sensor gives None, never an exception: most machines that run simmer (VMs,
containers, CI) have no temperature sensor and no battery. Filesystem roots (sysfs, cgroup, proc) are
parameters so tests read fixture trees.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from governor.cgroup import read_cgroup_memory, usable_cpus
from governor.sysfiles import read_int, read_text
from governor.thermal_sim import ThermalSimulator, get_profile, process_cpu_seconds


# -- readings ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TemperatureReading:
    celsius: float
    source: str  # "psutil" | "sysfs" | "file" | "simulated"
    sensor: str  # which sensor: psutil "name/label", a thermal zone type, a path, "sim:phone"
    throttle_c: float | None = None  # where the device starts throttling (trip point / "high"), if known
    critical_c: float | None = None


@dataclass(frozen=True)
class MemoryReading:
    limit_bytes: int  # effective: the smallest of the cgroup limits and the host's RAM
    used_bytes: int
    available_bytes: int
    source: str  # "cgroup-v2" | "cgroup-v1" | "host": where the effective limit comes from
    psi_some_avg10: float | None = None
    psi_full_avg10: float | None = None
    rss_bytes: int | None = None


@dataclass(frozen=True)
class BatteryReading:
    percent: float
    plugged: bool | None  # None: the OS does not say


# -- temperature ---------------------------------------------------------------------------------------
class ThermalSource(Protocol):
    # Read-only members: a source may declare them as plain attributes of narrower types (None, a simulator).
    @property
    def source(self) -> str: ...  # what readings say: "psutil" | "sysfs" | "file" | "simulated" | "none"

    @property
    def simulator(self) -> ThermalSimulator | None: ...

    def read(self) -> TemperatureReading | None: ...


# Sensors a default choice may govern on: CPU package/cores and phone skin sensors. Matched as whole
# words of the psutil name/label or the zone type, case-insensitively; pick a sensor by name to override.
# Not "core": Intel's per-core sensors are named by "coretemp" already, and on phones the word names other
# blocks' cores (Qualcomm's modem zone is `mdm-core-usr`, often the hottest zone of all).
_CPU_OR_SKIN_WORDS = frozenset(
    {"cpu", "package", "pkg", "soc", "skin", "tctl", "tdie", "coretemp", "k10temp", "zenpower"}
)


def _is_cpu_or_skin(*names: str) -> bool:
    words: set[str] = set()
    for name in names:
        lowered = name.lower()
        words.add(lowered)
        words.update(re.split(r"[^a-z0-9]+", lowered))
    return bool(words & _CPU_OR_SKIN_WORDS)


class PsutilThermalSource:
    source = "psutil"
    simulator = None

    def __init__(
        self,
        sensor_name: str | None = None,
        temps_fn: Callable[[], dict[str, list[Any]]] | None = None,
    ) -> None:
        self.sensor_name = sensor_name
        self._temps_fn = temps_fn or _psutil_temperatures

    def read(self) -> TemperatureReading | None:
        try:
            temps = self._temps_fn() or {}
        except Exception:  # psutil raises assorted errors on odd platforms; a sensor is optional
            return None
        candidates: list[TemperatureReading] = []
        preferred: list[TemperatureReading] = []
        for name, entries in temps.items():
            for entry in entries:
                current = getattr(entry, "current", None)
                if current is None or not math.isfinite(current):
                    continue
                label = getattr(entry, "label", "") or ""
                sensor = f"{name}/{label}" if label else name
                reading = TemperatureReading(
                    celsius=float(current),
                    source="psutil",
                    sensor=sensor,
                    throttle_c=_positive(getattr(entry, "high", None)),
                    critical_c=_positive(getattr(entry, "critical", None)),
                )
                if self.sensor_name is not None:
                    if self.sensor_name in (name, label, sensor):
                        return reading
                    continue
                candidates.append(reading)
                if _is_cpu_or_skin(name, label):
                    preferred.append(reading)
        pool = preferred or candidates
        return max(pool, key=lambda r: r.celsius) if pool else None


def _psutil_temperatures() -> dict[str, list[Any]]:
    fn = getattr(psutil, "sensors_temperatures", None)  # absent on macOS and Windows
    return fn() if fn else {}


def _positive(value: float | None) -> float | None:
    return float(value) if value is not None and value > 0 and math.isfinite(value) else None


@dataclass(frozen=True)
class ThermalZone:
    name: str  # thermal_zoneN
    type: str
    celsius: float
    trips: tuple[tuple[str, float], ...]  # (trip type, C), e.g. ("passive", 85.0)
    policy: str | None = None  # the zone's kernel governor: step_wise, power_allocator, user_space...

    @property
    def throttle_c(self) -> float | None:
        """The lowest passive trip: where the kernel starts throttling (else "hot").

        None for a zone the kernel leaves to a daemon (`user_space`: Qualcomm's and Google's Android kernels
        govern every zone so): its trips only notify that daemon (115 and 125 C on Qualcomm's), and the
        daemon throttles on thresholds of its own that sysfs does not show."""
        if self.policy == "user_space":
            return None
        for kinds in (("passive",), ("hot",)):
            temps = [t for kind, t in self.trips if kind in kinds]
            if temps:
                return min(temps)
        return None

    @property
    def critical_c(self) -> float | None:
        temps = [t for kind, t in self.trips if kind == "critical"]
        return min(temps) if temps else None


def read_thermal_zones(sysfs_root: Path | str = "/sys") -> list[ThermalZone]:
    """All readable zones under <sysfs_root>/class/thermal, with their trip points."""
    base = Path(sysfs_root) / "class" / "thermal"
    try:
        dirs = sorted(base.glob("thermal_zone*"))
    except OSError:
        return []
    zones = []
    for d in dirs:
        milli = read_int(d / "temp")
        if milli is None:
            continue
        trips = []
        for temp_file in sorted(d.glob("trip_point_*_temp")):
            index = temp_file.name[len("trip_point_") : -len("_temp")]
            value = read_int(temp_file)
            kind = read_text(d / f"trip_point_{index}_type")
            if value is not None and kind and value > 0:
                trips.append((kind, value / 1000.0))
        zones.append(
            ThermalZone(
                d.name, read_text(d / "type") or d.name, milli / 1000.0, tuple(trips), read_text(d / "policy")
            )
        )
    return zones


class SysfsThermalSource:
    source = "sysfs"
    simulator = None

    def __init__(self, sysfs_root: Path | str = "/sys", sensor_name: str | None = None) -> None:
        self.sysfs_root = Path(sysfs_root)
        self.sensor_name = sensor_name

    def read(self) -> TemperatureReading | None:
        zones = read_thermal_zones(self.sysfs_root)
        if self.sensor_name is not None:
            zones = [z for z in zones if self.sensor_name in (z.type, z.name)]
        else:
            zones = [z for z in zones if _is_cpu_or_skin(z.type)] or zones
        if not zones:
            return None
        zone = max(zones, key=lambda z: z.celsius)
        return TemperatureReading(zone.celsius, "sysfs", zone.type, zone.throttle_c, zone.critical_c)


class FileThermalSource:
    """A millidegree number in a file, as sysfs writes it (a host zone bind-mounted into a container)."""

    source = "file"
    simulator = None

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def read(self) -> TemperatureReading | None:
        milli = read_int(self.path)
        return None if milli is None else TemperatureReading(milli / 1000.0, "file", str(self.path))


class SimulatedThermalSource:
    source = "simulated"

    def __init__(self, simulator: ThermalSimulator) -> None:
        self.simulator = simulator

    def read(self) -> TemperatureReading | None:
        p = self.simulator.profile
        celsius = self.simulator.update()
        return TemperatureReading(celsius, "simulated", f"sim:{p.name}", p.t_throttle, p.t_critical)


class ProcessLoad:
    """Busy cores of this process (CPU seconds per wall second) since the last read: what the pace
    controller's budget is actually being spent on. A simulated device counts the same CPU time it heats
    with (its cpu_time_fn and clock), so scripted loads in tests are seen here too."""

    def __init__(
        self,
        cpu_time_fn: Callable[[], float] = process_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cpu_time_fn = cpu_time_fn
        self._clock = clock
        self._last: tuple[float, float] | None = None

    @classmethod
    def for_source(cls, source: ThermalSource) -> ProcessLoad:
        sim = source.simulator
        if sim is None:
            return cls()
        return cls(sim.cpu_time_fn, sim.clock)

    def read(self) -> float | None:
        now = (self._clock(), self._cpu_time_fn())
        last, self._last = self._last, now
        if last is None or now[0] <= last[0]:
            return None
        return max(0.0, (now[1] - last[1]) / (now[0] - last[0]))


class NoThermalSource:
    source = "none"
    simulator = None

    def read(self) -> TemperatureReading | None:
        return None


def make_thermal_source(
    spec: str,
    *,
    sysfs_root: Path | str = "/sys",
    sensor_name: str | None = None,
    sim_time_scale: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    cpu_time_fn: Callable[[], float] = process_cpu_seconds,
    max_cores: float | None = None,
) -> ThermalSource:
    """auto | psutil | sysfs | file:PATH | sim:PROFILE | none. `auto` tries psutil, then sysfs, then none.

    Raises ValueError for a spec it does not know (a configuration error, caught at startup).
    """
    if spec == "none":
        return NoThermalSource()
    if spec == "psutil":
        return PsutilThermalSource(sensor_name)
    if spec == "sysfs":
        return SysfsThermalSource(sysfs_root, sensor_name)
    if spec.startswith("file:") and len(spec) > len("file:"):
        return FileThermalSource(spec[len("file:") :])
    if spec.startswith("sim:"):
        profile = get_profile(spec[len("sim:") :])
        cores = max_cores if max_cores is not None else usable_cpus()
        sim = ThermalSimulator(
            profile, clock=clock, cpu_time_fn=cpu_time_fn, time_scale=sim_time_scale, max_cores=cores
        )
        return SimulatedThermalSource(sim)
    if spec == "auto":
        for candidate in (PsutilThermalSource(sensor_name), SysfsThermalSource(sysfs_root, sensor_name)):
            if candidate.read() is not None:
                return candidate
        return NoThermalSource()
    raise ValueError(f"unknown thermal source {spec!r}: auto, psutil, sysfs, file:PATH, sim:PROFILE or none")


def read_psi_memory(proc_root: Path | str = "/proc") -> tuple[float, float] | None:
    """(some avg10, full avg10) in percent from <proc_root>/pressure/memory, None without PSI."""
    text = read_text(Path(proc_root) / "pressure" / "memory")
    if not text:
        return None
    values: dict[str, float] = {}
    for line in text.splitlines():
        kind, *fields = line.split()
        for field in fields:
            key, _, value = field.partition("=")
            if key == "avg10":
                with contextlib.suppress(ValueError):
                    values[kind] = float(value)
    if "some" not in values:
        return None
    return values["some"], values.get("full", 0.0)


def read_memory(
    cgroup_root: Path | str = "/sys/fs/cgroup",
    proc_root: Path | str = "/proc",
    *,
    host: Any | None = None,
    rss_fn: Callable[[], int] | None = None,
) -> MemoryReading | None:
    """Memory as this process may use it. `host` is a psutil.virtual_memory()-like object (tests)."""
    try:
        vm = host if host is not None else psutil.virtual_memory()
    except Exception:
        return None
    limit, used, available, source = int(vm.total), int(vm.total - vm.available), int(vm.available), "host"
    cg = read_cgroup_memory(cgroup_root, proc_root)
    # psutil reports the host inside a container (psutil issue 2100): a cgroup limit smaller than RAM wins.
    if cg is not None and cg.limit_bytes is not None and cg.limit_bytes < limit:
        limit, source = cg.limit_bytes, cg.version
        used = cg.used_bytes if cg.used_bytes is not None else used
        available = max(0, min(limit - used, int(vm.available)))
    psi = read_psi_memory(proc_root)
    try:
        rss = rss_fn() if rss_fn is not None else psutil.Process().memory_info().rss
    except Exception:
        rss = None
    return MemoryReading(
        limit_bytes=limit,
        used_bytes=used,
        available_bytes=available,
        source=source,
        psi_some_avg10=psi[0] if psi else None,
        psi_full_avg10=psi[1] if psi else None,
        rss_bytes=rss,
    )


# -- battery ---------------------------------------------------------------------------------------------
def read_battery(battery_fn: Callable[[], Any] | None = None) -> BatteryReading | None:
    try:
        fn = battery_fn or getattr(psutil, "sensors_battery", None)
        battery = fn() if fn else None
    except Exception:
        return None
    if battery is None:
        return None
    return BatteryReading(float(battery.percent), battery.power_plugged)
