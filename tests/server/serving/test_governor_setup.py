"""The server's governor as `simmer serve` builds it (server/serving/governor_setup.py), reading the battery
of real device trees (tests/fixtures/sysfs) through SIMMER_SYSFS_ROOT, and the background-work settings."""

from __future__ import annotations

from pathlib import Path

from server.serving.governor_setup import build_governor
from server.settings import Settings

FIXTURES = Path(__file__).parent.parent.parent / "fixtures" / "sysfs"


def governor(tmp_path: Path, device: str, **overrides):
    settings = Settings(home=tmp_path, sysfs_root=FIXTURES / device, thermal_source="none", **overrides)
    return build_governor(settings)


def test_build_governor_when_a_phone_on_battery_then_its_reading_and_background_work_waits(tmp_path):
    snap = governor(tmp_path, "android-qcom").tick()
    assert snap.battery is not None and (snap.battery.percent, snap.battery.plugged) == (15.0, False)
    assert snap.level == "fair"  # 15 % unplugged: the battery's own rule
    assert not snap.background.runs and snap.background.why == "the device is fair"
    assert snap.limits.spin is False  # on battery no pool spins


def test_build_governor_when_a_laptop_on_its_charger_then_background_work_runs(tmp_path):
    snap = governor(tmp_path, "laptop-thinkpad").tick()
    assert snap.battery is not None and (round(snap.battery.percent), snap.battery.plugged) == (80, True)
    assert snap.level == "nominal" and snap.background.runs
    assert snap.limits.spin is None  # plugged in and unpaced: the engine's own setting


def test_build_governor_when_the_settings_move_the_threshold_or_force_it_then_they_decide(tmp_path):
    ups = governor(tmp_path, "raspberry-pi-ups").tick()  # 42 %, the OS does not say whether it charges
    assert not ups.background.runs and ups.background.why == "battery, charger unknown, at 42 % (below 50 %)"
    lower = governor(tmp_path, "raspberry-pi-ups", background_min_battery_percent=40).tick()
    assert lower.background.runs
    forced = governor(tmp_path, "android-qcom", background_work="always").tick()
    assert forced.background.runs and forced.level == "fair"


def test_build_governor_when_a_board_without_battery_then_none_and_work_runs(tmp_path):
    snap = governor(tmp_path, "raspberry-pi-5").tick()
    assert snap.battery is None and snap.background.runs and snap.background.why == "no battery"
