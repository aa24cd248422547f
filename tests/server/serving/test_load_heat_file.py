"""SIMMER_HOME/load_heat.json when two servers share one home: neither save loses the other's measurements."""

import json

from server.serving.governor_setup import LOAD_HEAT_FILE, MAX_LOAD_HEAT_BYTES, kept_load_heat


def test_kept_load_heat_when_two_servers_share_a_home_then_each_save_keeps_the_others(tmp_path):
    path = tmp_path / LOAD_HEAT_FILE
    first, second = kept_load_heat(path), kept_load_heat(path)  # both started before either measured
    first.record("sim:phone", "big", 10.0)
    second.record("sim:phone", "small", 1.0)  # its own view had nothing: the file's big stays
    second.record("psutil:skin", "big", 4.0)
    first.record("sim:phone", "big", 8.0)  # a cooler load: kept 10 + 0.25 x (8 - 10)
    assert json.loads(path.read_text()) == {
        "psutil:skin": {"big": 4.0},
        "sim:phone": {"big": 9.5, "small": 1.0},
    }
    assert first.rises("sim:phone") == {"big": 9.5, "small": 1.0}


def test_kept_load_heat_when_the_file_is_damaged_between_saves_then_the_measurement_is_kept(tmp_path):
    path = tmp_path / LOAD_HEAT_FILE
    heat = kept_load_heat(path)
    heat.record("sim:phone", "big", 10.0)
    path.write_text("{not json")
    heat.record("sim:phone", "small", 1.0)  # what this process knew, and the new measurement
    assert json.loads(path.read_text()) == {"sim:phone": {"big": 10.0, "small": 1.0}}


def test_kept_load_heat_when_the_file_is_huge_then_it_is_not_read(tmp_path):
    path = tmp_path / LOAD_HEAT_FILE
    path.write_text('{"sim:phone": {"big": 10.0}}' + " " * MAX_LOAD_HEAT_BYTES)
    assert kept_load_heat(path).rises("sim:phone") == {}
