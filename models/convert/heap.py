"""Return freed heap memory to the system.

numpy's large temporaries come from glibc's malloc. Above its mmap threshold each is a mapping of its own,
unmapped when freed; but the threshold rises to the largest block freed so far (up to 32 MB), after which
blocks of a converted layer's size come from the heap, and the heap gives memory back only from its top.
Freed blocks below the top stay in RSS: a conversion of Qwen2.5 0.5B held about 650 MB that way.
`malloc_trim` releases them. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


def trim_heap() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
