"""Run a coroutine to completion from a synchronous test, whatever ran before it in this process.

`asyncio.run` refuses to start when the calling thread already has a running event loop, and one may be
left running by an earlier test: Playwright's sync API (the session-scoped `browser` in tests/ui) keeps its
loop marked running on the main thread while Chromium is open. Under pytest-xdist a worker can run a browser
file before any other file, so a test that called `asyncio.run` directly passed or failed by test order.
A fresh thread has no running loop, so `run` behaves the same in any order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(coro) on a fresh thread; its result is returned and its exception raised here."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(coro)
        except BaseException as err:  # re-raised in the test's thread, assertion errors included
            outcome["error"] = err

    thread = threading.Thread(target=target, name="tests.aio.run")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
