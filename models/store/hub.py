"""One file of a Hugging Face Hub repo, downloaded with our own resumable HTTP client.

Why not huggingface_hub's hf_hub_download: it resumes too, but inside its own cache layout and retry policy,
which we could only test by imitating the whole Hub API; and it cannot tell us what it resumed. Ours is the
same code path for every URL and is tested against a local server that drops connections, ignores ranges,
changes the file and answers 416 (tests/models/store/test_download.py). What the Hub adds we read
ourselves: the `resolve` URL, the bearer token (sent to the Hub only, never to the CDN it redirects to),
and the file's sha256, which the Hub puts in `X-Linked-Etag` on its redirect for LFS files.

Cache: `<downloads>/hf/<owner>/<repo>/<revision>/<path>` plus `<file>.json` (the Hub's ETag and the sha256).
A cached file is used without asking the Hub when its sha256 is pinned, or offline; otherwise one HEAD
request checks the Hub's ETag, and a changed file is downloaded again.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import (
    InvalidModelFile,
    InvalidParameter,
    ModelNotFound,
    SimmerError,
    SourceUnavailable,
)
from models.store.download import NETWORK_ERRORS, Download, Http, HttpStatusError, Response
from models.store.paths import inside, plain_names
from models.store.sources import (
    FetchedFile,
    Progress,
    check_gguf_header,
    check_size,
    sha256_file,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class HubConfig:
    """Where the Hub is and who we are there (from Settings: SIMMER_HF_ENDPOINT / HF_ENDPOINT, ...)."""

    endpoint: str = DEFAULT_ENDPOINT
    token: str | None = None
    # `huggingface-cli login` stores its token here; used when no token is configured.
    token_file: Path | None = field(default_factory=lambda: Path.home() / ".cache" / "huggingface" / "token")
    offline: bool = False
    timeout_s: float = 30.0
    retries: int = 5  # reconnects after a dropped connection, within one pull

    def bearer(self) -> str | None:
        if self.token:
            return self.token
        if self.token_file is not None:
            try:
                return self.token_file.read_text(encoding="utf-8").strip() or None
            except OSError:
                return None
        return None


def _unquote_etag(value: str | None) -> str | None:
    if not value:
        return None
    return value.removeprefix("W/").strip('"') or None


def hub_etag(resp: Response) -> str | None:
    """The Hub's identity of the file version: X-Linked-Etag (LFS files, on the redirect), else its ETag."""
    return _unquote_etag(resp.header("X-Linked-Etag") or resp.hops[0].get("ETag"))


def hub_sha256(resp: Response) -> str | None:
    """For LFS files the Hub's ETag is the file's sha256 (git files get a git sha1, which is not)."""
    etag = hub_etag(resp)
    return etag.lower() if etag and SHA256_HEX.match(etag.lower()) else None


@dataclass(frozen=True)
class HuggingFaceFile:
    repo: str
    filename: str
    revision: str | None = None
    sha256: str | None = None
    size: int | None = None
    hub: HubConfig = field(default_factory=HubConfig)
    kind: str = field(default="hf", init=False)

    def __post_init__(self) -> None:
        # Every part names a folder or a file, in the Hub's URL and in the download cache alike: one that
        # is empty, `.`, `..` or holds a separator would leave both (`hf:../../x.gguf@.`).
        what = f"the Hugging Face model hf:{self.repo}/{self.filename}"
        owner_repo = self.repo.split("/")
        if len(owner_repo) != 2:
            raise InvalidParameter(f"{what}: the repo must be owner/name", param="model")
        plain_names(owner_repo, what=what)
        plain_names(self.filename.split("/"), what=what)
        if self.revision is not None:
            plain_names(self.revision.split("/"), what=f"{what}: the revision")

    @property
    def where(self) -> str:
        return f"{self.repo}/{self.filename}" + (f"@{self.revision}" if self.revision else "")

    @property
    def url(self) -> str:
        base = self.hub.endpoint.rstrip("/")
        revision = urllib.parse.quote(self.revision or "main", safe="")
        return f"{base}/{self.repo}/resolve/{revision}/{urllib.parse.quote(self.filename)}"

    def cached_path(self, downloads: Path) -> Path:
        parts = [*self.repo.split("/"), *(self.revision or "main").split("/"), *self.filename.split("/")]
        return inside(downloads, "hf", *parts, what=f"the download cache of {self.where}")

    def _http(self) -> Http:
        token = self.hub.bearer()
        return Http(
            headers={"User-Agent": "simmer"},
            auth_headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=self.hub.timeout_s,
        )

    def fetch(self, downloads: Path, progress: Progress | None = None) -> FetchedFile:
        dest = self.cached_path(downloads)
        cached = self._cached(dest, progress)
        if cached is not None:
            return cached
        if self.hub.offline:
            raise SourceUnavailable(
                f"cannot download {self.where} from the Hugging Face Hub: offline mode is on "
                "and the file is not in the local cache"
            )
        seen: list[str | None] = []

        def sha256_from(resp: Response) -> str | None:
            seen.append(hub_sha256(resp) or hub_etag(resp))
            return hub_sha256(resp)

        download = Download(
            self.url,
            dest,
            self._http(),
            expected_sha256=self.sha256,
            expected_size=self.size,
            retries=self.hub.retries,
            progress=progress,
            describe_url=self.where,
            sha256_from=sha256_from,
            status_error=self._status_error,
        )
        try:
            got = self._download(download)
        except BaseException:
            _remove_empty_folders(dest.parent, downloads)  # a name that was not found leaves no trace
            raise
        etag = next((e for e in reversed(seen) if e), None) or download.server_sha256
        _write_json(_meta_path(dest), {"etag": etag, "sha256": got.sha256})
        return got

    def _download(self, download: Download) -> FetchedFile:
        try:
            got = download.run()
        except SourceUnavailable as err:
            raise SourceUnavailable(f"{err.message} (Hugging Face Hub at {self.hub.endpoint})") from err
        try:
            check_gguf_header(got.path)
        except InvalidModelFile:
            got.path.unlink(missing_ok=True)
            raise
        return got

    def _cached(self, dest: Path, progress: Progress | None) -> FetchedFile | None:
        """The cached file when it is still the one asked for; None (and gone) when it is not."""
        if not dest.is_file():
            return None
        try:
            meta = json.loads(_meta_path(dest).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = {}
        if not (self.sha256 or self.hub.offline):
            current = self._current_etag()
            if current is not None and current != meta.get("etag"):
                dest.unlink()  # the Hub has another version of the file now
                return None
        actual = sha256_file(dest, progress, "check cached download")
        if actual != (self.sha256 or meta.get("sha256")):
            dest.unlink()  # damaged, or not the pinned file
            return None
        check_size(self.where, self.size, dest.stat().st_size)
        return FetchedFile(dest, actual, dest.stat().st_size)

    def _current_etag(self) -> str | None:
        """The Hub's current ETag for the file (None when the Hub cannot be asked: use what we have)."""
        try:
            resp = self._http().open(self.url, method="HEAD")
        except (HttpStatusError, *NETWORK_ERRORS):
            return None
        resp.body.close()
        return hub_sha256(resp) or hub_etag(resp)

    def _status_error(self, err: HttpStatusError) -> SimmerError:
        code = str(err.headers.get("X-Error-Code") or "")
        message = str(err.headers.get("X-Error-Message") or "").strip()
        detail = f": {message}" if message else ""
        if code == "GatedRepo":
            return SourceUnavailable(
                f"{self.repo} is gated on the Hugging Face Hub: accept its terms on the Hub and set "
                f"HF_TOKEN (or SIMMER_HF_TOKEN) to a token of that account{detail}"
            )
        if err.status == 401 or code == "RepoNotFound":
            return ModelNotFound(
                f"{self.where} was not found on the Hugging Face Hub (a private repo needs HF_TOKEN){detail}"
            )
        if err.status == 404:
            return ModelNotFound(f"{self.where} was not found on the Hugging Face Hub{detail}")
        if err.status == 403:
            return SourceUnavailable(f"the Hugging Face Hub refused access to {self.where}{detail}")
        return SourceUnavailable(f"cannot download {self.where}: HTTP {err.status}{detail}")

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "repo": self.repo,
            "filename": self.filename,
            "revision": self.revision,
            "url": self.url,
        }


def _remove_empty_folders(folder: Path, root: Path) -> None:
    """The cache folders a failed download made, up to (not including) `root`, as long as they are empty
    (a partial download kept for the next pull keeps its folder)."""
    while folder != root and folder.is_relative_to(root):
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _meta_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".json")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(path)
