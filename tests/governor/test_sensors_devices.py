"""The sensor code against the sysfs layouts real ARM boards and phones have (tests/fixtures/sysfs, each
tree's source in its README): which zone the default choice governs on, and which trip it takes as the
throttle point."""

from __future__ import annotations

from pathlib import Path

import pytest

from governor.policy import GovernorState, PolicyConfig, Readings, decide
from governor.sensors import SysfsThermalSource, make_thermal_source, read_thermal_zones

TREES = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs"


def tree(name: str) -> Path:
    root = TREES / name
    assert (root / "class" / "thermal").is_dir(), f"missing fixture tree {root}"
    return root


# device -> (zones, the default choice: (zone type, °C, throttle °C, critical °C))
DEVICES = {
    # one zone, one critical trip: the firmware throttles, sysfs shows no throttle point
    "raspberry-pi-4": (1, ("cpu-thermal", 52.108, None, 90.0)),
    # four active trips (fan stages) are not throttle points
    "raspberry-pi-5": (1, ("cpu-thermal", 61.35, None, 90.0)),
    # the hottest CPU zone, not the modem (hotter still); user_space zones' trips only notify a daemon
    "android-qcom": (25, ("cpu-1-1-usr", 63.4, None, None)),
    # CPU-therm, not PMIC-Die (a fixed 100 °C) nor the fan's estimate; "hot" is the throttle trip
    "jetson-nano": (7, ("CPU-therm", 34.0, 98.5, 102.5)),
}


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_sysfs_source_when_device_tree_then_its_cpu_zone_and_throttle_trip(device):
    zones, (sensor, celsius, throttle, critical) = DEVICES[device]
    root = tree(device)
    assert len(read_thermal_zones(root)) == zones  # cooling devices beside the zones are not zones
    reading = SysfsThermalSource(root).read()
    assert reading is not None
    assert (reading.sensor, reading.celsius, reading.throttle_c, reading.critical_c) == (
        sensor,
        celsius,
        throttle,
        critical,
    )


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_auto_source_when_only_sysfs_then_the_device_tree(device, monkeypatch):
    monkeypatch.setattr("governor.sensors._psutil_temperatures", dict)  # this machine's own sensors
    source = make_thermal_source("auto", sysfs_root=tree(device))
    reading = source.read()
    assert source.source == "sysfs" and reading is not None
    assert reading.sensor == DEVICES[device][1][0]


def test_qcom_phone_when_user_space_zones_then_trips_kept_but_no_throttle_point():
    zones = {z.type: z for z in read_thermal_zones(tree("android-qcom"))}
    cpu = zones["cpu-1-1-usr"]
    assert cpu.policy == "user_space"
    assert sorted(cpu.trips) == [("passive", 115.0), ("passive", 125.0)]  # read as sysfs has them
    assert cpu.throttle_c is None


def test_qcom_phone_when_governed_then_the_policy_default_throttle_not_the_115c_notification():
    """The 115 °C `reset-mon-cfg` trip taken as the throttle point would leave a phone ungoverned until the
    SoC is far past where its thermal daemon has already slowed it down."""
    reading = SysfsThermalSource(tree("android-qcom")).read()
    assert reading is not None
    config = PolicyConfig()
    state = decide(GovernorState(), Readings(temperature=reading), config, now=0.0)
    assert state.throttle_c == config.default_throttle_c


def test_jetson_when_named_then_any_zone_even_one_the_default_skips():
    reading = SysfsThermalSource(tree("jetson-nano"), sensor_name="thermal-fan-est").read()
    assert reading is not None and (reading.sensor, reading.celsius) == ("thermal-fan-est", 33.0)
    pmic = SysfsThermalSource(tree("jetson-nano"), sensor_name="PMIC-Die").read()
    assert pmic is not None and pmic.celsius == 100.0


def test_pi5_when_hot_enough_for_every_fan_stage_then_still_no_throttle_point(tmp_path):
    """Active trips drive the fan; a Pi 5 at 80 °C has all four fan stages on and is not throttling yet."""
    import shutil

    root = tmp_path / "sys"
    shutil.copytree(tree("raspberry-pi-5"), root, symlinks=True)
    (root / "devices/virtual/thermal/thermal_zone0/temp").write_text("80000\n")
    reading = SysfsThermalSource(root).read()
    assert reading is not None and (reading.celsius, reading.throttle_c) == (80.0, None)
