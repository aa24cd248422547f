"""bench/memory.py's readers: resident memory per mapping from an smaps file, and glibc's heap in use."""

from __future__ import annotations

import sys

import pytest

from bench.memory import heap_in_use, smaps_rss

SMAPS = """\
5581d2a1c000-5581d2a3d000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                  40 kB
7f0c1a000000-7f0c1b000000 r--p 00000000 08:01 1234                       /models/x/weights.data
Size:              16384 kB
Rss:               12000 kB
7f0c1c000000-7f0c1c100000 rw-p 00000000 00:00 0
Rss:                 100 kB
7f0c1d000000-7f0c1d100000 rw-p 00000000 00:00 0                          [heap]
Rss:                   8 kB
"""


def test_smaps_rss_when_mappings_then_resident_kib_per_name(tmp_path):
    path = tmp_path / "smaps"
    path.write_text(SMAPS)
    assert smaps_rss(path) == {"[heap]": 48, "/models/x/weights.data": 12000, "[anon]": 100}


def test_smaps_rss_when_unreadable_then_empty(tmp_path):
    assert smaps_rss(tmp_path / "missing") == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_heap_in_use_when_a_block_is_held_then_it_counts_it():
    before = heap_in_use()
    block = bytearray(8 << 20)  # from an arena (uordblks) or mmapped (hblkhd): both count
    assert heap_in_use() - before >= 8 << 20
    del block
