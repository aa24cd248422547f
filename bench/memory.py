"""Where a process's memory is, read from Linux and glibc: the readers the benchmarks share.

`smaps_rss` reads resident memory per mapping from an smaps file (the soak's summary, the warm-memory
study's kinds); `heap_in_use` asks glibc how many heap bytes are allocated now (mallinfo2), which sees
small blocks that RSS rounds away.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from pathlib import Path

_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in _MALLINFO2.split()]


def smaps_rss(path: Path | str) -> Counter:
    """Resident KiB per mapping name in an smaps file: a file's path, [heap], [stack], ..., [anon] for an
    unnamed one (Linux; empty where it cannot be read)."""
    totals: Counter = Counter()
    name = "[anon]"
    try:
        with open(path) as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    parts = line.split(maxsplit=5)
                    name = parts[5].strip() if len(parts) > 5 else "[anon]"
                elif line.startswith("Rss:"):
                    totals[name] += int(line.split()[1])
    except OSError:
        return Counter()
    return totals


def heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back, this process (glibc 2.33+ only)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd
