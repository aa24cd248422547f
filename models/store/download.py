"""Resumable HTTP downloads: a dropped connection or a killed process costs only the bytes in flight.

`dest.partial` keeps the bytes received so far and `dest.partial.json` the validator of the response they
came from (its ETag, else its Last-Modified). The next attempt (in this process after a short wait, or in
the next `simmer pull`) asks for the rest with `Range: bytes=N-` and `If-Range: <validator>`:
    206 Partial Content from N      -> append
    200 OK                          -> the server ignores ranges or the file changed: start again from 0
    416 Range Not Satisfiable       -> complete when the partial has the full size, else start again
A partial without a validator (the server gave neither header) is never resumed: nothing would tell a
changed file from the old one. The whole file is hashed at the end and checked against every sha256 we know.

Redirects are followed here, not by urllib: the headers of every hop are kept (the Hugging Face Hub puts the
file's sha256 on the redirect, not on the CDN's answer), and credentials are not sent to another host.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any

from models.errors import HashMismatch, InvalidModelFile, ModelNotFound, SourceUnavailable
from models.store.durable import disk_full_error, fsync_dir
from models.store.filelock import held
from models.store.sources import CHUNK, FetchedFile, Progress, check_hash, sha256_file

MAX_REDIRECTS = 10
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
UNSATISFIED_RANGE = re.compile(r"bytes \*/(\d+)")
# What a dropped or stalled connection looks like while reading a body.
NETWORK_ERRORS = (OSError, http.client.HTTPException, socket.timeout)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises HTTPError for the 3xx, which we follow ourselves


class HttpStatusError(Exception):
    """A final answer with an error status (after redirects)."""

    def __init__(self, status: int, url: str, headers: Mapping[str, str], body: str = "") -> None:
        super().__init__(f"HTTP {status} from {url}")
        self.status, self.url, self.headers, self.body = status, url, headers, body


@dataclass
class Response:
    status: int
    url: str  # after redirects
    headers: Message  # of the final answer
    hops: list[Message]  # headers of every answer, redirects first, the final one last
    body: Any  # file-like

    def header(self, name: str) -> str | None:
        """The first hop that has this header (the Hub sets X-Linked-Etag on its redirect)."""
        for hop in self.hops:
            if hop.get(name) is not None:
                return hop.get(name)
        return None


@dataclass(frozen=True)
class Http:
    """GET and HEAD with our own redirect handling. `headers` go with every request; `auth_headers` only
    to the first URL's host (a token for the hub must not travel to its CDN)."""

    headers: Mapping[str, str] = field(default_factory=dict)
    auth_headers: Mapping[str, str] = field(default_factory=dict)
    timeout: float = 30.0

    def open(self, url: str, *, method: str = "GET", headers: Mapping[str, str] | None = None) -> Response:
        opener = urllib.request.build_opener(_NoRedirect)
        origin = urllib.parse.urlsplit(url).netloc
        hops: list[Message] = []
        for _ in range(MAX_REDIRECTS + 1):
            send = {**self.headers, **(headers or {})}
            if urllib.parse.urlsplit(url).netloc == origin:
                send.update(self.auth_headers)
            req = urllib.request.Request(url, headers=send, method=method)
            try:
                resp = opener.open(req, timeout=self.timeout)
            except urllib.error.HTTPError as err:
                hops.append(err.headers)
                location = err.headers.get("Location")
                if err.code in (301, 302, 303, 307, 308) and location:
                    err.close()
                    url = urllib.parse.urljoin(url, location)
                    continue
                try:
                    body = err.read(4096).decode("utf-8", errors="replace")
                except NETWORK_ERRORS:
                    body = ""
                err.close()
                raise HttpStatusError(err.code, url, dict(err.headers), body) from None
            hops.append(resp.headers)
            return Response(resp.status, resp.url, resp.headers, hops, resp)
        raise SourceUnavailable(f"too many redirects from {url}")


def strong_validator(headers: Message) -> str | None:
    """What If-Range may carry: a strong ETag (weak ones are not allowed there), else Last-Modified."""
    etag = headers.get("ETag")
    if etag and not etag.startswith("W/"):
        return etag
    return headers.get("Last-Modified")


@dataclass
class Download:
    """One file from one URL into `dest`, resumable across interruptions and processes."""

    url: str
    dest: Path
    http: Http
    expected_sha256: str | None = None  # pinned by the user or the registry
    expected_size: int | None = None
    retries: int = 5  # reconnects within one call after a dropped connection
    backoff_s: float = 1.0
    progress: Progress | None = None
    describe_url: str | None = None  # how errors name the file (default: the URL)
    # Reads the file's sha256 from a response's headers when the server states it (the Hub does).
    sha256_from: Callable[[Response], str | None] | None = None
    # Maps an error status to our error (sources know what their server means by a 401 or a 404).
    status_error: Callable[[HttpStatusError], Exception] | None = None
    sleep: Callable[[float], None] = time.sleep
    server_sha256: str | None = field(default=None, init=False)

    @property
    def partial(self) -> Path:
        return self.dest.with_name(self.dest.name + ".partial")

    @property
    def partial_meta(self) -> Path:
        return self.dest.with_name(self.dest.name + ".partial.json")

    @property
    def what(self) -> str:
        return self.describe_url or self.url

    def run(self) -> FetchedFile:
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            failures = 0
            while True:
                try:
                    total = self._attempt()
                    break
                except _Interrupted as err:
                    if err.unreachable and failures == 0:
                        # Nothing to resume against: say so now rather than after a minute of retries.
                        raise SourceUnavailable(f"cannot download {self.what}: {err}") from err
                    failures += 1
                    if failures > self.retries:
                        have = self.partial.stat().st_size if self.partial.exists() else 0
                        raise SourceUnavailable(
                            f"the download of {self.what} was interrupted ({err}) after {failures} tries; "
                            f"{have} bytes are kept, and the next pull resumes from there"
                        ) from err
                    self.sleep(self.backoff_s * 2 ** (failures - 1))
            return self._finish(total)

    # -- one request -----------------------------------------------------------------------------------

    def _attempt(self) -> int:
        have, validator = self._resumable()
        headers = {"Accept-Encoding": "identity"}
        if have:
            headers |= {"Range": f"bytes={have}-", "If-Range": validator or ""}
        try:
            resp = self.http.open(self.url, headers=headers)
        except HttpStatusError as err:
            if err.status == 416 and have:
                return self._unsatisfiable(err, have)
            raise self._status_error(err) from None
        except NETWORK_ERRORS as err:
            raise _Interrupted(f"cannot reach the server ({err})", unreachable=True) from err
        with contextlib.closing(resp.body):
            if self.sha256_from is not None:
                self.server_sha256 = self.sha256_from(resp) or self.server_sha256
            if resp.status == 206 and have:
                start, total = self._content_range(resp)
                if start != have:  # not what we asked for: do not guess, start again
                    self._discard()
                    raise _Interrupted(f"the server sent bytes from {start}, not {have}")
                mode = "ab"
            elif resp.status == 200:
                # The server ignores ranges, or If-Range told it the file changed: all of it comes again.
                length = resp.headers.get("Content-Length")
                start, total, mode = 0, int(length) if length and length.isdigit() else None, "wb"
            else:
                raise SourceUnavailable(f"unexpected HTTP {resp.status} for {self.what}")
            self._save_meta(strong_validator(resp.headers), total)
            got = self._stream(resp.body, mode, start, total)
        if total is not None and got != total:
            raise _Interrupted(f"the connection closed after {got} of {total} bytes")
        return got

    def _stream(self, body: Any, mode: str, start: int, total: int | None) -> int:
        done = start
        # read1: whatever has arrived (up to CHUNK), so a stalled or killed download keeps every byte it got
        read = getattr(body, "read1", body.read)
        try:
            with self.partial.open(mode) as out:
                try:
                    while chunk := read(CHUNK):
                        out.write(chunk)
                        done += len(chunk)
                        if self.progress is not None:
                            self.progress("download", done / total if total else 0.0)
                except NETWORK_ERRORS as err:
                    if disk_full_error(err):
                        raise  # not the connection: retrying cannot help
                    raise _Interrupted(f"the connection dropped after {done} bytes: {err}") from err
                finally:
                    out.flush()
                    os.fsync(out.fileno())  # what we keep must be on disk before we count on it
        except OSError as err:
            if disk_full_error(err):
                # A write or its flush: name the partial, which is kept (the next pull resumes from it).
                raise OSError(err.errno, err.strerror, str(self.partial)) from err
            raise
        return done

    def _content_range(self, resp: Response) -> tuple[int, int | None]:
        m = CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
        if not m:
            self._discard()
            raise _Interrupted("a 206 answer without a usable Content-Range")
        return int(m.group(1)), None if m.group(3) == "*" else int(m.group(3))

    def _unsatisfiable(self, err: HttpStatusError, have: int) -> int:
        """416: our partial is at (or past) the end. Complete if the sizes agree, else start over."""
        m = UNSATISFIED_RANGE.fullmatch(str(err.headers.get("Content-Range", "")).strip())
        if m and int(m.group(1)) == have:
            return have
        self._discard()
        raise _Interrupted(f"the server cannot serve bytes from {have} (HTTP 416): starting again")

    def _status_error(self, err: HttpStatusError) -> Exception:
        if self.status_error is not None:
            return self.status_error(err)
        if err.status == 404:
            return ModelNotFound(f"{self.what} was not found (HTTP 404)")
        if err.status in (401, 403):
            return SourceUnavailable(f"access to {self.what} was refused (HTTP {err.status})")
        return SourceUnavailable(f"cannot download {self.what}: HTTP {err.status}")

    # -- the partial file ------------------------------------------------------------------------------

    def _resumable(self) -> tuple[int, str | None]:
        """(bytes to keep, validator) of the partial, or (0, None) after discarding one we cannot trust."""
        if not self.partial.exists():
            return 0, None
        try:
            meta = json.loads(self.partial_meta.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = {}
        have = self.partial.stat().st_size
        if meta.get("url") != self.url or not meta.get("validator") or have == 0:
            self._discard()
            return 0, None
        self.server_sha256 = self.server_sha256 or meta.get("sha256")
        return have, meta["validator"]

    def _save_meta(self, validator: str | None, total: int | None) -> None:
        data = {"url": self.url, "validator": validator, "size": total, "sha256": self.server_sha256}
        tmp = self.partial_meta.with_name(self.partial_meta.name + ".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        tmp.replace(self.partial_meta)

    def _discard(self) -> None:
        self.partial.unlink(missing_ok=True)
        self.partial_meta.unlink(missing_ok=True)

    def _finish(self, total: int) -> FetchedFile:
        size = self.partial.stat().st_size
        if self.expected_size is not None and size != self.expected_size:
            self._discard()
            raise InvalidModelFile(
                f"{self.what} has {size} bytes, expected {self.expected_size} (truncated or wrong file)"
            )
        actual = sha256_file(self.partial, self.progress, "hash")
        try:
            check_hash(self.what, self.expected_sha256, actual)
            check_hash(f"{self.what} (the sha256 the server gives)", self.server_sha256, actual)
        except HashMismatch:
            self._discard()  # resuming a corrupt partial would never fix it
            raise
        self.partial.replace(self.dest)
        self.partial_meta.unlink(missing_ok=True)
        fsync_dir(self.dest.parent)
        return FetchedFile(self.dest, actual, size)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer per partial file, across processes (the lock file is there only while held)."""
        with held(self.dest.with_name(self.dest.name + ".lock")):
            yield


class _Interrupted(Exception):
    """A try that ended early; what was written stays in the partial file."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable
