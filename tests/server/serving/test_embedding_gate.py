"""The governor's gate around an embedding job's batches (Gate.before_batch, embedding.gated_step): paused,
idled for the device and the CPU budget, failed when a pause outlasts its timeout, and never taking the
limits meant for the generation engine."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from governor.governor import Governor
from governor.limits import Limits
from governor.policy import PolicyConfig
from governor.sensors import SimulatedThermalSource
from governor.thermal_sim import ThermalSimulator, get_profile
from models.errors import Cancelled
from models.types import CancelToken
from server.refusals import DevicePaused
from server.serving.contracts import NoGate
from server.serving.embedding import EmbedJob, EncoderShelf, gated_step
from server.serving.events import Failed
from server.serving.governor_gate import GovernorGate, decide_batch


def sim_gate(start_c: float) -> tuple[GovernorGate, list[float]]:
    """A gate on the phone-heatwave simulator held at start_c (its clock does not move): above 43 C the
    device's own throttling idles a multiple of each pass (tests/server/serving/test_governor_gate.py)."""
    sim = ThermalSimulator(
        get_profile("phone-heatwave"),
        clock=lambda: 100.0,
        cpu_time_fn=lambda: 0.0,
        max_cores=2,
        start_c=start_c,
    )
    slept: list[float] = []
    gate = GovernorGate(
        Governor(thermal=SimulatedThermalSource(sim)), pause_timeout_s=0.2, sleep=slept.append
    )
    return gate, slept


def test_before_batch_when_limits_change_then_the_generation_engine_still_gets_them():
    gov = Governor(usable_cpus=4, config=PolicyConfig(background_action="low_priority"))
    gate = GovernorGate(gov)
    cancel = CancelToken()
    first = gate.before_job(cancel, time.monotonic())
    assert first is not None and first.threads == 4
    gov.set_lifecycle("background")  # low priority: serious limits, no pause
    gate.before_batch(CancelToken(), time.monotonic(), None)  # an embedding batch runs between jobs
    gate.before_batch(CancelToken(), time.monotonic(), 0.01)
    changed = gate.before_step(cancel)
    assert changed is not None and changed.threads == 1


def test_before_batch_when_paused_then_the_first_batch_times_out_from_enqueue():
    gov = Governor()
    gov.set_lifecycle("background")  # pauses new and running work
    gate = GovernorGate(gov, pause_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(DevicePaused, match="did not resume"):
        gate.before_batch(CancelToken(), time.monotonic() - 0.2, None)  # already 0.2 s in the queue
    assert time.monotonic() - t0 < 0.25  # only the rest of its 0.3 s


def test_before_batch_when_paused_mid_job_and_client_leaves_then_cancelled():
    gov = Governor()
    gov.set_lifecycle("background")
    gate = GovernorGate(gov, pause_timeout_s=30)
    cancel = CancelToken()
    cancel.cancel()
    with pytest.raises(Cancelled):
        gate.before_batch(cancel, time.monotonic(), 0.01)


def test_before_batch_when_device_throttles_then_idles_a_multiple_of_the_pass():
    gate, slept = sim_gate(45.0)  # s = 1 + 0.25 * (45 - 43) = 1.5: idle half of each pass
    gate.before_batch(CancelToken(), time.monotonic(), None)
    assert slept == []  # no pass before the first batch
    gate.before_batch(CancelToken(), time.monotonic(), 0.02)
    assert slept == [pytest.approx(0.01)]


def test_decide_batch_when_a_cpu_budget_and_a_token_pace_then_the_budget_idles_and_no_limits():
    limits = Limits(threads=1, cpu_budget_cores=0.5, tokens_per_second=10.0, spin=False)
    decision = decide_batch(limits, pass_s=0.02, throttle_s=0.0, killed=False, enforce=True)
    assert decision.idle_s == pytest.approx(0.02)  # one core busy on half a core's budget: idle as long
    assert decision.limits is None
    assert not decide_batch(limits, pass_s=0.02, throttle_s=0.0, killed=False, enforce=False).idle_s
    assert not decide_batch(limits, pass_s=None, throttle_s=0.0, killed=False, enforce=True).idle_s


class PausedGate(NoGate):
    def before_batch(self, cancel: CancelToken, enqueued_at: float, pass_s: float | None) -> None:
        raise DevicePaused("paused")


def test_gated_step_when_the_gate_refuses_then_the_job_fails_without_a_pass():
    got: list = []
    job = EmbedJob(id="e", model_id="m", path=Path("/nonexistent"), inputs=["a"], sink=got.append)
    assert gated_step(job, EncoderShelf(), PausedGate()) is True
    (item,) = got
    assert isinstance(item, Failed) and isinstance(item.error, DevicePaused)
    assert job.batches_run == 0 and not job.parts


def test_before_batch_when_the_governor_limits_threads_then_it_returns_the_limit():
    gov = Governor(usable_cpus=4, config=PolicyConfig(background_action="low_priority"))
    gate = GovernorGate(gov)
    assert gate.before_batch(CancelToken(), time.monotonic(), None) in (None, 4)  # nominal: all of them
    gov.set_lifecycle("background")  # low priority: one thread
    assert gate.before_batch(CancelToken(), time.monotonic(), 0.01) == 1


class ThreadsGate(NoGate):
    def __init__(self) -> None:
        self.limit: int | None = None

    def before_batch(self, cancel: CancelToken, enqueued_at: float, pass_s: float | None) -> int | None:
        return self.limit


def test_gated_step_when_the_thread_limit_moves_then_the_encoder_is_built_again_with_it(monkeypatch):
    built: list[int] = []

    class CountingEmbedder:
        variant = "f32"

        def __init__(self, folder: Path, threads: int = 1, variant: str | None = None) -> None:
            built.append(threads)

        def tokenize(self, texts, fit=False):
            return [[1, 2] for _ in texts]

        def check(self, rows, param="input", first=0) -> None:
            return None

        def embed(self, rows):
            return np.zeros((len(rows), 4), np.float32)

    monkeypatch.setattr("server.serving.embedding.Embedder", CountingEmbedder)
    folder = Path(__file__).parent  # any folder: its files' sizes are the model's bytes
    shelf, gate, got = EncoderShelf(threads=4), ThreadsGate(), []

    def run(texts: list[str]) -> None:
        job = EmbedJob(id="e", model_id="m", path=folder, inputs=texts, sink=got.append)
        while not gated_step(job, shelf, gate):
            pass

    run(["a", "b"])
    gate.limit = 1  # the governor lowered the threads
    run(["a"])
    run(["b"])  # the same limit: the same session
    gate.limit = 16  # above the setting: the setting's
    run(["c"])
    assert built == [4, 1, 4]
    assert len(got) == 4
