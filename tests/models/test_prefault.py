"""The weights that onnxruntime reads in place from the mapped file: small ones are paged in at load, not one
token at a time over hours; large tables (the embedding lookup, RoPE caches) are only advised into the page
cache, so RSS counts the rows a model really reads, not a vocabulary it never looks up."""

from __future__ import annotations

import mmap
import re
import sys
from pathlib import Path

import pytest

from models.runtime.session import PREFAULT_MAX_BYTES, prefault_mappings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def mappings(path: Path) -> list[tuple[int, int]]:
    """(mapped kB, resident kB) of each of this process's mappings of `path`."""
    out: list[list[int]] = []
    mine = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            mine = line.endswith(" " + str(path))
            if mine:
                out.append([0, 0])
        elif mine and line.startswith("Size:"):
            out[-1][0] = int(line.split()[1])
        elif mine and line.startswith("Rss:"):
            out[-1][1] = int(line.split()[1])
    return [(s, r) for s, r in out]


def resident(path: Path) -> tuple[int, int]:
    """(mapped kB, resident kB) of this process's mappings of `path`."""
    m = mappings(path)
    return sum(s for s, _ in m), sum(r for _, r in m)


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


def test_prefault_when_mapping_larger_than_touch_max_then_advised_not_resident(tmp_path):
    path = tmp_path / "weights.data"
    path.write_bytes(b"\2" * (4 << 20))
    small = tmp_path / "norms.data"
    small.write_bytes(b"\3" * (1 << 20))
    with path.open("rb") as f, small.open("rb") as g:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        n = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_DONTNEED)
        n.madvise(mmap.MADV_DONTNEED)
        assert prefault_mappings(tmp_path, touch_max=2 << 20) == 1 << 20  # the small one only
        assert resident(path) == (4096, 0)
        assert resident(small) == (1024, 1024)
        m.close()
        n.close()


def test_prefault_when_no_procfs_then_nothing(tmp_path):
    assert prefault_mappings(tmp_path, maps=tmp_path / "missing") == 0


@pytest.mark.slow
def test_session_when_real_model_loaded_then_small_mapped_weights_resident_table_by_rows(smollm2_model_dir):
    from models.runtime.engine import load_engine

    engine = load_engine(smollm2_model_dir, variant="q4", threads=1, context_length=256)
    engine._session()
    path = Path(smollm2_model_dir).resolve() / "weights.data"
    table_size, table_rss = max(mappings(path))
    assert table_size > 20_000  # onnxruntime maps the embedding table (~27 MiB) and reads it in place
    small = [(s, r) for s, r in mappings(path) if s <= PREFAULT_MAX_BYTES // 1024]
    assert small and all(r >= s - 4 for s, r in small)  # in at load (a mapping's last page may be partial)
    assert table_rss < table_size * 3 // 4  # only the pages of rows looked up so far (and their neighbours)
