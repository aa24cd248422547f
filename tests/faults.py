"""Fault injection for file writes, and a small tmpfs for real ENOSPC.

`fail_open(...)` makes the matching open() fail with an OSError (ENOSPC by default). It works through a
Python audit hook (PEP 578, the interpreter's own instrumentation point): every open() and os.open() in this
process raises the "open" event before the file is opened, including those of the converter, the onnx
package and pathlib, and a hook that raises aborts that open. Nothing is monkeypatched. Opens done by
native code (the Rust tokenizers library, onnxruntime, a pip subprocess) do not pass through it: the tmpfs
tests reach those. A hook cannot be removed once added, so one is installed for the session and does
nothing while no fault is armed.

`Tmpfs` mounts a tmpfs of a given size (root only; tests skip with the reason when mounting is refused)
and can fill it up, so that the next write anywhere on it fails with the kernel's own ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


@dataclass
class OpenFault:
    match: Callable[[str, bool], bool]  # (path, opened for writing) -> fail this open?
    error: int
    nth: int  # fail the nth matching open (1 = the first)
    seen: int = 0
    fired: int = 0


_faults: list[OpenFault] = []
_installed = False


def _is_write(mode: object, flags: object) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & WRITE_FLAGS)


def _hook(event: str, args: tuple) -> None:
    if event != "open" or not _faults:
        return
    path, mode, flags = args
    if not isinstance(path, str | bytes | os.PathLike):
        return  # an fd being wrapped: its open was already seen
    text = os.fsdecode(path)
    writing = _is_write(mode, flags)
    for fault in _faults:
        if fault.match(text, writing):
            fault.seen += 1
            if fault.seen == fault.nth:
                fault.fired += 1
                raise OSError(fault.error, os.strerror(fault.error), text)


@contextlib.contextmanager
def fail_open(
    match: Callable[[str, bool], bool], *, error: int = errno.ENOSPC, nth: int = 1
) -> Iterator[OpenFault]:
    """Arm a fault for the duration of the block. The yielded object says whether it fired."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    fault = OpenFault(match, error, nth)
    _faults.append(fault)
    try:
        yield fault
    finally:
        _faults.remove(fault)


def writing(name_part: str) -> Callable[[str, bool], bool]:
    """Matches an open for writing whose path contains `name_part`."""
    return lambda path, is_write: is_write and name_part in path


class Tmpfs:
    """A mounted tmpfs; `fill()` takes all its free space with one file, `unfill()` gives it back."""

    def __init__(self, mountpoint: Path, size_mb: int) -> None:
        self.root = mountpoint
        self.filler = mountpoint / "filler"
        mountpoint.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise PermissionError(f"cannot mount a tmpfs: {(proc.stderr or proc.stdout).strip()}")

    def free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            size = os.fstat(fd).st_size + self.free()
            if size:
                os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        """A failed test's traceback can still hold a memory map or a file on it: collect first, and
        detach lazily if it is still busy (it goes when the last user does)."""
        gc.collect()
        if subprocess.run(["umount", str(self.root)], check=False, capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(self.root)], check=False, capture_output=True)
