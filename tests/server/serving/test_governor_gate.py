"""The worker's Gate over a real Governor: device throttling, kills, limits only when they change; and the
memory tier a served folder starts on."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import fields

import pytest

from governor.governor import Governor
from governor.limits import ConfigCost, Limits, build_ladder, make_table
from governor.policy import PolicyConfig
from governor.sensors import SimulatedThermalSource
from governor.thermal_sim import ThermalSimulator, get_profile
from models.errors import Cancelled, DeviceOverheated
from models.protocol import EngineLimits
from models.types import CancelToken
from server.launch import gate_for
from server.refusals import DevicePaused
from server.serving.cost_meter import CostMeter
from server.serving.governor_gate import GovernorGate, decide_step, to_engine_limits
from server.serving.model_setup import serve_folders
from tests.server.conftest import make_settings


class FrozenClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sim_gate(start_c: float, *, enforce: bool = False) -> tuple[GovernorGate, list[float], FrozenClock]:
    """A gate on the phone-heatwave simulator held at start_c (its clock only moves when the test says)."""
    clock = FrozenClock()
    sim = ThermalSimulator(
        get_profile("phone-heatwave"), clock=clock, cpu_time_fn=lambda: 0.0, max_cores=2, start_c=start_c
    )
    slept: list[float] = []
    gate = GovernorGate(
        Governor(thermal=SimulatedThermalSource(sim), enforce=enforce),
        pause_timeout_s=0.2,
        sleep=slept.append,
    )
    return gate, slept, clock


def test_before_step_when_device_above_throttle_then_idles_a_multiple_of_the_pass():
    gate, slept, _ = sim_gate(45.0)  # s = 1 + 0.25 * (45 - 43) = 1.5: idle half of each pass
    cancel = CancelToken()
    gate.before_job(cancel, time.monotonic())
    gate.before_step(cancel)  # the first step has no pass before it
    assert slept == []
    t0 = time.monotonic()
    time.sleep(0.02)  # "the forward pass"
    gate.before_step(cancel)
    pass_s = time.monotonic() - t0
    assert len(slept) == 1
    assert 0.5 * 0.02 <= slept[0] <= 0.5 * pass_s + 1e-6
    assert gate.throttled_seconds == pytest.approx(slept[0])


def test_before_step_when_device_cool_then_no_idle():
    gate, slept, _ = sim_gate(38.0)
    cancel = CancelToken()
    gate.before_job(cancel, time.monotonic())
    gate.before_step(cancel)
    time.sleep(0.01)
    gate.before_step(cancel)
    assert slept == []


def test_before_job_when_device_killed_then_device_overheated_until_it_cools():
    gate, _, clock = sim_gate(48.5)
    clock.now += 0.001  # one step of physics: T >= T_critical kills the app
    assert gate.governor.device_killed
    with pytest.raises(DeviceOverheated, match="overheated"):
        gate.before_job(CancelToken(), time.monotonic())
    with pytest.raises(DeviceOverheated):
        gate.before_step(CancelToken())
    clock.now += 600  # ten idle minutes: back below T_throttle
    assert not gate.governor.device_killed
    assert gate.before_job(CancelToken(), time.monotonic()) is not None


def test_before_step_when_limits_unchanged_then_none_and_changed_then_new_limits():
    gov = Governor(usable_cpus=4, config=PolicyConfig(background_action="low_priority"))
    gate = GovernorGate(gov)
    cancel = CancelToken()
    first = gate.before_job(cancel, time.monotonic())
    assert first is not None and first.threads == 4
    assert gate.before_step(cancel) is None
    gov.set_lifecycle("background")  # low priority: serious limits, no pause
    changed = gate.before_step(cancel)
    assert changed is not None and changed.threads == 1 and changed.max_tokens == 512
    assert gate.before_step(cancel) is None


def test_before_job_when_paused_then_times_out_from_enqueue_with_device_paused():
    gov = Governor()
    gov.set_lifecycle("background")
    gate = GovernorGate(gov, pause_timeout_s=0.3)
    enqueued = time.monotonic() - 0.2  # already waited 0.2 s in the queue
    t0 = time.monotonic()
    with pytest.raises(DevicePaused, match="did not resume"):
        gate.before_job(CancelToken(), enqueued)
    assert time.monotonic() - t0 < 0.25  # only the rest of its 0.3 s


def test_before_step_when_paused_and_client_leaves_then_cancelled_at_once():
    gov = Governor()
    gate = GovernorGate(gov, pause_timeout_s=30)
    cancel = CancelToken()
    gate.before_job(cancel, time.monotonic())
    gov.set_lifecycle("background")

    threading.Timer(0.1, cancel.cancel).start()
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        gate.before_step(cancel)
    assert time.monotonic() - t0 < 2


# -- the meter: what a step of each configuration really costs ----------------------------------------------
def test_cost_meter_when_steps_then_median_cpu_and_speed_published_every_n_steps():
    meter = CostMeter(window=8, publish_every=4)
    steps = [(0.010, 0.011), (0.011, 0.012), (0.300, 0.150), (0.010, 0.011)]  # a prefill chunk among them
    got = [meter.step("q4-a8", 1, False, cpu, wall) for cpu, wall in steps]
    assert got[:3] == [None, None, None]
    assert got[3] == ConfigCost("q4-a8", 1, False, pytest.approx(0.0105), pytest.approx(1 / 0.0115))
    assert [meter.step("q4-a8", 1, False, 0.012, 0.013) for _ in range(3)] == [None] * 3
    assert meter.step("q4-a8", 1, False, 0.012, 0.013).cpu_s_per_token == pytest.approx(0.012)


def test_cost_meter_when_configurations_then_each_its_own():
    meter = CostMeter(window=8, publish_every=2)
    meter.step("v", 2, True, 0.024, 0.012)
    meter.step("v", 2, False, 0.020, 0.015)
    meter.step("v", 2, False, 0.040, 0.030, model_id="other")  # another model's variant of the same name
    spinning = meter.step("v", 2, True, 0.024, 0.012)
    quiet = meter.step("v", 2, False, 0.020, 0.015)
    theirs = meter.step("v", 2, False, 0.040, 0.030, model_id="other")
    assert (spinning.cpu_s_per_token, spinning.tok_s) == (pytest.approx(0.024), pytest.approx(1 / 0.012))
    assert (quiet.cpu_s_per_token, quiet.tok_s) == (pytest.approx(0.020), pytest.approx(1 / 0.015))
    assert (theirs.model_id, theirs.cpu_s_per_token) == ("other", pytest.approx(0.040))


@pytest.mark.parametrize(
    ("passes", "published"),
    [
        # (tokens the pass made, process CPU s, wall s) -> (rows, CPU s per token, tokens per wall second)
        ([(1, 0.020, 0.010)] * 4, [(1, 0.020, 100.0)]),
        ([(4, 0.040, 0.020)] * 4, [(4, 0.010, 200.0)]),  # 4 rows: each token half the CPU, twice as fast
        ([(2, 0.030, 0.016)] * 3 + [(0, 0.300, 0.150)], []),  # a prefill chunk makes no token: not a pass
        ([(1, 0.02, 0.01), (3, 0.03, 0.012)] * 4, [(1, 0.02, 100.0), (3, 0.01, 250.0)]),  # each size its own
    ],
)
def test_cost_meter_when_batches_of_several_sizes_then_each_size_published_per_token(passes, published):
    meter = CostMeter(window=8, publish_every=4)
    got = [meter.step("q4-a8", 2, False, cpu, wall, model_id="m", tokens=k) for k, cpu, wall in passes]
    costs = [c for c in got if c is not None]
    assert [(c.rows, c.cpu_s_per_token, c.tok_s) for c in costs] == [
        (rows, pytest.approx(cpu), pytest.approx(tok_s)) for rows, cpu, tok_s in published
    ]
    assert [(c.rows, c.cpu_s_per_token) for c in meter.table()] == [
        (rows, pytest.approx(cpu)) for rows, cpu, _ in published
    ]


@pytest.mark.parametrize(
    ("tokens", "pass_s", "idle"),
    [(1, 0.05, 0.05), (4, 0.05, 0.35), (0, 0.05, 0.0), (4, 0.5, 0.0)],  # a 10 tokens/s pace
)
def test_decide_step_when_a_pass_makes_several_tokens_then_the_pace_idles_for_all_of_them(
    tokens, pass_s, idle
):
    gov_limits = Governor(table=make_table({"nominal": {"tokens_per_second": 10.0}})).limits
    decision = decide_step(
        gov_limits,
        pass_s=pass_s,
        throttle_s=0.0,
        killed=False,
        enforce=True,
        new_job=False,
        applied=None,
        tokens=tokens,
    )
    assert decision.idle_s == pytest.approx(idle)


def test_decide_step_when_only_the_pace_moves_then_no_new_limits_for_the_engine():
    """The pace controller moves the pace a little on every poll: the gate idles for the pace of now, and
    the engine, which is not told the pace, gets no new limits (a new limit is a log line and a
    placement)."""
    held = Limits(threads=1, tokens_per_second=11.0, spin=False)
    now = Limits(threads=1, tokens_per_second=10.0, spin=False)
    decision = decide_step(
        now,
        pass_s=0.02,
        throttle_s=0.0,
        killed=False,
        enforce=True,
        new_job=False,
        applied=to_engine_limits(held),
    )
    assert decision.limits is None
    assert decision.idle_s == pytest.approx(0.08)


def test_before_step_when_the_batch_grows_then_the_governor_paces_more_tokens_for_the_same_cpu():
    """One core of budget: one reply at 20 ms of CPU a token is paced to 50 tokens/s; four replies a pass at
    40 ms of CPU a pass (10 ms a token) to 100, and the gate idles for the pass's four tokens."""
    cpu = [0.0]
    gov = Governor(
        usable_cpus=2,
        ladder=build_ladder([("m", "q4-a8", 0.03, 1.0, 1, 2, 60.0)]),
        table=make_table({"nominal": {"cpu_budget_cores": 1.0}}),
    )
    slept: list[float] = []
    gate = GovernorGate(
        gov, cpu_time=lambda: cpu[0], meter=CostMeter(window=8, publish_every=4), sleep=slept.append
    )
    gov.tick()
    cancel = CancelToken()
    gate.before_job(cancel, time.monotonic())
    gate.before_step(cancel)
    for _ in range(4):
        cpu[0] += 0.020
        gate.before_step(cancel)
    gov.tick()
    assert gov.limits.tokens_per_second == pytest.approx(50.0)
    for _ in range(4):
        gate.note_pass(4)
        cpu[0] += 0.040
        gate.before_step(cancel)
    gov.tick()
    assert gov.limits.tokens_per_second == pytest.approx(100.0)
    (cost,) = gov.costs
    assert (cost.rows, cost.cpu_s_per_token) == (4, pytest.approx(0.010))
    slept.clear()
    gate.before_step(cancel)  # the engine now runs with the new pace
    gate.note_pass(4)
    gate.before_step(cancel)
    assert slept and 0.03 < slept[-1] <= 4 / 100.0  # four tokens' worth of the pace, less the pass


def test_before_step_when_paced_then_the_gate_idles_the_rest_of_one_over_the_pace():
    gov = Governor(usable_cpus=1, table=make_table({"nominal": {"tokens_per_second": 1.0}}))
    slept: list[float] = []
    gate = GovernorGate(gov, sleep=slept.append)
    cancel = CancelToken()
    told = gate.before_job(cancel, time.monotonic())
    assert told is not None and told.spin is False  # the engine hears of the pace only: pools quiet
    gate.before_step(cancel)
    time.sleep(0.01)  # "the forward pass"
    gate.before_step(cancel)
    assert len(slept) == 1
    assert 0.5 < slept[0] < 1.0 - 0.01  # the pass (>= 10 ms) plus the idle: 1 s


def test_before_step_when_running_then_the_meter_tells_the_governor_the_configurations_cost():
    cpu = [0.0]
    gov = Governor(usable_cpus=2, ladder=build_ladder([("m", "q4-a8", 0.03, 1.0, 1, 2, 60.0)]))
    gate = GovernorGate(gov, cpu_time=lambda: cpu[0], meter=CostMeter(window=8, publish_every=4), spin="auto")
    gov.tick()
    cancel = CancelToken()
    limits = gate.before_job(cancel, time.monotonic())
    assert (limits.model_id, limits.variant, limits.threads, limits.spin) == ("m", "q4-a8", 2, None)
    gate.before_step(cancel)
    for _ in range(4):
        cpu[0] += 0.025  # 25 ms of process CPU per token
        gate.before_step(cancel)
    (cost,) = gov.costs
    # unpaced under auto: spinning; keyed by the model too (another model's "q4-a8" is another cost)
    assert (cost.model_id, cost.variant, cost.threads, cost.spinning) == ("m", "q4-a8", 2, True)
    assert cost.cpu_s_per_token == pytest.approx(0.025)


def test_before_job_when_paced_by_budget_alone_then_the_governor_says_no_spinning():
    """No cost known yet (no ladder): the gate idles by the CPU budget (pace_delay) with no tokens/s pace;
    the governor says the pools do not spin (the engine's sessions follow:
    tests/models/runtime/test_engine.py)."""
    cpu = [0.0]
    gov = Governor(
        usable_cpus=2, table=make_table({"nominal": {"cpu_budget_cores": 1.0, "thread_fraction": 1.0}})
    )
    slept: list[float] = []
    gate = GovernorGate(
        gov, cpu_time=lambda: cpu[0], meter=CostMeter(window=8, publish_every=4), sleep=slept.append
    )
    gov.tick()
    cancel = CancelToken()
    limits = gate.before_job(cancel, time.monotonic())
    assert gov.limits.tokens_per_second is None and (limits.spin, limits.threads) == (False, 2)
    assert limits.variant is None  # no ladder: the meter has no configuration to key (nothing measured)
    gate.before_step(cancel)
    time.sleep(0.005)
    gate.before_step(cancel)
    assert slept and slept[0] > 0  # pace_delay: two busy threads on a one-core budget idle a pass


def test_measure_when_the_governor_says_no_spinning_then_the_cost_is_a_quiet_pools():
    from models.protocol import EngineLimits

    cpu = [0.0]
    gov = Governor(usable_cpus=2)
    gate = GovernorGate(gov, cpu_time=lambda: cpu[0], meter=CostMeter(window=8, publish_every=4), spin="auto")
    gate._applied = EngineLimits(threads=2, variant="q4-a8", model_id="m", spin=False)  # a budget, no pace
    for _ in range(5):
        gate._measure(0.025, 0.0125)
    (cost,) = gov.costs
    assert (cost.threads, cost.spinning) == (2, False)
    gate.meter = CostMeter(window=8, publish_every=4)
    gov.costs = ()
    gate._applied = EngineLimits(threads=2, variant="q4-a8", model_id="m")  # unpaced: auto spins
    for _ in range(5):
        gate._measure(0.025, 0.0125)
    assert gov.costs[0].spinning is True


# -- a model load: the pace controller credits none of it ---------------------------------------------------
def test_pool_load_when_served_with_a_governor_then_the_pace_controller_credits_none_of_it(
    tmp_path, tiny_model_dir
):
    from server.app import create_app
    from tests.governor.fakes import FakeClock, FakeSensor

    clock = FakeClock()
    # warm (41.9 C) and a whole core busy: outside a load, every poll would move the pace's integral
    gov = Governor(
        thermal=FakeSensor(41.9, critical_c=48.0), clock=clock, usable_cpus=2, read_load=lambda: 1.0
    )
    gate = GovernorGate(gov)
    settings = make_settings(tmp_path, thermal_source="none", memory_budget_mb=1024, context_length=128)
    served = serve_folders(settings, [tiny_model_dir])
    create_app(settings, served=served, governor=gate)  # wires the pool's loads to the governor
    opener, during = served.pool.opener, []

    def slow_open(entry, variant, limits):  # the load takes 3 s, and the governor polls in the middle of it
        clock.advance(3)
        during.append(gov.tick().limits.cpu_budget_cores)
        return opener(entry, variant, limits)

    served.pool.opener = slow_open
    gov.tick()
    for _ in range(2):  # every load, not only the first
        clock.advance(1)
        before = gov.tick().limits.cpu_budget_cores
        served.pool.acquire(served.default_model)
        served.pool.release(served.default_model, 0)  # keep_alive 0: unloaded, the next acquire loads
        assert during[-1] == before
        clock.advance(1)
        assert gov.tick().limits.cpu_budget_cores == before  # the first poll after still holds
        clock.advance(1)
        assert gov.tick().limits.cpu_budget_cores > before
    assert served.pool.loads == 2


# -- the memory tier, through a live server ----------------------------------------------------------------
def wait_started(srv):
    with srv.client() as c:
        for _ in range(500):
            health = c.get("/health")
            if health.json()["status"] != "loading":
                return health
            time.sleep(0.02)
    return health


def test_server_when_budget_too_small_then_refuses_to_load_with_the_numbers(live, tmp_path, tiny_model_dir):
    settings = make_settings(tmp_path, thermal_source="none", memory_budget_mb=8)
    served = serve_folders(settings, [tiny_model_dir])
    srv = live(served=served, governor=gate_for(settings, served), thermal_source="none", memory_budget_mb=8)
    health = wait_started(srv)
    assert health.status_code == 503
    error = health.json()["error"]
    assert "budget of 8 MiB" in error and "Nothing was unloaded" in error


def test_server_when_budget_fits_then_loads_start_rung_and_ladder(live, tmp_path, tiny_model_dir):
    overrides = {"thermal_source": "none", "memory_budget_mb": 1024, "context_length": 128}
    settings = make_settings(tmp_path, **overrides)
    served = serve_folders(settings, [tiny_model_dir])
    srv = live(served=served, governor=gate_for(settings, served), **overrides)
    manifest = json.loads((tiny_model_dir / "manifest.json").read_text())
    assert wait_started(srv).status_code == 200
    with srv.client() as c:
        body = c.get("/v1/thermal").json()
    assert body["variant"] == body["limits"]["variant"] == manifest["default_variant"]  # q4-a8: nominal
    assert body["model"] == manifest["id"]
    assert [r["model"] for r in body["ladder"]] == [manifest["id"]] * len(body["ladder"])
    assert body["ladder"][0]["current"]


def test_session_rebuilt_for_a_thread_change_when_governed_then_the_pace_credits_none_and_no_load_heat(
    tmp_path, tiny_model_dir
):
    """A loaded engine that builds another session (here: the pace's one thread) spends a load's CPU inside
    a reply: the pace holds its integral through it, as through a load, and the heat of that build is not
    the model's load heat (a load is more: the weights come in too)."""
    from models.protocol import EngineLimits
    from server.app import create_app
    from tests.governor.fakes import FakeClock, FakeSensor

    clock = FakeClock()
    sensor = FakeSensor(41.9, critical_c=48.0)
    gov = Governor(thermal=sensor, clock=clock, usable_cpus=2, read_load=lambda: 1.0)
    gate = GovernorGate(gov)
    settings = make_settings(tmp_path, thermal_source="none", memory_budget_mb=1024, context_length=128)
    served = serve_folders(settings, [tiny_model_dir])
    create_app(settings, served=served, governor=gate)
    gov.tick()
    engine = served.pool.acquire(served.default_model)
    device = gov._device(sensor.read())
    assert gov.load_heat.rises(device) == {served.default_model: 0.0}
    build, during = engine._build_session, []

    def slow_build(spinning):  # 3 s of building, 0.5 C warmer after it, a poll in the middle
        clock.advance(3)
        during.append(gov.tick().limits.cpu_budget_cores)
        sensor.celsius += 0.5
        return build(spinning)

    engine._build_session = slow_build
    clock.advance(1)
    before = gov.tick().limits.cpu_budget_cores
    integral = gov._state.pace_integral
    engine.apply_limits(EngineLimits(threads=1 if engine.threads != 1 else 2))
    engine.session()
    assert during == [before]
    clock.advance(1)
    assert gov.tick().limits.cpu_budget_cores < before  # 0.5 C warmer: the proportional term answers
    assert gov._state.pace_integral == integral  # the first poll after the build holds it too
    clock.advance(1)
    gov.tick()
    assert gov._state.pace_integral > integral  # paced work again, below the setpoint: credit
    assert gov.load_heat.rises(device) == {served.default_model: 0.0}
    served.pool.release(served.default_model, 0)


def test_engine_limits_when_built_from_limits_then_every_field_is_the_governors_own():
    """A lever is one field on Limits and one on EngineLimits, of the same name: the engine's limits carry
    every such field's value, whatever it is. The pace is not one: the gate holds it (the engine hears only
    that its pools do not spin)."""
    values = {"threads": 3, "variant": "q4", "context_cap": 512, "max_tokens": 64}
    limits = Limits(**values, tokens_per_second=7.5, spin=False, model_id="m")
    engine = to_engine_limits(limits)
    assert {f.name for f in fields(EngineLimits)} <= {f.name for f in fields(Limits)}
    assert engine == EngineLimits(**values, spin=False, model_id="m")


def test_generate_when_the_governor_paces_then_only_the_gate_waits_for_the_pace(tiny_model_dir):
    """The pace has one owner: a reply of the real engine under the real gate, whose sleep only records.
    The gate idles the pace's whole rest after every pass, and the reply takes no more wall time than its
    work: had the engine slept for the pace on its own, the reply would take the pace in wall time."""
    from models.types import FinishEvent, GenerationParams, SamplingParams, TokenEvent
    from tests.helpers import tiny_engine

    pace, n = 10.0, 20  # n tokens at the pace: about two seconds
    slept: list[float] = []
    gate = GovernorGate(
        Governor(usable_cpus=1, table=make_table({"nominal": {"tokens_per_second": pace}})),
        sleep=slept.append,
    )
    engine = tiny_engine(tiny_model_dir, speculation="off")
    cancel = CancelToken()
    limits = gate.before_job(cancel, time.monotonic())
    assert limits is not None
    engine.apply_limits(limits)
    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True)
    t0 = time.monotonic()
    events = list(
        engine.generate(
            engine.text_prompt("once upon a time"),
            params,
            cancel=cancel,
            step_hook=lambda: gate.before_step(cancel),
        )
    )
    wall = time.monotonic() - t0
    assert sum(isinstance(e, TokenEvent) for e in events) == n and isinstance(events[-1], FinishEvent)
    # an idle after every pass but the last (a token each; the prompt's one chunk counts as one too)
    assert len(slept) >= n - 1
    assert all(1 / pace - wall < s <= 1 / pace for s in slept)  # the rest of 1 / pace after a pass
    assert wall < 0.5 * (n - 1) / pace  # no other wait: the pace would be ~1.9 s of wall time


def test_pace_gate_when_a_reply_runs_then_it_comes_at_the_pace(tiny_model_dir):
    """The tests' pacing gate (tests/server/fakes.py PaceGate), which slows the tiny model where a test needs
    a reply to last, holds the pace with the real gate's rule: a reply of n tokens takes at least n - 1
    intervals of 1 / pace (a lower bound only: a loaded machine is slower, never faster)."""
    from models.types import GenerationParams, SamplingParams, TokenEvent
    from tests.helpers import tiny_engine
    from tests.server.fakes import PaceGate

    pace, n = 50.0, 10
    gate = PaceGate(pace)
    engine = tiny_engine(tiny_model_dir, speculation="off")
    cancel = CancelToken()
    gate.before_job(cancel, time.monotonic())
    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True)
    t0 = time.monotonic()
    events = engine.generate(
        engine.text_prompt("once upon a time"),
        params,
        cancel=cancel,
        step_hook=lambda: gate.before_step(cancel),
    )
    assert sum(isinstance(e, TokenEvent) for e in events) == n
    assert time.monotonic() - t0 >= (n - 1) / pace
    assert len(gate.idled) >= n - 1
