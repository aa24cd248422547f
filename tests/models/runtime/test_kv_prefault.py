"""A KV buffer's pages: written when the buffer is allocated (kv_prefault, the default that `simmer serve`
uses), or mapped as the context first grows. RSS is read from /proc (Linux, like the governor)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import psutil
import pytest

from models.runtime.session import KVCache, ModelShape
from server.serving.engine_config import EngineConfig
from server.settings import Settings
from tests.emulation import needs_map_populate

# one layer of one KV head: each buffer is 40 MiB, above glibc's largest mmap threshold (32 MiB), so
# np.zeros gets fresh pages from the kernel and never recycled heap that an earlier test already touched
SHAPE = ModelShape(n_layers=1, n_kv_heads=1, head_dim=64, vocab=8)
CAPACITY = (40 << 20) // (64 * 4)
BUFFERS_MB = 2 * 40


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.parametrize(
    ("prefault", "low", "high"),
    [pytest.param(True, 0.95, 1.2, marks=needs_map_populate()), (False, 0.0, 0.1)],
)
def test_kv_pages_resident_at_allocation_only_when_prefaulted(
    prefault: bool, low: float, high: float
) -> None:
    gc.collect()
    before = _rss_mb()
    kv = KVCache(SHAPE, CAPACITY, prefault=prefault)
    grown = _rss_mb() - before
    assert kv.nbytes == BUFFERS_MB << 20
    assert low * BUFFERS_MB <= grown <= high * BUFFERS_MB, grown
    assert not any(k.any() or v.any() for k, v in kv.arrays)  # zeros either way


def test_kv_prefault_setting_reaches_the_engine_config(tmp_path) -> None:
    assert EngineConfig.from_settings(Settings(home=tmp_path)).kv_prefault is True
    assert EngineConfig.from_settings(Settings(home=tmp_path, kv_prefault=False)).kv_prefault is False


@pytest.mark.parametrize("prefault", [pytest.param(True, marks=needs_map_populate()), False])
def test_engines_opened_by_engine_config_allocate_kv_as_the_setting_says(tiny_model_dir, prefault) -> None:
    engine = EngineConfig.from_settings(Settings(kv_prefault=prefault), threads=1).open_dir(tiny_model_dir)
    shape = engine.shape
    capacity = (40 << 20) // (shape.n_kv_heads * shape.head_dim * 4)  # 40 MiB a buffer, as above
    gc.collect()
    before = _rss_mb()
    kv = engine.new_cache(capacity)
    grown = _rss_mb() - before
    total = kv.nbytes / 2**20
    assert (grown >= 0.95 * total) if prefault else (grown <= 0.1 * total), (grown, total)


# A long process's heap: glibc's mmap threshold raised by a freed ~30 MiB block, 96 MiB of heap freed under
# a live block (so it is not the top) and handed back by malloc_trim, as release_freed_memory does after a
# session build. The live block is 4 MiB, so that it comes from the top of the heap and not from a hole the
# imports left (a 64 KiB one did, once simmer's runtime imported a little more). A np.zeros of 40 MiB then
# comes from that heap and calloc writes it: resident at once. The KV's own mapping is not: the control
# shows the state is reproduced, the KV line what kv_zeros does in it.
HEAP_SCRIPT = """
import ctypes, gc, json, numpy as np, psutil
from models.runtime.session import kv_zeros
rss = lambda: psutil.Process().memory_info().rss / 2**20
x = np.ones(30 << 20, np.uint8); del x
chunks = [np.ones(16 << 20, np.uint8) for _ in range(6)]
pin = np.ones(4 << 20, np.uint8)
del chunks; gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
b = rss(); control = np.zeros((40 << 20) // 4, np.float32); control_mb = rss() - b
b = rss(); kv = kv_zeros(((40 << 20) // 4,), np.float32, False); kv_mb = rss() - b
b = rss(); full = kv_zeros(((40 << 20) // 4,), np.float32, True); full_mb = rss() - b
b = rss(); del full; gc.collect(); freed_mb = b - rss()
print(json.dumps([control_mb, kv_mb, full_mb, freed_mb]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
@needs_map_populate()
def test_kv_when_the_heap_holds_trimmed_free_memory_then_still_lazy_and_freed_at_once() -> None:
    out = subprocess.run([sys.executable, "-c", HEAP_SCRIPT], capture_output=True, text=True, check=True)
    control_mb, kv_mb, full_mb, freed_mb = json.loads(out.stdout)
    assert control_mb >= 0.95 * 40  # the heap state that made np.zeros resident is reproduced
    assert kv_mb <= 0.1 * 40
    assert full_mb >= 0.95 * 40 and freed_mb >= 0.95 * 40  # prefaulted, and unmapped when dropped


@pytest.mark.parametrize("prefault", [True, False])
def test_batch_kv_when_built_then_no_row_resident_and_a_taken_row_alone_comes_in(prefault: bool) -> None:
    from models.runtime.batch import BatchKV

    row_mb = BUFFERS_MB  # one row of this shape: a key and a value buffer of 40 MiB
    gc.collect()
    before = _rss_mb()
    kv = BatchKV(SHAPE, 4, CAPACITY, prefault=prefault)
    assert kv.nbytes == 4 * row_mb << 20  # what the memory planner counts
    assert _rss_mb() - before <= 0.1 * row_mb  # four rows budgeted, none resident
    kv.map_row(1)
    kv.map_row(1)  # taken again: nothing more
    grown = _rss_mb() - before
    assert kv.mapped == [False, True, False, False]
    if prefault:
        assert 0.95 * row_mb <= grown <= 1.2 * row_mb, grown
    else:  # pages come in as a reply's context grows
        assert grown <= 0.1 * row_mb, grown
    assert not any(k.any() or v.any() for k, v in kv.arrays)
