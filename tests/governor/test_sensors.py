from pathlib import Path
from types import SimpleNamespace

import pytest

from governor.sensors import (
    FileThermalSource,
    PsutilThermalSource,
    SysfsThermalSource,
    make_thermal_source,
    read_battery,
    read_thermal_zones,
)
from tests.governor.fakes import FakeClock, ScriptedLoad


def zone(root: Path, index: int, type_: str, milli: int, trips: list[tuple[str, int]] = ()) -> None:
    d = root / "class" / "thermal" / f"thermal_zone{index}"
    d.mkdir(parents=True)
    (d / "type").write_text(type_ + "\n")
    (d / "temp").write_text(f"{milli}\n")
    for i, (kind, temp) in enumerate(trips):
        (d / f"trip_point_{i}_type").write_text(kind + "\n")
        (d / f"trip_point_{i}_temp").write_text(f"{temp}\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    zone(tmp_path, 0, "acpitz", 55000, [("critical", 105000)])
    zone(tmp_path, 1, "x86_pkg_temp", 48500, [("passive", 95000), ("passive", 85000), ("critical", 100000)])
    zone(tmp_path, 2, "skin-therm", 38250, [("hot", 45000), ("critical", 50000)])
    return tmp_path


def test_thermal_zones_when_present_then_temps_and_trip_points_parsed(sysfs):
    zones = {z.type: z for z in read_thermal_zones(sysfs)}
    assert set(zones) == {"acpitz", "x86_pkg_temp", "skin-therm"}
    pkg = zones["x86_pkg_temp"]
    assert pkg.celsius == 48.5
    assert pkg.throttle_c == 85.0  # the lowest passive trip
    assert pkg.critical_c == 100.0
    assert zones["skin-therm"].throttle_c == 45.0  # no passive trip: "hot"
    assert zones["acpitz"].throttle_c is None


def test_sysfs_source_when_default_then_hottest_cpu_or_skin_zone(sysfs):
    reading = SysfsThermalSource(sysfs).read()
    assert reading is not None
    # acpitz is hotter but is neither a CPU nor a skin sensor
    assert (reading.sensor, reading.celsius, reading.source) == ("x86_pkg_temp", 48.5, "sysfs")
    assert (reading.throttle_c, reading.critical_c) == (85.0, 100.0)


def test_sysfs_source_when_named_then_that_zone(sysfs):
    reading = SysfsThermalSource(sysfs, sensor_name="skin-therm").read()
    assert reading is not None and reading.celsius == 38.25 and reading.throttle_c == 45.0


def test_sysfs_source_when_no_zones_or_unknown_name_then_none(tmp_path, sysfs):
    assert SysfsThermalSource(tmp_path / "empty").read() is None
    assert SysfsThermalSource(sysfs, sensor_name="gpu").read() is None


def test_sysfs_when_temp_unreadable_then_zone_skipped(sysfs):
    (sysfs / "class/thermal/thermal_zone1/temp").write_text("garbage")
    assert {z.type for z in read_thermal_zones(sysfs)} == {"acpitz", "skin-therm"}


def temp(label: str, current: float, high: float | None = None, critical: float | None = None):
    return SimpleNamespace(label=label, current=current, high=high, critical=critical)


PSUTIL_TEMPS = {
    "acpitz": [temp("", 70.0)],
    "coretemp": [temp("Package id 0", 61.0, 84.0, 100.0), temp("Core 0", 58.0, 84.0, 100.0)],
    "nvme": [temp("Composite", 45.0, 80.0, 90.0)],
}


def test_psutil_source_when_default_then_hottest_cpu_sensor_with_its_high_as_threshold():
    reading = PsutilThermalSource(temps_fn=lambda: PSUTIL_TEMPS).read()
    assert reading is not None
    assert (reading.sensor, reading.celsius, reading.throttle_c, reading.critical_c) == (
        "coretemp/Package id 0",
        61.0,
        84.0,
        100.0,
    )


@pytest.mark.parametrize(
    ("name", "expected"), [("nvme", 45.0), ("Core 0", 58.0), ("coretemp/Core 0", 58.0), ("gpu", None)]
)
def test_psutil_source_when_sensor_named_then_that_sensor(name, expected):
    reading = PsutilThermalSource(name, temps_fn=lambda: PSUTIL_TEMPS).read()
    assert (reading.celsius if reading else None) == expected


def test_psutil_source_when_no_sensors_or_error_then_none():
    assert PsutilThermalSource(temps_fn=dict).read() is None

    def broken():
        raise OSError("no hwmon")

    assert PsutilThermalSource(temps_fn=broken).read() is None


def test_psutil_source_when_only_other_sensors_then_hottest_of_them():
    reading = PsutilThermalSource(
        temps_fn=lambda: {"acpitz": [temp("", 40.0)], "nvme": [temp("", 44.0)]}
    ).read()
    assert reading is not None and reading.celsius == 44.0


def test_file_source_when_millidegrees_then_celsius_and_none_when_missing(tmp_path):
    f = tmp_path / "temp"
    f.write_text("41250\n")
    reading = FileThermalSource(f).read()
    assert reading is not None and (reading.celsius, reading.source) == (41.25, "file")
    f.unlink()
    assert FileThermalSource(f).read() is None


def test_make_thermal_source_when_specs_then_right_source(tmp_path, sysfs):
    assert make_thermal_source("none").source == "none"
    assert make_thermal_source("none").read() is None
    assert make_thermal_source("psutil").source == "psutil"
    assert make_thermal_source("sysfs", sysfs_root=sysfs).read().celsius == 48.5
    assert make_thermal_source(f"file:{tmp_path / 't'}").source == "file"
    with pytest.raises(ValueError, match="unknown thermal source"):
        make_thermal_source("thermometer")
    with pytest.raises(ValueError, match="unknown thermal profile"):
        make_thermal_source("sim:toaster")


def test_make_thermal_source_when_auto_then_falls_back_to_sysfs_then_none(tmp_path, sysfs, monkeypatch):
    monkeypatch.setattr("governor.sensors._psutil_temperatures", dict)  # this machine may have sensors
    assert make_thermal_source("auto", sysfs_root=sysfs).source == "sysfs"
    assert make_thermal_source("auto", sysfs_root=tmp_path / "empty").source == "none"


def test_make_thermal_source_when_sim_then_simulated_readings_on_the_injected_clock():
    clock = FakeClock()
    load = ScriptedLoad(clock)
    source = make_thermal_source("sim:phone", clock=clock, cpu_time_fn=load, sim_time_scale=10, max_cores=2)
    assert source.source == "simulated" and source.simulator is not None
    load.run(2, 6)  # 60 simulated seconds at time_scale 10
    reading = source.read()
    assert reading is not None
    assert reading.source == "simulated" and reading.sensor == "sim:phone"
    assert (reading.throttle_c, reading.critical_c) == (43, 48)
    assert reading.celsius > 43  # hot after a minute of two busy cores


def test_battery_when_absent_or_present_then_reading_or_none():
    assert read_battery(lambda: None) is None
    reading = read_battery(lambda: SimpleNamespace(percent=15.0, secsleft=100, power_plugged=False))
    assert reading is not None and (reading.percent, reading.plugged) == (15.0, False)

    def broken():
        raise RuntimeError("no ACPI")

    assert read_battery(broken) is None
