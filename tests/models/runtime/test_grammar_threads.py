"""The grammar threads (models/runtime/grammar_threads.py): their stack is the large one asked for, tasks run
in order, failures come back through the future, and the process-wide default stack size is left alone."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

import pytest

from models.runtime.grammar_threads import STACK_BYTES, StackExecutor


def own_stack_bytes() -> int:
    """The calling thread's stack size, as glibc's pthread_getattr_np reports it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    attr = ctypes.create_string_buffer(128)  # pthread_attr_t is 56 bytes on x86-64 and arm64
    size = ctypes.c_size_t()
    assert libc.pthread_getattr_np(ctypes.c_ulong(threading.get_ident()), attr) == 0
    try:
        assert libc.pthread_attr_getstacksize(attr, ctypes.byref(size)) == 0
    finally:
        libc.pthread_attr_destroy(attr)
    return size.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the stack through glibc")
def test_stack_executor_when_running_then_its_thread_has_the_large_stack() -> None:
    before = threading.stack_size()
    executor = StackExecutor("test-stack")
    assert executor.run(own_stack_bytes) >= STACK_BYTES
    assert threading.stack_size() == before  # other threads start with the default again
    other = threading.Thread(target=lambda: None)
    other.start()
    other.join()


def test_stack_executor_when_tasks_then_in_order_and_errors_through_the_future() -> None:
    executor = StackExecutor("test-order")
    seen: list[int] = []
    futures = [executor.submit(seen.append, i) for i in range(20)]
    for f in futures:
        f.result()
    assert seen == list(range(20))

    def boom() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        executor.run(boom)
    assert executor.run(lambda: 7) == 7  # the thread is still there
