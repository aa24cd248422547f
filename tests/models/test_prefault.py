"""The weights that onnxruntime reads in place from the mapped file (the embedding table) are paged in at
load, not one token at a time over hours: RSS is flat from the start."""

from __future__ import annotations

import mmap
import re
import sys
from pathlib import Path

import pytest

from models.runtime.session import prefault_mappings

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


def test_prefault_when_no_procfs_then_nothing(tmp_path):
    assert prefault_mappings(tmp_path, maps=tmp_path / "missing") == 0


@pytest.mark.slow
def test_session_when_real_model_loaded_then_its_mapped_weights_are_resident(smollm2_model_dir):
    from models.runtime.engine import load_engine

    engine = load_engine(smollm2_model_dir, variant="q4", threads=1, context_length=256)
    engine._session()
    size, rss = resident(Path(smollm2_model_dir).resolve() / "weights.data")
    assert size > 20_000  # onnxruntime maps the embedding table (~30 MiB) and reads it in place
    assert rss >= size - 64  # all of it in at load (a partial page at a mapping's end may differ)
