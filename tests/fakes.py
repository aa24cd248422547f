"""Fakes shared across test packages (they plug into real seams; no mocks)."""

from __future__ import annotations

import threading
import time


class ScriptedCPU:
    """A process CPU-time counter (the simulator's cpu_time_fn): `busy` cores working since the last
    change, in wall time. The test switches the load; the simulator's physics do the rest."""

    def __init__(self) -> None:
        self.busy = 0.0
        self._lock = threading.Lock()
        self._t = time.monotonic()
        self._cpu = 0.0

    def __call__(self) -> float:
        with self._lock:
            now = time.monotonic()
            self._cpu += self.busy * (now - self._t)
            self._t = now
            return self._cpu

    def set(self, busy: float) -> None:
        self()
        self.busy = busy
