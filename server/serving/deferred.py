"""Heavy work that waits for the governor's leave (governor/background.py) outside the worker: a pull over
/api/pull (its conversion and quality measurement are minutes of every core). It waits on the event loop,
before it takes one of the store's threads or the model's lock, so a waiting pull holds nothing a removal
or another pull needs. The worker's own idle work (the summary) waits in the worker; /v1/thermal lists both.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from governor.governor import Governor
from server.refusals import ShuttingDown

POLL_S = 0.25  # a snapshot read: cheap enough to look this often
# Pulls that may wait at once: a waiting pull outlives its client (as an install does), so without a bound a
# client could leave thousands behind, each a task and a line of /v1/thermal.
MAX_WAITING = 8


class Deferred:
    """What waits now, by name (a thread-safe count: two pulls of one model are two)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: collections.Counter[str] = collections.Counter()

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        with self._lock:
            self._waiting[what] += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting[what] -= 1
                if self._waiting[what] <= 0:
                    del self._waiting[what]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._waiting.elements())

    def full(self) -> bool:
        with self._lock:
            return sum(self._waiting.values()) >= MAX_WAITING


async def wait_for_background(
    governor: Governor | None, deferred: Deferred, what: str, note: Callable[[str], None]
) -> None:
    """Until the governor lets heavy work run; `note(why)` whenever the reason it waits changes. Raises
    ShuttingDown when the governor stops first."""
    if governor is None:
        return
    verdict = governor.snapshot().background
    if verdict.runs:
        return
    said = None
    with deferred.waiting(what):
        while not verdict.runs:
            if governor.stopped:
                raise ShuttingDown(f"The server stopped while {what} waited ({verdict.why})")
            if verdict.why != said:
                note(f"waiting for the device: {verdict.why}")
                said = verdict.why
            await asyncio.sleep(POLL_S)
            verdict = governor.snapshot().background
