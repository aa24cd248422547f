import json
import logging

import pytest

from governor.governor import Governor
from governor.limits import build_ladder
from governor.load_heat import LoadHeat, parse, with_priors
from governor.sensors import SimulatedThermalSource
from tests.governor.fakes import FakeClock, FakeSensor, make_sim

TWO = build_ladder([("big", "q4", 0.02, 0.99, 300), ("small", "q4", 0.005, 0.9, 90)])


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        (None, {}),
        ("", {}),
        ("not json", {}),
        ("[1, 2]", {}),
        ('{"d": [1]}', {}),
        (
            '{"d": {"m": 2.5, "bad": "x", "neg": -1, "nan": NaN, "inf": Infinity, "bool": true}}',
            {"d": {"m": 2.5}},
        ),
        ('{"d": {"m": 3}, "e": {}}', {"d": {"m": 3.0}}),
        ("[" * 100_000, {}),  # nested past the parser's recursion limit
    ],
)
def test_parse_when_kept_text_then_only_finite_non_negative_degrees_survive(text, kept):
    assert parse(text) == kept


def test_record_when_measured_again_then_a_hotter_load_counts_at_once_a_cooler_one_slowly():
    saved: list[str] = []
    heat = LoadHeat(None, saved.append)
    heat.record("dev", "m", 2.0)
    heat.record("dev", "m", 4.0)
    heat.record("dev", "m", 0.0)
    heat.record("dev", "n", -1.0)  # a device that cooled during a load: no heat, not negative heat
    heat.record("dev", "n", float("nan"))  # not a measurement
    assert heat.rises("dev") == {"m": 3.0, "n": 0.0} and heat.rises("other") == {}
    assert len(saved) == 4 and json.loads(saved[-1]) == {"dev": {"m": 3.0, "n": 0.0}}
    assert LoadHeat(saved[-1]).rises("dev") == {"m": 3.0, "n": 0.0}  # what a restart reads


def test_record_when_saving_fails_then_logged_and_kept_in_memory(caplog):
    def fail(_: str) -> None:
        raise OSError(28, "No space left on device")

    heat = LoadHeat(None, fail)
    with caplog.at_level(logging.WARNING, logger="simmer.governor"):
        heat.record("dev", "m", 1.5)
    assert heat.rises("dev") == {"m": 1.5} and "could not be kept" in caplog.text


def test_loading_when_a_model_loads_then_its_heat_is_measured_under_the_sensors_key():
    sensor = FakeSensor(38.0, critical_c=48.0)
    gov = Governor(thermal=sensor, clock=FakeClock(), usable_cpus=2, ladder=TWO)
    with gov.loading("big"):
        sensor.celsius = 47.5
    with gov.loading():  # no model named: nothing measured
        sensor.celsius = 49.0
    assert gov.load_heat.rises("psutil:fake") == {"big": 9.5}


def test_loading_when_the_load_fails_then_nothing_is_measured():
    sensor = FakeSensor(38.0)
    gov = Governor(thermal=sensor, clock=FakeClock(), usable_cpus=2, ladder=TWO)
    with pytest.raises(RuntimeError), gov.loading("big"):
        sensor.celsius = 45.0
        raise RuntimeError("the load failed")
    assert gov.load_heat.rises("psutil:fake") == {}


def test_loading_when_simulated_then_the_key_names_profile_and_time_scale():
    sim, load, _ = make_sim("phone-heatwave", time_scale=10.0)
    gov = Governor(thermal=SimulatedThermalSource(sim), usable_cpus=2, ladder=TWO)
    with gov.loading("big"):
        load.run(1.0, 3.0)  # a 3 s load on one core: 30 simulated seconds
    rises = gov.load_heat.rises("simulated:sim:phone-heatwave@x10")
    assert set(rises) == {"big"} and rises["big"] > 3.0


def test_start_when_the_big_load_is_known_to_overheat_then_the_rung_is_the_best_whose_load_fits():
    """Nothing is loaded yet at start: the start rung is the best one whose measured load the device can
    take. Measured nowhere, the big one loads (its heat is then measured)."""
    sensor = FakeSensor(38.0, critical_c=48.0)  # critical (a pause) from 47 C: 9 C of room
    known = LoadHeat(json.dumps({"psutil:fake": {"big": 10.0, "small": 1.0}}))
    gov = Governor(thermal=sensor, clock=FakeClock(), usable_cpus=2, ladder=TWO, load_heat=known)
    gov.models_loaded(frozenset())
    snap = gov.tick()
    assert snap.level == "fair" and (snap.limits.model_id, snap.limits.rung_held) == ("small", True)
    fresh = Governor(thermal=sensor, clock=FakeClock(), usable_cpus=2, ladder=TWO)
    fresh.models_loaded(frozenset())
    assert fresh.tick().limits.model_id == "big"


@pytest.mark.parametrize(
    ("measured", "sizes", "expected"),
    [
        ({}, {"big": 300, "small": 90}, {}),  # nothing measured on this device: blind
        ({"big": 10.0}, {"big": 300, "small": 90}, {"big": 10.0, "small": 3.0}),  # scaled by bytes
        ({"big": 10.0, "small": 1.0}, {"big": 300, "small": 90}, {"big": 10.0, "small": 1.0}),  # measured
        # the dearest per byte of those measured: small (4.5 C / 90 = 0.05) over big (10 C / 300 = 0.033)
        (
            {"big": 10.0, "small": 4.5},
            {"big": 300, "small": 90, "mid": 150},
            {"big": 10, "small": 4.5, "mid": 7.5},
        ),
        ({"big": 10.0}, {"big": 0, "small": 90}, {"big": 10.0}),  # no bytes known: nothing to scale by
        ({"gone": 5.0}, {"small": 90}, {"gone": 5.0}),  # a model no longer in the ladder scales nothing
    ],
)
def test_with_priors_when_a_model_was_never_loaded_here_then_its_heat_scales_by_bytes(
    measured, sizes, expected
):
    assert with_priors(measured, sizes) == pytest.approx(expected)


def test_start_when_only_the_big_load_was_measured_then_the_others_heat_scales_from_it():
    """Only the big model's load was measured on this device (300 bytes). With 8 C of room, the mid one
    (150 bytes) is taken when big's 12 C puts it at 6 C, and passed over for the small one (90 bytes, 6 C)
    when big's 20 C puts it at 10 C; without the prior, mid (never measured: no heat) would load."""
    three = build_ladder(
        [("big", "q4", 0.02, 0.99, 300), ("mid", "q4", 0.01, 0.95, 150), ("small", "q4", 0.005, 0.9, 90)]
    )
    sensor = FakeSensor(39.0, critical_c=48.0)  # critical (a pause) from 47 C: 8 C of room
    for big_c, start in [(12.0, "mid"), (20.0, "small")]:
        known = LoadHeat(json.dumps({"psutil:fake": {"big": big_c}}))
        gov = Governor(thermal=sensor, clock=FakeClock(), usable_cpus=2, ladder=three, load_heat=known)
        gov.models_loaded(frozenset())
        assert gov.tick().limits.model_id == start, big_c
