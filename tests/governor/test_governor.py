import asyncio
import itertools
import json
import logging
import threading

import pytest

from governor.governor import Governor
from governor.limits import build_ladder
from governor.policy import PolicyConfig
from governor.sensors import BatteryReading, MemoryReading, SimulatedThermalSource
from tests import aio
from tests.governor.fakes import FakeClock, FakeSensor, make_sim
from tests.governor.helpers import LADDER, make_governor


def test_tick_when_temperature_rises_then_level_limits_and_log_line(caplog):
    gov, sensor, clock = make_governor(config=PolicyConfig(pace_control=False))  # the level table alone
    assert gov.tick().level == "nominal"
    assert gov.limits.threads == 2
    sensor.celsius = 38.0
    clock.advance(60)  # the 30 C sample has left the forecast window
    with caplog.at_level(logging.INFO, logger="simmer.governor"):
        snap = gov.tick()
    assert snap.level == "fair" and snap.limits.threads == 1
    assert [r.getMessage() for r in caplog.records] == [
        "nominal -> fair: thermal: 38.0 C, headroom 0.83 (forecast 0.83)"
    ]


def test_tick_when_pace_control_and_warm_then_budget_from_the_controller_not_the_table():
    gov, sensor, clock = make_governor(FakeSensor(30.0, critical_c=48.0))
    assert gov.config.pace_max_cores == 2.0  # the usable CPUs
    sensor.celsius = 38.0  # fair; the table would halve the threads, the controller still allows 1.87 cores
    snap = gov.tick()
    assert snap.level == "fair" and snap.cause == "thermal"
    setpoint = 1 - PolicyConfig().pace_margin_c / 30  # one reading: no step seen, a fine sensor
    assert snap.limits.cpu_budget_cores == pytest.approx(12 * (setpoint - (1 - 5 / 30)))
    assert snap.limits.threads == 2 and not snap.limits.pause_running
    sensor.celsius = 42.9  # serious, above the setpoint: a budget under one core buys one thread, paced
    clock.advance(60)  # a level, not a trend: the 38 C sample has left the forecast window
    snap = gov.tick()
    assert snap.level == "serious" and snap.limits.threads == 1
    budget = snap.limits.cpu_budget_cores
    assert budget < 1.0
    assert snap.limits.tokens_per_second == pytest.approx(budget / 0.010)  # serious: the q4-a8 rung


def test_set_lifecycle_when_background_then_paused_and_foreground_resumes():
    gov, _, clock = make_governor()
    gov.tick()
    snap = gov.set_lifecycle("background")
    assert (snap.level, snap.cause, snap.lifecycle) == ("critical", "lifecycle", "background")
    assert snap.limits.pause_running and snap.limits.pause_new
    assert not gov.wait_while_paused(timeout=0.0)
    clock.advance(1)
    snap = gov.set_lifecycle("foreground")
    assert snap.level == "nominal" and not snap.limits.pause_running
    assert gov.wait_while_paused(timeout=0.0)
    with pytest.raises(ValueError):
        gov.set_lifecycle("minimized")  # type: ignore[arg-type]


def test_set_lifecycle_when_low_priority_then_serious_limits_without_pause():
    gov, _, _ = make_governor(config=PolicyConfig(background_action="low_priority"))
    snap = gov.set_lifecycle("background")
    assert snap.level == "serious"
    assert not snap.limits.pause_running and snap.limits.threads == 1
    assert gov.wait_while_paused(timeout=0.0)


def test_wait_while_paused_when_resumed_from_another_thread_then_returns_true():
    gov, _, _ = make_governor()
    gov.set_lifecycle("background")
    waiting = threading.Event()

    def resume_soon() -> None:
        waiting.wait(5)
        gov.set_lifecycle("foreground")

    t = threading.Thread(target=resume_soon)
    t.start()

    def cancel_check() -> bool:
        waiting.set()  # we are inside the wait now
        return False

    assert gov.wait_while_paused(cancel_check, timeout=5.0)
    t.join()


def test_wait_while_paused_when_cancelled_then_false():
    gov, _, _ = make_governor()
    gov.set_lifecycle("background")
    assert not gov.wait_while_paused(lambda: True, timeout=5.0)


def test_wait_while_paused_when_new_requests_then_waits_on_pause_new():
    gov, _, _ = make_governor()
    assert gov.wait_while_paused(timeout=0.0, new=True)
    gov.set_lifecycle("background")
    assert not gov.wait_while_paused(timeout=0.0, new=True)


def test_subscribe_when_level_changes_then_called_once_per_change_and_unsubscribe_stops():
    gov, sensor, clock = make_governor()
    seen = []
    unsubscribe = gov.subscribe(lambda snap: seen.append(snap.level))
    gov.tick()
    clock.advance(1)
    gov.tick()  # same level: no event
    sensor.celsius = 44.0
    clock.advance(1)
    gov.tick()
    assert seen == ["critical"]
    unsubscribe()
    gov.set_lifecycle("background")
    assert seen == ["critical"]


def test_subscribe_async_when_change_then_snapshot_arrives_on_the_loop():
    gov, sensor, clock = make_governor()

    async def main() -> str:
        queue, unsubscribe = gov.subscribe_async(asyncio.get_running_loop())
        sensor.celsius = 44.0
        clock.advance(1)
        await asyncio.to_thread(gov.tick)  # a change published from another thread
        snap = await asyncio.wait_for(queue.get(), timeout=5)
        unsubscribe()
        return snap.level

    assert aio.run(main()) == "critical"


def test_to_dict_when_simulated_then_json_body_with_source_and_limits():
    sim, load, _ = make_sim(max_cores=2)
    memory = MemoryReading(4 * 2**30, 2**30, 3 * 2**30, "cgroup-v2", 1.5, 0.0, 200 * 2**20)
    gov = Governor(
        thermal=SimulatedThermalSource(sim),
        read_memory=lambda: memory,
        read_battery=lambda: BatteryReading(80.0, True),
        usable_cpus=2,
        ladder=LADDER,
    )
    load.run(2, 30)
    body = gov.tick().to_dict()
    json.dumps(body)  # serializable as is
    assert body["temperature"]["source"] == "simulated"
    assert body["temperature"]["sensor"] == "sim:phone"
    assert body["temperature"]["celsius"] == pytest.approx(sim.temperature_c, abs=0.01)
    assert body["temperature"]["throttle_c"] == 43
    assert body["headroom"] == pytest.approx(1 - (43 - sim.temperature_c) / 30, abs=0.001)
    assert body["memory"] == {
        "limit": 4 * 2**30,
        "used": 2**30,
        "available": 3 * 2**30,
        "source": "cgroup-v2",
        "rss": 200 * 2**20,
        "psi": {"some_avg10": 1.5, "full_avg10": 0.0},
    }
    assert body["battery"] == {"percent": 80.0, "plugged": True}
    assert body["lifecycle"] == "foreground"
    assert body["limits"]["variant"] in ("q4", "q4-a8")
    assert set(body) >= {"level", "reason", "forecast", "transitions", "device_killed"}
    assert body["transitions"][-1]["new"] == body["level"]


def test_to_dict_when_no_sensor_then_source_none_and_nulls():
    gov = Governor(usable_cpus=1)
    body = gov.tick().to_dict()
    assert body["temperature"] == {
        "celsius": None,
        "source": "none",
        "sensor": None,
        "throttle_c": None,
        "critical_c": None,
        "pace_setpoint_c": None,
    }
    assert (body["level"], body["reason"], body["headroom"], body["memory"]) == (
        "nominal",
        "no pressure",
        None,
        None,
    )


def test_governor_when_simulated_then_policy_runs_on_simulated_time_and_polls_faster():
    sim, load, _ = make_sim(time_scale=10)
    gov = Governor(thermal=SimulatedThermalSource(sim), poll_s=1.0, usable_cpus=2)
    assert gov.poll_interval_s == pytest.approx(0.1)
    load.run(2, 3)
    assert gov.tick().time == pytest.approx(30.0)


def test_device_killed_and_throttle_delay_when_simulated_device_overheats():
    sim, load, _ = make_sim(start_c=47.9)
    gov = Governor(thermal=SimulatedThermalSource(sim), usable_cpus=2)
    assert gov.throttle_delay(0.1) == pytest.approx(0.1 * 0.25 * 4.9)
    load.run(2, 5)
    assert gov.device_killed
    assert gov.tick().to_dict()["device_killed"] is True
    real = Governor(thermal=FakeSensor(90.0), usable_cpus=2)
    assert real.throttle_delay(0.1) == 0.0 and not real.device_killed


def test_enforce_false_when_hot_then_level_reported_but_nominal_limits():
    gov, sensor, _ = make_governor(enforce=False)
    sensor.celsius = 45.0
    snap = gov.tick()
    assert snap.level == "critical"
    assert not snap.limits.pause_running and snap.limits.threads == 2
    assert snap.to_dict()["enforced"] is False


def test_start_stop_when_thread_runs_then_polls_and_stops_promptly():
    sensor = FakeSensor(30.0)
    gov = Governor(thermal=sensor, usable_cpus=2, poll_s=0.01)
    seen = threading.Event()
    gov.subscribe(lambda snap: seen.set() if snap.level == "critical" else None)
    gov.start()
    try:
        sensor.celsius = 45.0
        assert seen.wait(5)
    finally:
        gov.stop()
    assert gov._thread is None


def test_loading_when_a_model_loads_then_the_budget_holds_through_it_and_the_poll_after():
    # 41.9 C, busy a whole core throughout: paced work before and after, a model load in between
    gov, _, clock = make_governor(FakeSensor(41.9, critical_c=48.0), read_load=lambda: 1.0)
    gov.tick()
    clock.advance(1)
    before = gov.tick().limits.cpu_budget_cores
    held = []
    with gov.loading():
        for _ in range(5):
            clock.advance(1)
            held.append(gov.tick().limits.cpu_budget_cores)
    clock.advance(1)
    held.append(gov.tick().limits.cpu_budget_cores)  # its CPU reading still holds the load's tail
    assert held == [before] * 6
    clock.advance(1)
    e = 1 - PolicyConfig().pace_margin_c / 30 - (1 - 1.1 / 30)
    assert gov.tick().limits.cpu_budget_cores == pytest.approx(before + 0.15 * e * 1.0)


def test_models_loaded_when_hot_then_the_rung_waits_on_the_loaded_model_until_the_device_cools(caplog):
    """Past T_throttle a move that must load a model waits: the rung stays on the loaded bigger model (paced
    by the same budget) and moves once the device is below T_throttle again. What is loaded reaches the
    limits at once, without a new reading."""
    two = build_ladder([("big", "q4", 0.02, 0.99, 300), ("small", "q4", 0.005, 0.9, 90)])
    gov, sensor, clock = make_governor(FakeSensor(44.0, critical_c=48.0), ladder=two)
    assert gov.tick().limits.model_id == "small"  # serious; nothing loaded yet: the level's rung loads
    with caplog.at_level(logging.INFO, logger="simmer.governor"):
        snap = gov.models_loaded(frozenset({"big"}))
    assert snap.time == 1000.0 and (snap.limits.model_id, snap.limits.rung_held) == ("big", True)
    assert "held on a loaded model while the device cools" in caplog.text
    clock.advance(60)
    assert gov.tick().limits.model_id == "big"  # still past T_throttle
    sensor.celsius = 42.0  # below T_throttle, still serious
    clock.advance(60)
    snap = gov.tick()
    assert snap.level == "serious" and (snap.limits.model_id, snap.limits.rung_held) == ("small", False)


def test_models_loaded_when_not_enforced_then_nothing_is_held():
    two = build_ladder([("big", "q4", 0.02, 0.99, 300), ("small", "q4", 0.005, 0.9, 90)])
    gov, _, _ = make_governor(FakeSensor(44.0, critical_c=48.0), ladder=two, enforce=False)
    gov.tick()
    assert not gov.models_loaded(frozenset({"big"})).limits.rung_held


def test_models_loaded_when_the_device_hovers_at_t_throttle_then_the_held_rung_does_not_flip():
    two = build_ladder([("big", "q4", 0.02, 0.99, 300), ("small", "q4", 0.005, 0.9, 90)])
    gov, sensor, clock = make_governor(FakeSensor(43.1, critical_c=48.0), ladder=two)
    gov.tick()
    gov.models_loaded(frozenset({"big"}))
    rungs = []
    # a fine sensor within half the pace's margin (0.1 C) of T_throttle, the forecast flat
    for celsius in [42.97, 43.0, 42.96, 42.99, 42.97, 42.96]:
        sensor.celsius = celsius
        clock.advance(1)
        rungs.append(gov.tick().limits.model_id)
    assert rungs == ["big"] * 6
    sensor.celsius = 42.9  # where the pace holds it: the waiting load gets its turn
    clock.advance(60)  # the forecast's window holds only 42.9 C now
    assert gov.tick().limits.model_id == "small"


def swing(gov: Governor, sensor: FakeSensor, clock: FakeClock, seconds: int) -> tuple[list[int], list[int]]:
    """A device between 40.8 and 39.4 C, two seconds each (the P term alone puts the budget either side of
    one core): the threads the limits name each second, and the seconds at which they changed."""
    threads, changes = [], []
    for second in range(seconds):
        sensor.celsius = 40.8 if second % 4 < 2 else 39.4
        clock.advance(1)
        threads.append(gov.tick().limits.threads)
        if len(threads) > 1 and threads[-1] != threads[-2]:
            changes.append(second)
    return threads, changes


def test_tick_when_the_budget_swings_across_one_core_then_threads_change_once_per_config_dwell():
    """Without a dwell the session would be rebuilt every other poll; once the threads changed, the
    configuration stays config_dwell_s (20 s)."""
    gov, sensor, clock = make_governor(FakeSensor(39.4, critical_c=48.0), read_load=lambda: 0.0)
    threads, changes = swing(gov, sensor, clock, 60)
    assert {1, 2} <= set(threads)  # the budget does cross the boundary
    assert len(changes) >= 2 and all(b - a >= 20 for a, b in itertools.pairwise(changes))
    free, _, _ = make_governor(
        sensor, clock=clock, read_load=lambda: 0.0, config=PolicyConfig(config_dwell_s=0)
    )
    assert len(swing(free, sensor, clock, 60)[1]) > 10  # what the dwell prevents


def test_tick_when_a_build_took_long_then_a_thread_change_holds_ten_times_as_long():
    """A session build of 5 s (the governor's clock: a simulated device's seconds) makes the dwell 50 s,
    not 20: the time spent building stays under a tenth."""
    gov, sensor, clock = make_governor(FakeSensor(39.4, critical_c=48.0), read_load=lambda: 0.0)
    with gov.loading():
        clock.advance(5)
    changes = swing(gov, sensor, clock, 150)[1]
    assert len(changes) >= 2 and all(b - a >= 50 for a, b in itertools.pairwise(changes))
