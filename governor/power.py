"""Where the device's power comes from: a battery's charge and whether a charger is online.

On Linux (phones, boards with a fuel gauge, laptops) the kernel's power_supply class says it
(`/sys/class/power_supply/<name>/`, Documentation/ABI/testing/sysfs-class-power); this reader takes what
psutil's does not: chargers of any type (an Android phone's `usb`, `ac`, `wireless` or `dc`, where psutil
looks for `AC`/`AC0` only), batteries of devices rather than of the system (a wireless mouse's
`hid-...-battery`, scope `Device`) left out, and "Not charging" (on the charger, held below full by a charge
threshold) read as plugged in. Elsewhere (macOS, Windows) psutil reads the OS's own report.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from governor.sensors import BatteryReading, read_battery
from governor.sysfiles import read_int, read_text

_NOT_CHARGERS = {"Battery", "BMS", "UPS"}  # every other type with an `online` file feeds the device
_PLUGGED_STATUS = {"Charging", "Full", "Not charging"}


def read_power_supply(sysfs_root: Path | str = "/sys") -> BatteryReading | None:
    """The system's batteries as one reading (None: no battery, e.g. a board on a wall supply)."""
    base = Path(sysfs_root) / "class" / "power_supply"
    try:
        supplies = sorted(p for p in base.iterdir() if p.is_dir())
    except OSError:
        return None
    batteries = [p for p in supplies if _is_system_battery(p)]
    charges = [c for c in (_charge(p) for p in batteries) if c is not None]
    if not charges:
        return None
    if all(full is not None for _, full in charges):  # energy or charge counters: weigh by size
        total = sum(full for _, full in charges if full is not None)
        percent = sum(now * full for now, full in charges if full is not None) / total
    else:
        percent = sum(now for now, _ in charges) / len(charges)
    return BatteryReading(round(min(100.0, max(0.0, percent)), 1), _plugged(supplies, batteries))


def _is_system_battery(supply: Path) -> bool:
    if read_text(supply / "type") != "Battery":
        return False
    if read_text(supply / "scope") == "Device":  # a peripheral's (HID) battery, not the system's
        return False
    return read_int(supply / "present") != 0  # absent file: present


def _charge(battery: Path) -> tuple[float, float | None] | None:
    """(percent, full capacity in the battery's own unit, None when only `capacity` is known)."""
    for unit in ("energy", "charge"):
        now, full = read_int(battery / f"{unit}_now"), read_int(battery / f"{unit}_full")
        if now is not None and full:
            return 100.0 * now / full, float(full)
    capacity = read_int(battery / "capacity")
    return None if capacity is None else (float(capacity), None)


def _plugged(supplies: list[Path], batteries: list[Path]) -> bool | None:
    """A charger online says plugged in; chargers that all say offline say on battery; without any
    charger, the batteries' status says it (None: nothing says)."""
    online = [
        read_int(p / "online")
        for p in supplies
        if read_text(p / "type") not in _NOT_CHARGERS and (p / "online").exists()
    ]
    if any(o == 1 for o in online):
        return True
    statuses = {read_text(b / "status") for b in batteries}
    if statuses & _PLUGGED_STATUS:
        return True  # a charger the kernel names no supply for (or one without `online`)
    if online or "Discharging" in statuses:
        return False
    return None


def battery_reader(sysfs_root: Path | str = "/sys") -> Callable[[], BatteryReading | None]:
    """The battery reading for this OS: the power_supply class on Linux, psutil elsewhere."""
    if sys.platform.startswith("linux"):
        return lambda: read_power_supply(sysfs_root)
    return read_battery
