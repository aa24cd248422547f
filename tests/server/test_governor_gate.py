"""The worker's Gate over a real Governor: device throttling, kills, limits only when they change; and the
memory tier a served folder starts on."""

from __future__ import annotations

import json
import threading
import time

import pytest

from governor.governor import Governor
from governor.policy import PolicyConfig
from governor.sensors import SimulatedThermalSource
from governor.thermal_sim import ThermalSimulator, get_profile
from models.errors import Cancelled, DeviceOverheated
from models.types import CancelToken
from server.errors import DevicePaused
from server.governor_gate import GovernorGate
from server.serve import gate_for
from server.served import serve_folders
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
