"""The loader thread: builds engines beside the worker (serving/worker.py).

Building a session is not inference: onnxruntime packs every weight when it opens a model (seconds for a 1.5B
one), and on the worker thread that froze every running reply and every job for a model already loaded. The
loader builds one model at a time, on its own thread; what a build gives (an engine, or the error it raised)
waits in `take_done()` until the worker takes it between two passes and puts it in the pool: only building
happens here, the pool and the swap stay the worker's.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("simmer.loader")

T = TypeVar("T")


class Loader(Generic[T]):
    """One thread that runs builds in the order they come, and tells `wake` when one is done."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._cond = threading.Condition()
        self._todo: collections.deque[tuple[str, Callable[[], T]]] = collections.deque()
        self._done: list[tuple[str, T | BaseException]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="simmer-loader", daemon=True)
        self._thread.start()

    def start(self, key: str, build: Callable[[], T]) -> None:
        """Build `key` after the builds already asked for."""
        with self._cond:
            self._todo.append((key, build))
            self._cond.notify()

    def take_done(self) -> list[tuple[str, T | BaseException]]:
        """The builds done since the last call: (key, what it built or the error it raised)."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def has_done(self) -> bool:
        with self._cond:
            return bool(self._done)

    def close(self) -> None:
        """No build starts any more (one running finishes; what it gives is not taken)."""
        with self._cond:
            self._closed = True
            self._todo.clear()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._todo and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                key, build = self._todo.popleft()
            result: T | BaseException
            try:
                result = build()
            except BaseException as err:  # the waiting jobs get it, as they got a load's error on the worker
                log.warning("building %s failed: %s", key, err)
                result = err
            with self._cond:
                self._done.append((key, result))
            self._wake()
