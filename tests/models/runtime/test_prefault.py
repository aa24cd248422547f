"""The weights that onnxruntime reads in place from the mapped file are paged in at load, not one token at a
time over hours: RSS is flat from the start. Unless they are large (Gemma 3's 262k-row lookup table): then
only the small ones are, and the large tables are advised into the page cache, so RSS counts the rows a
model really reads, not a vocabulary it never looks up."""

from __future__ import annotations

import mmap
import re
import sys
from pathlib import Path

import pytest

from models.runtime.session import PREFAULT_ALL_MAX, folder_mappings, prefault_mappings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def resident(path: Path) -> tuple[int, int]:
    """(mapped kB, resident kB) of this process's mappings of `path`."""
    size = rss = 0
    mine = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            mine = line.endswith(" " + str(path))
        elif mine and line.startswith("Size:"):
            size += int(line.split()[1])
        elif mine and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return size, rss


def test_prefault_when_file_mapped_untouched_then_every_page_resident(tmp_path):
    path = tmp_path / "weights.data"
    path.write_bytes(bytes(range(256)) * 4096 * 4)  # 4 MiB
    other = tmp_path.parent / f"{tmp_path.name}-other.data"
    other.write_bytes(b"\1" * (1 << 20))
    with path.open("rb") as f, other.open("rb") as g:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        n = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_DONTNEED)
        n.madvise(mmap.MADV_DONTNEED)
        assert resident(path) == (4096, 0)
        assert prefault_mappings(tmp_path) == 4 << 20
        assert resident(path) == (4096, 4096)
        assert resident(other) == (1024, 0)  # a file outside the folder is left alone
        m.close()
        n.close()


def test_prefault_when_mappings_exceed_all_max_then_large_ones_advised_not_resident(tmp_path):
    path = tmp_path / "weights.data"
    path.write_bytes(b"\2" * (4 << 20))
    small = tmp_path / "norms.data"
    small.write_bytes(b"\3" * (1 << 20))
    with path.open("rb") as f, small.open("rb") as g:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        n = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_DONTNEED)
        n.madvise(mmap.MADV_DONTNEED)
        assert prefault_mappings(tmp_path, touch_max=2 << 20, all_max=4 << 20) == 1 << 20  # the small one
        assert resident(path) == (4096, 0)
        assert resident(small) == (1024, 1024)
        # all of it fits in all_max: all of it in, the large mapping too
        assert prefault_mappings(tmp_path, touch_max=2 << 20, all_max=5 << 20) == 5 << 20
        assert resident(path) == (4096, 4096)
        m.close()
        n.close()


def test_prefault_when_an_earlier_session_maps_the_same_file_then_only_the_new_mappings_decide(tmp_path):
    # A session rebuilt for another thread count maps the same tables while the one it replaces is alive:
    # the new mappings alone fit all_max, both together do not.
    path = tmp_path / "weights.data"
    path.write_bytes(b"\4" * (4 << 20))
    with path.open("rb") as f:
        old = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        assert prefault_mappings(tmp_path, touch_max=2 << 20, all_max=5 << 20) == 4 << 20
        before = folder_mappings(tmp_path)
        assert len(before) == 1
        new = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        new.madvise(mmap.MADV_DONTNEED)
        assert resident(path) == (8192, 4096)  # the old mapping in, the new one not
        assert prefault_mappings(tmp_path, touch_max=2 << 20, all_max=5 << 20, skip=before) == 4 << 20
        assert resident(path) == (8192, 8192)
        old.close()
        new.close()


def test_prefault_when_no_procfs_then_nothing(tmp_path):
    assert prefault_mappings(tmp_path, maps=tmp_path / "missing") == 0


@pytest.mark.slow
def test_session_when_real_model_loaded_then_its_mapped_weights_are_resident(smollm2_model_dir):
    from models.runtime.engine import load_engine

    engine = load_engine(smollm2_model_dir, variant="q4", threads=1, context_length=256)
    engine.session()
    size, rss = resident(Path(smollm2_model_dir).resolve() / "weights.data")
    assert 20_000 < size <= PREFAULT_ALL_MAX // 1024  # the embedding table (~27 MiB) is read in place
    assert rss >= size - 64  # all of it in at load (a partial page at a mapping's end may differ)


@pytest.mark.slow
def test_session_when_rebuilt_for_other_threads_then_its_mapped_weights_are_resident_too(smollm2_model_dir):
    """The governor's thread change builds a session while the old one is alive (engine._session): the new
    one's lookup table is read in at load as the first one's was, not a few rows per new token afterwards
    (the ladder benchmark's creep once warm)."""
    from models.protocol import EngineLimits
    from models.runtime.engine import load_engine

    engine = load_engine(smollm2_model_dir, variant="q4", threads=1, context_length=256)
    engine.session()
    engine.apply_limits(EngineLimits(threads=2))
    engine.session()
    assert list(engine._sessions) == [("q4", 2, engine.session_key()[2])]  # the one-thread session is gone
    size, rss = resident(Path(smollm2_model_dir).resolve() / "weights.data")  # the new session's alone
    assert 20_000 < size <= PREFAULT_ALL_MAX // 1024
    assert rss >= size - 64


def resident_at(path: Path, spans: list[list[int]]) -> int:
    """Resident kB of this process's mappings of `path` that start in the page of one of `spans`."""
    starts = {o - o % mmap.PAGESIZE for o, _ in spans}
    rss, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split()
            mine = line.endswith(" " + str(path)) and int(parts[2], 16) in starts
        elif mine and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


def test_session_when_int8_variant_loaded_then_the_scales_it_packed_are_given_back(tiny_model_dir):
    """MatMulNBits with int8 activations copies its scales when it packs and never reads them again: their
    mapped pages go after loading, and the logits are the same as with them resident."""
    import json

    import numpy as np

    from models.runtime.session import DecoderSession, KVCache, ModelShape

    manifest = json.loads((Path(tiny_model_dir) / "manifest.json").read_text())
    spans = manifest["variants"]["q4-a8"]["copied_at_load"]
    assert spans and not manifest["variants"]["q4"]["copied_at_load"]  # fp32 activations read theirs
    shape = ModelShape.from_architecture(manifest["architecture"])
    path, weights = Path(tiny_model_dir) / "q4-a8.onnx", Path(tiny_model_dir).resolve() / "weights.data"
    logits = []
    for copied in ((), spans):
        sess = DecoderSession(path, shape, 1, copied_at_load=copied)
        if copied:
            assert resident_at(weights, spans) == 0
        else:
            assert resident_at(weights, spans) > 0  # what is given back otherwise stays
        kv = KVCache(shape, 16)
        out = [sess.run(np.array([1, 2, 3]), kv, 0).copy()]
        out += [sess.run(np.array([t]), kv, 3 + i).copy() for i, t in enumerate((5, 6, 7))]
        logits.append(np.stack(out))
        if copied:
            assert resident_at(weights, spans) == 0  # and running did not read them back
        del sess
    assert np.array_equal(logits[0], logits[1])
