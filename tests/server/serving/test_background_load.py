"""A model's sessions built beside the worker (serving/loader.py, serving/load_waits.py): a slow fake load
(2 s, through the pool's real opener seam) makes a stall visible by an order of magnitude. Loaded models go
on serving during it; a failing load fails the jobs that waited with the error a load on the worker gave;
two requests for one cold model load it once."""

from __future__ import annotations

import itertools
import threading
import time

import httpx

from models.errors import ModelNotFound
from server.serving.memory_plan import MemoryBudget
from tests.server.serving.helpers import PROMPT

LOAD_S = 2.0


def slow_loads(served, fail: BaseException | None = None) -> tuple[list[str], threading.Event, list[float]]:
    """Every load from now takes LOAD_S (then fails with `fail`, if given): (models opened, set when the
    first load starts, when each load ended)."""
    opener, opened, started, ended = served.pool.opener, [], threading.Event(), []

    def slow(entry, variant, limits):
        opened.append(entry.id)
        started.set()
        time.sleep(LOAD_S)
        try:
            if fail is not None:
                raise fail
            return opener(entry, variant, limits)
        finally:
            ended.append(time.monotonic())

    served.pool.opener = slow
    return opened, started, ended


def complete(srv, model: str, results: list[httpx.Response]) -> threading.Thread:
    def run() -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        results.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=30))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def timed_stream(srv, model: str, max_tokens: int) -> list[float]:
    """When the request was sent, then when each streamed chunk of text arrived."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    times = [time.monotonic()]
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        times += [time.monotonic() for line in r.iter_lines() if line.startswith("data: {")]
    return times


def test_load_when_another_model_loads_then_a_loaded_model_streams_and_answers_during_it(several):
    srv, served = several()
    opened, started, ended = slow_loads(served)
    cold: list[httpx.Response] = []
    loading = complete(srv, "tiny-big", cold)
    assert started.wait(10)
    times = timed_stream(srv, "tiny-small", 20)
    warm: list[httpx.Response] = []
    complete(srv, "tiny-small", warm).join(10)
    done = time.monotonic()
    assert not ended  # all of it while the other model loaded
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) >= 2 and max(gaps) < LOAD_S / 4, gaps  # the request's wait for its first chunk too
    assert warm[0].status_code == 200 and done < started_at_most(ended, LOAD_S + 30)
    loading.join(30)
    assert cold[0].status_code == 200, cold[0].text
    assert cold[0].json()["model"] == "tiny-big" and opened == ["tiny-big"]


def started_at_most(ended: list[float], wait_s: float) -> float:
    """When the load ended (waiting for it up to wait_s)."""
    deadline = time.monotonic() + wait_s
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    return ended[0]


def test_load_when_two_requests_for_one_cold_model_then_one_load_serves_both(several):
    srv, served = several()
    opened, started, _ = slow_loads(served)
    results: list[httpx.Response] = []
    first = complete(srv, "tiny-big", results)
    assert started.wait(10)
    second = complete(srv, "tiny-big", results)
    first.join(30)
    second.join(30)
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
    assert opened == ["tiny-big"] and served.pool.loads == 2  # the default at start, then tiny-big once


def test_load_when_it_fails_beside_the_worker_then_its_waiting_jobs_get_that_error(several):
    srv, served = several()
    opened, started, _ = slow_loads(
        served, ModelNotFound("The model 'tiny-big' is being deleted", param="model")
    )
    results: list[httpx.Response] = []
    first = complete(srv, "tiny-big", results)
    assert started.wait(10)
    second = complete(srv, "tiny-big", results)
    first.join(30)
    second.join(30)
    assert [r.status_code for r in results] == [404, 404]
    for r in results:
        error = r.json()["error"]
        assert (
            error["code"] == "model_not_found" and error["message"] == "The model 'tiny-big' is being deleted"
        )
    assert opened == ["tiny-big"] and "tiny-big" not in served.pool.loaded_ids()
    ok: list[httpx.Response] = []
    complete(srv, "tiny-small", ok).join(10)
    assert ok[0].status_code == 200  # the worker goes on


def test_load_when_it_fails_with_a_bug_then_500_as_on_the_worker(several):
    srv, served = several()
    slow_loads(served, RuntimeError("sessions could not be built"))
    results: list[httpx.Response] = []
    complete(srv, "tiny-big", results).join(30)
    assert results[0].status_code == 500  # not ours: a generic 500, its traceback logged
    assert results[0].json()["error"]["code"] == "internal_error"
    assert "tiny-big" not in served.pool.loaded_ids() and not served.pool.loaded()["tiny-small"].busy


def test_load_when_memory_holds_one_model_then_two_cold_models_are_served_in_turn(several):
    """Each load must unload the model the other just loaded: the second waits until the first one's job
    is done (as it did when the worker loaded in its turn), rather than unloading it before it served."""
    srv, served = several()
    costs = [
        served.cost(e, e.default_variant).total for e in map(served.catalog.get, ("tiny-big", "tiny-spm"))
    ]
    served.pool.budget = MemoryBudget(max(costs) * 3 // 2, 0)
    opened, started, _ = slow_loads(served)
    results: list[httpx.Response] = []
    first = complete(srv, "tiny-big", results)
    assert started.wait(10)
    second = complete(srv, "tiny-spm", results)
    first.join(30)
    second.join(30)
    assert sorted((r.status_code, r.json()["model"]) for r in results) == [
        (200, "tiny-big"),
        (200, "tiny-spm"),
    ]
    assert opened == ["tiny-big", "tiny-spm"]
