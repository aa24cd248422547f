"""Whether heavy background work may run (governor/background.py): the rule table row by row, then through
the governor (its snapshot and its subscribers) with a battery that drains and charges."""

from __future__ import annotations

import pytest

from governor.background import background_work
from governor.policy import PolicyConfig
from governor.sensors import BatteryReading
from tests.governor.helpers import make_governor

ON_BATTERY_LOW = BatteryReading(35.0, False)
ON_BATTERY_HIGH = BatteryReading(80.0, False)
CHARGING = BatteryReading(10.0, True)
UNKNOWN_LOW = BatteryReading(35.0, None)


@pytest.mark.parametrize(
    ("mode", "level", "lifecycle", "battery", "runs", "why"),
    [
        ("always", "critical", "background", ON_BATTERY_LOW, True, "forced"),
        ("auto", "nominal", "background", CHARGING, False, "the app is in the background"),
        ("auto", "fair", "foreground", CHARGING, False, "the device is fair"),
        ("auto", "serious", "foreground", None, False, "the device is serious"),
        ("auto", "nominal", "foreground", ON_BATTERY_LOW, False, "on battery at 35 % (below 50 %)"),
        ("auto", "nominal", "foreground", UNKNOWN_LOW, False, "battery, charger unknown, at 35 % (below"),
        ("auto", "nominal", "foreground", ON_BATTERY_HIGH, True, "on battery at 80 %"),
        ("auto", "nominal", "foreground", CHARGING, True, "plugged in (10 %)"),
        ("auto", "nominal", "foreground", None, True, "no battery"),
    ],
)
def test_background_work_when_each_row_then_its_verdict(mode, level, lifecycle, battery, runs, why):
    got = background_work(level=level, lifecycle=lifecycle, battery=battery, mode=mode)
    assert got.runs is runs and got.why.startswith(why)


def test_background_work_when_the_threshold_moves_then_it_decides():
    at = BatteryReading(35.0, False)
    assert background_work(level="nominal", lifecycle="foreground", battery=at, min_battery_percent=30).runs
    below = background_work(level="nominal", lifecycle="foreground", battery=at, min_battery_percent=36)
    assert not below.runs


class Battery:
    def __init__(self, reading: BatteryReading | None) -> None:
        self.reading = reading

    def __call__(self) -> BatteryReading | None:
        return self.reading


def test_governor_when_the_battery_drains_then_plugged_in_then_snapshot_and_subscribers_follow():
    battery = Battery(ON_BATTERY_HIGH)
    gov, _, _ = make_governor(read_battery=battery)
    heard: list[bool] = []
    gov.subscribe(lambda snap: heard.append(snap.background.runs))
    assert gov.tick().background.runs
    battery.reading = ON_BATTERY_LOW  # above the 20 % that makes the level fair: still nominal
    snap = gov.tick()
    assert snap.level == "nominal" and not snap.background.runs
    assert snap.to_dict()["background_work"] == {"runs": False, "why": "on battery at 35 % (below 50 %)"}
    battery.reading = CHARGING
    assert gov.tick().background.runs
    # each flip is told, though the level never moved (the first tick is told too: on battery, no spinning)
    assert heard[-2:] == [False, True]


def test_governor_when_set_to_always_then_runs_on_a_low_battery():
    always = PolicyConfig(background_work="always")
    gov, _, _ = make_governor(read_battery=Battery(ON_BATTERY_LOW), config=always)
    assert gov.tick().background.runs
