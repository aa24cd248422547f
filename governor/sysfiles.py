"""Reading the small text files of sysfs, cgroupfs and procfs: any failure is None, never an exception."""

from __future__ import annotations

from pathlib import Path

# A cgroup v1 "no limit" is PAGE_COUNTER_MAX rounded to pages (9223372036854771712); anything this big
# means unlimited.
_UNLIMITED = 1 << 62


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_int(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def read_limit(path: Path) -> int | None:
    """A cgroup limit file: a number, "max" (v2) or a huge number (v1) both mean no limit (None)."""
    text = read_text(path)
    if text is None or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value < 0 or value >= _UNLIMITED else value


def read_stat(path: Path) -> dict[str, int]:
    text = read_text(path)
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value)
        except ValueError:
            continue
    return out
