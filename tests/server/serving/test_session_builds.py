"""The governor's new limits never stall a running reply: the session they need (another thread count) is
built beside the worker (server/serving/session_builds.py) while the reply goes on with the limits it has,
and they apply at a token boundary once it is built. A slow fake build (through the engine's real session
seam) makes a stall visible by an order of magnitude; the reply is paced so that it outlives the build."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest

from models.protocol import EngineLimits
from models.types import CancelToken
from server.serving.contracts import NoGate
from tests.server.fakes import PaceGate
from tests.server.serving.helpers import PROMPT

BUILD_S = 1.5
PACE = 25.0  # tokens/s: 60 tokens take 2.4 s, the build 1.5 s of it


class ThreadGate:
    """The governor, through the real seam: at step `after` its limits give the model `threads` threads."""

    memory_pressure = False
    pauses_new = False
    rung = None
    background = NoGate.background

    def __init__(self, threads: int, after: int) -> None:
        self.threads, self.after, self.steps = threads, after, 0

    def subscribe(self, callback) -> None:
        return None

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        return None

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        self.steps += 1
        return EngineLimits(threads=self.threads) if self.steps == self.after else None

    def before_batch(self, cancel: CancelToken, enqueued_at: float, pass_s: float | None) -> None:
        return None

    def note_pass(self, tokens: int) -> None:
        return None

    def note_aside(self, wall_s: float, cpu_s: float) -> None:
        return None


def slow_builds(engine) -> list[int]:
    """Every session `engine` builds from now takes BUILD_S more (the engine's own seam); the thread counts
    built, in order."""
    opened, original = [], engine._open_session

    def slow(variant: str, threads: int, spinning: bool):
        opened.append(threads)
        time.sleep(BUILD_S)
        return original(variant, threads, spinning)

    engine._open_session = slow
    return opened


def timed_stream(srv, max_tokens: int) -> list[float]:
    """When the request was sent, then when each streamed chunk of text arrived."""
    body = {"model": "tiny-small", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    times = [time.monotonic()]
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        times += [time.monotonic() for line in r.iter_lines() if line.startswith("data: {")]
    return times


@pytest.mark.parametrize("max_batch", [4, 1], ids=["batch-loop", "alone"])
def test_threads_when_the_governor_changes_them_mid_reply_then_the_session_is_built_beside_it(
    several, max_batch
) -> None:
    gate = ThreadGate(threads=0, after=10)
    srv, served = several(governor=PaceGate(PACE, gate), max_batch=max_batch, stream_interval_ms=0)
    engine = served.pool.engine("tiny-small")
    assert engine is not None
    gate.threads = 1 if engine.threads != 1 else 2  # another thread count: another session
    opened = slow_builds(engine)
    times = timed_stream(srv, 60)

    gaps = [b - a for a, b in itertools.pairwise(times[1:])]
    assert opened == [gate.threads]  # built once, for the new limits
    assert max(gaps) < BUILD_S / 3, max(gaps)  # no token waited for the build
    assert engine.threads == gate.threads  # the limits applied once it was built, within the reply
    assert served.pool.engine("tiny-small") is engine
    counts = srv.app.state.runtime.worker.session_builds()
    assert counts == {"beside": 1, "inside": 0, "building": False}


def test_threads_when_there_is_no_room_for_a_second_session_then_built_inside_the_reply(several) -> None:
    gate = ThreadGate(threads=0, after=10)  # one reply at a time: its generation builds what it runs on
    srv, served = several(governor=PaceGate(PACE, gate), max_batch=1, stream_interval_ms=0)
    engine = served.pool.engine("tiny-small")
    assert engine is not None
    gate.threads = 1 if engine.threads != 1 else 2
    served.pool.session_room = lambda engine, limits: False  # type: ignore[method-assign]
    opened = slow_builds(engine)
    times = timed_stream(srv, 30)
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]
    assert opened == [gate.threads] and max(gaps) >= BUILD_S * 0.9  # as before: the reply waited
    assert srv.app.state.runtime.worker.placement.builds.inside == 1


def test_threads_when_the_new_session_is_in_use_then_the_one_it_replaced_goes_after_the_reply(several):
    gate = ThreadGate(threads=0, after=10)
    srv, served = several(governor=PaceGate(PACE, gate), max_batch=1, stream_interval_ms=0)
    engine = served.pool.engine("tiny-small")
    assert engine is not None
    gate.threads = 1 if engine.threads != 1 else 2
    dropped: list[float] = []

    def slow_teardown(self) -> None:  # as an onnxruntime session's, which holds the GIL throughout
        time.sleep(BUILD_S)
        dropped.append(time.monotonic())

    old = engine.session()
    old.__class__ = type("SlowTeardown", (type(old),), {"__del__": slow_teardown})
    del old
    times = timed_stream(srv, 60)

    gaps = [b - a for a, b in itertools.pairwise(times[1:])]
    assert engine.threads == gate.threads  # the new session took over within the reply
    assert max(gaps) < BUILD_S / 3, max(gaps)  # and no token waited for the old one's teardown
    deadline = time.monotonic() + 30
    while not dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped and dropped[0] > times[-1]  # dropped once the reply was over, not kept for good
