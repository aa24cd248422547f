"""Threads with a large stack, where llguidance compiles grammars and computes masks.

Compiling a grammar recurses in native code about as deep as the grammar nests, and a stack overflow there
kills the whole process: no exception reaches Python. The request limits (schema_limits, gbnf) keep that
depth far below what a default thread holds; running the work on threads whose stack is `STACK_BYTES` is the
margin on top, whatever the platform's default (8 MB with glibc, 128 KB with musl, about 1 MB on Android).
The stack is reserved address space: only the pages a compile touches are ever backed by memory.

Why threads and not a worker process (measured on the shared 2-core machine, docs/structured.md): a check on
one of these threads costs what it costs on asyncio's default pool (6.5 ms round trip for a small schema,
350-370 ms for 1,000 properties); a spawned worker process took 1.8 s to start and holds its own
interpreter, and it would only guard the check: the worker thread must still compile the same grammar
in-process, over the model's tokenizer. The bounds make the overflow impossible; the stack is the margin.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

STACK_BYTES = 64 << 20

# threading.stack_size is process-wide: set it only for the moment a thread starts.
_START_LOCK = threading.Lock()


class StackExecutor:
    """A small executor (one or a few threads, started on first use) whose threads have STACK_BYTES of
    stack. Tasks run in submission order."""

    def __init__(self, name: str, workers: int = 1, stack_bytes: int = STACK_BYTES) -> None:
        self.name = name
        self.workers = workers
        self.stack_bytes = stack_bytes
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._start()
        self._tasks.put((lambda: fn(*args, **kwargs), future))
        return future

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on one of the threads and wait for it (from any thread but these)."""
        return self.submit(fn, *args, **kwargs).result()

    def _start(self) -> None:
        with self._lock:
            while len(self._threads) < self.workers:
                thread = threading.Thread(
                    target=self._loop, name=f"{self.name}-{len(self._threads)}", daemon=True
                )
                with _START_LOCK:
                    before = threading.stack_size(self.stack_bytes)
                    try:
                        thread.start()
                    finally:
                        threading.stack_size(before)
                self._threads.append(thread)

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fn, future = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as err:  # the caller gets it from the future
                future.set_exception(err)
            else:
                future.set_result(result)
