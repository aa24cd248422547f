"""Is an installed version still what was verified? The files' sha256 against the manifest, with a cache of
each file's stat at its last hashing (verified.json) so a normal start hashes nothing, and the persistent
bad mark (bad.json) of a version that failed.

What the stat check sees: any write through the filesystem (it moves ctime, and so does an os.utime that
puts mtime back), a replaced file (a new inode), a truncation (the size). What it cannot see: a change
that bypasses the filesystem, like a bit rotting on the medium. `simmer verify` hashes every file for that.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.store.durable import fsync_dir, replace_text
from models.store.sources import Progress, sha256_file

SCHEMA = 1
VERIFIED = "verified.json"
BAD = "bad.json"


@dataclass(frozen=True)
class Problem:
    file: str
    detail: str  # for a log or an error: names the file and the numbers
    summary: str  # for a table: short, no hashes
    damaged: bool  # missing or wrong size (a sha256 mismatch is False)


@dataclass
class CheckResult:
    checked: dict[str, dict[str, Any]] = field(default_factory=dict)  # what verified.json should hold
    problems: list[Problem] = field(default_factory=list)
    hashed: int = 0  # files read in full


def stat_key(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def check_files(
    vdir: Path,
    files: dict[str, dict[str, Any]],
    cache: dict[str, dict[str, Any]],
    progress: Progress | None = None,
) -> CheckResult:
    """Every file's size; its sha256 unless `cache` holds the same stat and expected hash for it."""
    result = CheckResult()
    for i, (rel, meta) in enumerate(sorted(files.items())):
        _check_one(vdir / rel, rel, meta, cache.get(rel), result)
        if progress:
            progress("verify", (i + 1) / len(files))
    return result


def _check_one(
    path: Path, rel: str, meta: dict[str, Any], cached: dict[str, Any] | None, result: CheckResult
) -> None:
    try:
        before = stat_key(path)
    except FileNotFoundError:
        result.problems.append(Problem(rel, f"{rel} is missing", f"{rel} is missing", True))
        return
    if before["size"] != meta["size"]:
        detail = f"{rel} has {before['size']} bytes, expected {meta['size']}"
        result.problems.append(Problem(rel, detail, detail, True))
        return
    if cached is not None and cached == {**before, "sha256": meta["sha256"]}:
        result.checked[rel] = cached
        return
    actual = sha256_file(path)
    result.hashed += 1
    if actual != meta["sha256"]:
        detail = f"{rel} (sha256 {actual}, expected {meta['sha256']})"
        result.problems.append(Problem(rel, detail, f"{rel} changed after it was verified", False))
    elif stat_key(path) == before:  # not written while we read it: this stat can vouch for it later
        result.checked[rel] = {**before, "sha256": actual}


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_verified(vdir: Path) -> dict[str, dict[str, Any]]:
    data = _read_json(vdir / VERIFIED)
    if data is None or data.get("schema") != SCHEMA or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def write_verified(vdir: Path, checked: dict[str, dict[str, Any]]) -> None:
    """Atomic (a unique temporary name, then rename) but not fsynced: losing it costs one more hashing."""
    data = {"schema": SCHEMA, "verified_at": _now(), "files": checked}
    replace_text(vdir / VERIFIED, json.dumps(data, indent=1, sort_keys=True) + "\n")


def read_bad(vdir: Path) -> dict[str, Any] | None:
    if not (vdir / BAD).exists():
        return None
    # an unreadable mark is still a mark: the version stays unserved
    return _read_json(vdir / BAD) or {"reason": f"{BAD} is unreadable", "summary": f"{BAD} is unreadable"}


def write_bad(vdir: Path, problems: list[Problem]) -> dict[str, Any]:
    """Durably: a version found bad must stay unserved after a crash too."""
    mark = {
        "marked_at": _now(),
        "reason": "; ".join(p.detail for p in problems),
        "summary": "; ".join(p.summary for p in problems),
        "files": [p.file for p in problems],
    }
    tmp = vdir / f".{BAD}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(mark, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(vdir / BAD)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(vdir)
    return mark


def clear_bad(vdir: Path) -> bool:
    """Remove the mark; True when there was one."""
    try:
        (vdir / BAD).unlink()
    except FileNotFoundError:
        return False
    fsync_dir(vdir)
    return True
