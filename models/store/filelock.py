"""An exclusive lock across processes (flock on a file) whose file exists only while someone wants it.

A lock file left behind by every name ever tried is litter (a failed pull must leave nothing). Removing it
safely: the holder unlinks it while it still holds the lock; a process that was waiting on the old file then
gets a lock on a file that is no longer at the path, sees that (inode differs), and starts again on the
path's new file. So two processes never both believe they hold the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

MAX_TRIES = 1000  # only another process removing the file at each try can use them up


@contextlib.contextmanager
def held(path: Path, *, wait: bool = True) -> Iterator[None]:
    """Hold the lock on `path` (created when missing, and its folder); removed before it is let go.
    `wait=False`: raise BlockingIOError at once when another process holds it."""
    for _ in range(MAX_TRIES):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            f = path.open("a")
        except FileNotFoundError:
            continue  # its empty folder was removed meanwhile by a holder that let go: make it again
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(f.fileno(), path):
                break
        except BaseException:
            f.close()
            raise
        f.close()  # removed or replaced while we waited: lock the file that is there now
    else:
        raise OSError(f"cannot hold the lock {path}: it keeps being removed")
    try:
        yield
    finally:
        try:
            path.unlink(missing_ok=True)
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)
