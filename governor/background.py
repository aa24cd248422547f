"""Whether heavy work nobody waits for may run now: a pull's conversion and quality measurement on the
server, the running summary of a long chat. On-device teams run such work on the charger and cool, as
Android's WorkManager (`requiresCharging`, `requiresBatteryNotLow`) and iOS's BGProcessingTask
(`requiresExternalPower`) let them; the governor says it here, the work's owners wait for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from governor.policy import Level, Lifecycle
from governor.sensors import BatteryReading

BackgroundMode = Literal["auto", "always"]


@dataclass(frozen=True)
class BackgroundWork:
    runs: bool
    why: str


# First match wins:
#   mode "always" (a setting forces it)                  -> runs
#   the client app is in the background                  -> waits
#   level fair, serious or critical (heat, memory, ...)  -> waits
#   on battery (plugged False or unknown) below min %    -> waits
#   otherwise (plugged in, charged enough, no battery)   -> runs
def background_work(
    *,
    level: Level,
    lifecycle: Lifecycle,
    battery: BatteryReading | None,
    mode: BackgroundMode = "auto",
    min_battery_percent: float = 50.0,
) -> BackgroundWork:
    if mode == "always":
        return BackgroundWork(True, "forced (SIMMER_BACKGROUND_WORK=always)")
    if lifecycle == "background":
        return BackgroundWork(False, "the app is in the background")
    if level != "nominal":
        return BackgroundWork(False, f"the device is {level}")
    if battery is None:
        return BackgroundWork(True, "no battery")
    if battery.plugged is True:
        return BackgroundWork(True, f"plugged in ({battery.percent:.0f} %)")
    where = "on battery" if battery.plugged is False else "battery, charger unknown,"
    if battery.percent < min_battery_percent:
        return BackgroundWork(
            False, f"{where} at {battery.percent:.0f} % (below {min_battery_percent:.0f} %)"
        )
    return BackgroundWork(True, f"{where} at {battery.percent:.0f} %")
