"""What an emulated CPU cannot show, detected on the machine the tests run on (never assumed from the
architecture): a test that depends on it is skipped with the reason, not failed and not silently passed."""

from __future__ import annotations

import functools
import mmap

import psutil
import pytest

_PROBE_BYTES = 16 << 20


@functools.cache
def map_populate_ignored() -> str | None:
    """Why MAP_POPULATE cannot be tested here, or None when it maps pages as Linux does.

    qemu-user translates a guest's mmap itself and drops MAP_POPULATE: the pages come in only when first
    written, so RSS cannot show a prefault. Measured: map 16 MiB with MAP_POPULATE and see what became
    resident."""
    flag = getattr(mmap, "MAP_POPULATE", 0)
    if not flag:
        return None  # not Linux: the code under test writes the pages itself instead
    rss = psutil.Process().memory_info
    before = rss().rss
    buf = mmap.mmap(-1, _PROBE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flag)
    grown = rss().rss - before
    buf.close()
    if grown >= _PROBE_BYTES // 2:
        return None
    return (
        f"qemu-user ignores MAP_POPULATE (measured: a {_PROBE_BYTES >> 20} MiB mapping with it made "
        f"{grown / 2**20:.1f} MiB resident), so a prefault cannot show in RSS here"
    )


def needs_map_populate() -> pytest.MarkDecorator:
    reason = map_populate_ignored()
    return pytest.mark.skipif(reason is not None, reason=reason or "")
