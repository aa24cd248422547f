"""The loader thread: builds run one at a time, in order, off the caller's thread; an error is a result."""

from __future__ import annotations

import threading

from server.serving.loader import Loader


def test_loader_when_builds_queued_then_one_thread_runs_them_in_order_and_errors_are_results():
    woken = threading.Semaphore(0)
    loader: Loader[str] = Loader(woken.release)
    gate, ran = threading.Event(), []

    def build(name: str) -> str:
        gate.wait(10)
        ran.append((name, threading.current_thread().name))
        return name

    def boom() -> str:
        raise RuntimeError("no sessions")

    loader.start("a", lambda: build("a"))
    loader.start("b", boom)
    loader.start("c", lambda: build("c"))
    assert not loader.has_done() and loader.take_done() == []  # the first build holds the thread
    gate.set()
    done = []
    while len(done) < 3:
        assert woken.acquire(timeout=10)
        done += loader.take_done()
    assert [key for key, _ in done] == ["a", "b", "c"]
    assert done[0][1] == "a" and done[2][1] == "c"
    assert isinstance(done[1][1], RuntimeError) and str(done[1][1]) == "no sessions"
    assert {thread for _, thread in ran} == {"simmer-loader"}
    loader.close()
