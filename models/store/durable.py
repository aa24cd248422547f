"""Durability helpers shared by the store, the sources and the converter."""

from __future__ import annotations

import errno
import os
import re
import secrets
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or a new file inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_text(path: Path, text: str) -> None:
    """Write `path` atomically, not fsynced: a unique temporary name beside it, then a rename (a reader sees
    the old file or the new one; a symlink at `path` is replaced, never followed). The temporary file goes
    if anything fails."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ENOSPC: the filesystem is full; EDQUOT: the user's quota is. Both mean "free some space, then retry".
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Native libraries (the Rust `tokenizers`) raise a plain Exception that only names the OS error.
_NATIVE_DISK_FULL = re.compile(r"\(os error (\d+)\)")


def disk_full_error(exc: BaseException | None) -> BaseException | None:
    """The exception in `exc`'s chain (itself, its __cause__ or __context__, recursively) that says the disk
    or quota is full, or None. Wrappers (InvalidModelFile from an OSError, a smoke test's failure) keep
    the original in their chain, so one check at the top sees through them."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return exc
        native = _NATIVE_DISK_FULL.search(str(exc)) if type(exc) is Exception else None
        if native and int(native.group(1)) in DISK_FULL_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
