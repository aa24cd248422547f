"""The battery from sysfs's power_supply class (governor/power.py): trees written here for each rule, and
the fixture trees of real devices (tests/fixtures/sysfs/README.md says where each comes from)."""

from __future__ import annotations

from pathlib import Path

import pytest

from governor.power import read_power_supply
from governor.sensors import BatteryReading

FIXTURES = Path(__file__).parent.parent / "fixtures" / "sysfs"


def supply(root: Path, name: str, **files: object) -> None:
    folder = root / "class" / "power_supply" / name
    folder.mkdir(parents=True)
    for key, value in files.items():
        (folder / key).write_text(f"{value}\n")


def test_read_power_supply_when_no_class_or_no_battery_then_none(tmp_path):
    assert read_power_supply(tmp_path) is None
    supply(tmp_path, "AC", type="Mains", online=1)  # a board on a wall supply
    assert read_power_supply(tmp_path) is None


def test_read_power_supply_when_a_charger_is_online_then_plugged_whatever_the_status(tmp_path):
    supply(tmp_path, "battery", type="Battery", capacity=15, status="Discharging")
    supply(tmp_path, "usb", type="USB", online=0)
    supply(tmp_path, "wireless", type="Wireless", online=1)  # a charger psutil does not look for
    assert read_power_supply(tmp_path) == BatteryReading(15.0, True)


def test_read_power_supply_when_every_charger_is_offline_then_on_battery(tmp_path):
    supply(tmp_path, "battery", type="Battery", capacity=60, status="Unknown")
    supply(tmp_path, "usb", type="USB", online=0)
    supply(tmp_path, "bms", type="BMS", online=1)  # the gauge is not a charger
    assert read_power_supply(tmp_path) == BatteryReading(60.0, False)


@pytest.mark.parametrize(
    ("status", "plugged"),
    [("Charging", True), ("Full", True), ("Not charging", True), ("Discharging", False), ("Unknown", None)],
)
def test_read_power_supply_when_no_charger_then_the_status_says(tmp_path, status, plugged):
    supply(tmp_path, "BAT0", type="Battery", capacity=70, status=status)
    assert read_power_supply(tmp_path) == BatteryReading(70.0, plugged)


def test_read_power_supply_when_a_mouse_battery_then_left_out(tmp_path):
    supply(tmp_path, "hid-00:1f:20:aa:bb:cc-battery", type="Battery", scope="Device", capacity=5)
    assert read_power_supply(tmp_path) is None
    supply(tmp_path, "BAT0", type="Battery", capacity=90, status="Discharging")
    assert read_power_supply(tmp_path) == BatteryReading(90.0, False)


def test_read_power_supply_when_two_batteries_then_weighed_by_their_size(tmp_path):
    # 40 Wh at 100 % and 20 Wh at 10 %: 42 Wh of 60, 70 % (the mean of the capacities would say 55 %)
    supply(tmp_path, "BAT0", type="Battery", energy_now=40_000_000, energy_full=40_000_000, capacity=100)
    supply(tmp_path, "BAT1", type="Battery", energy_now=2_000_000, energy_full=20_000_000, capacity=10)
    assert read_power_supply(tmp_path) == BatteryReading(70.0, None)


def test_read_power_supply_when_absent_or_unreadable_then_skipped(tmp_path):
    supply(tmp_path, "BAT1", type="Battery", present=0, capacity=0)  # an empty second bay
    supply(tmp_path, "BAT0", type="Battery", status="Discharging")  # no charge file at all
    assert read_power_supply(tmp_path) is None


@pytest.mark.parametrize(
    ("device", "reading"),
    [
        # usb, pc_port and dc offline, `main` has no online file, the battery discharges
        ("android-qcom", BatteryReading(15.0, False)),
        # AC online, BAT0 "Not charging" at its 80 % threshold (energy_now / energy_full), the mouse left out
        ("laptop-thinkpad", BatteryReading(80.0, True)),
        # a MAX17040 fuel gauge with no charger supply, status Unknown: the OS does not say
        ("raspberry-pi-ups", BatteryReading(42.0, None)),
        ("raspberry-pi-4", None),  # no power supply registered without a HAT
        ("raspberry-pi-5", None),
        ("jetson-nano", None),
    ],
)
def test_read_power_supply_when_real_device_trees_then_their_reading(device, reading):
    got = read_power_supply(FIXTURES / device)
    if reading is None:
        assert got is None
    else:
        assert got is not None and (round(got.percent), got.plugged) == (reading.percent, reading.plugged)
