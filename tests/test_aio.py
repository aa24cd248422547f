"""tests/aio.run: a coroutine runs from a synchronous test whatever loop the test's thread already runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests import aio

TESTS = Path(__file__).resolve().parent


async def answer() -> int:
    await asyncio.sleep(0)
    return 42


def test_run_when_the_thread_already_runs_a_loop_then_the_coroutine_still_runs() -> None:
    async def under_a_running_loop() -> int:  # as a test finds the main thread after Playwright's sync API
        return aio.run(answer())

    assert aio.run(under_a_running_loop()) == 42


def test_run_when_the_coroutine_raises_then_the_error_reaches_the_test() -> None:
    async def fails() -> None:
        raise ValueError("from the coroutine")

    with pytest.raises(ValueError, match="from the coroutine"):
        aio.run(fails())


def test_tests_when_they_run_a_coroutine_then_through_aio_run() -> None:
    """asyncio.run on the test's own thread passes or fails by which tests ran before it in the process."""
    direct = [
        str(path.relative_to(TESTS))
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "aio.py" and path != Path(__file__).resolve() and "asyncio.run(" in path.read_text()
    ]
    assert direct == []
