"""Names never resolve outside the store (models/store/paths.py), a local path is read only where the caller
allows it, and a failed pull leaves nothing behind: no model folder, no lock, no cache folders."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from models.errors import InvalidModelFile, InvalidParameter, ModelNotFound, SourceUnavailable
from models.store import filelock, registry
from models.store.hub import HubConfig
from models.store.paths import inside
from models.store.store import ModelStore
from tests.models.fileserver import FileServer
from tests.models.store.helpers import FakeConverter, write_gguf

NOBODY = HubConfig(endpoint="http://127.0.0.1:9", token_file=None, retries=0)  # nothing listens on port 9


def store(home: Path, hub: HubConfig = NOBODY) -> ModelStore:
    return ModelStore(home, converter=FakeConverter().as_converter(), hub=hub)


SKELETON = {"downloads", "models", "models/.locks"}  # the store's own folders, made once


def files_under(root: Path) -> list[str]:
    """Every file and folder under root but the store's skeleton, as relative paths."""
    if not root.exists():
        return []
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.relative_to(root).as_posix() not in SKELETON
    )


# ---- the helper --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("part", ["", ".", "..", "a/b", "a\\b", "/etc", "a\x00b"])
def test_inside_when_a_part_is_not_a_plain_name_then_refused(tmp_path: Path, part: str) -> None:
    with pytest.raises(InvalidParameter, match="not a plain name"):
        inside(tmp_path, "models", part)


def test_inside_when_a_symlink_leads_out_then_refused_and_plain_names_pass(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(InvalidParameter, match="resolves outside"):
        inside(root, "link", "x.gguf")
    assert inside(root, "a", "b.gguf") == root / "a" / "b.gguf"
    (root / "inner").symlink_to(root / "a", target_is_directory=True)
    assert inside(root, "inner", "b.gguf") == root / "inner" / "b.gguf"  # a symlink that stays inside


# ---- hf: names ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "hf:owner/repo/../../../x.gguf",
        "hf:../repo/x.gguf",
        "hf:owner/../x/y.gguf",
        "hf:owner/repo/./x.gguf",
        "hf:owner/repo/x.gguf@.",
        "hf:owner/repo/x.gguf@..",
        "hf:owner/repo/x.gguf@main/../../..",
        "hf:owner/repo/sub\\..\\..\\x.gguf",
        "hf:owner/repo/x\x00.gguf",
    ],
)
def test_hf_name_when_a_part_is_dot_dot_or_a_separator_then_refused_before_any_request(name: str) -> None:
    with pytest.raises(InvalidParameter, match="not a plain name"):
        registry.resolve(name, hub=NOBODY)
    with pytest.raises(InvalidParameter):
        registry.model_id(name)


def test_hf_pull_when_name_climbs_out_of_the_store_then_refused_and_the_file_there_untouched(
    tmp_path: Path,
) -> None:
    precious = tmp_path / "elsewhere" / "precious.gguf"
    precious.parent.mkdir()
    write_gguf(precious, b"someone else's model")
    before = precious.read_bytes()
    climb = "../" * 40 + precious.relative_to("/").as_posix()
    home = tmp_path / "home"
    (home / "downloads" / "hf").mkdir(parents=True)  # a store that pulled from the Hub before
    with pytest.raises(InvalidParameter):
        store(home).pull(f"hf:{climb}@.")
    assert precious.read_bytes() == before
    assert sorted(p.name for p in precious.parent.iterdir()) == ["precious.gguf"]  # no lock beside it
    assert files_under(home) == ["downloads/hf"]


def test_hf_pull_when_the_cache_holds_a_symlink_out_then_refused_and_nothing_written_there(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "home" / "downloads" / "hf").mkdir(parents=True)
    (tmp_path / "home" / "downloads" / "hf" / "owner").symlink_to(outside)
    with pytest.raises(InvalidParameter, match="resolves outside"):
        store(tmp_path / "home").pull("hf:owner/repo/model.gguf")
    assert list(outside.iterdir()) == []


def test_hf_pull_when_not_found_then_no_cache_folder_lock_or_model_folder_left(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with FileServer() as server:  # every file: 404
        hub = HubConfig(endpoint=server.url(""), token_file=None, retries=0)
        with pytest.raises(ModelNotFound):
            store(home, hub).pull("hf:owner/repo/sub/missing.gguf@v1")
    assert files_under(home) == []


def test_hf_pull_when_hub_unreachable_then_nothing_left(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with pytest.raises(SourceUnavailable):
        store(home).pull("hf:owner/repo/model.gguf")
    assert files_under(home) == []


# ---- local paths -------------------------------------------------------------------------------------------


@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    folder = tmp_path / "allowed"
    folder.mkdir()
    return folder


def test_local_pull_when_outside_the_allowed_folders_then_same_refusal_whether_or_not_it_exists(
    tmp_path: Path, allowed: Path
) -> None:
    exists = write_gguf(tmp_path / "real.gguf")
    answers = []
    for name in (str(exists), str(tmp_path / "ghost.gguf"), "/etc/passwd", "./x.gguf", "~/y.gguf"):
        with pytest.raises(InvalidParameter, match="SIMMER_PULL_DIRS") as e:
            store(tmp_path / "home").pull(name, local_dirs=[allowed])
        answers.append(e.value.message.replace(repr(name), "NAME"))
    assert len(set(answers)) == 1, answers
    with pytest.raises(InvalidParameter, match="SIMMER_PULL_DIRS"):
        store(tmp_path / "home").pull(str(exists), local_dirs=[])
    assert files_under(tmp_path / "home") == []


def test_local_pull_when_dot_dot_or_a_symlink_leaves_the_allowed_folder_then_refused(
    tmp_path: Path, allowed: Path
) -> None:
    outside = write_gguf(tmp_path / "outside.gguf")
    (allowed / "link.gguf").symlink_to(outside)
    (allowed / "dir").symlink_to(tmp_path, target_is_directory=True)
    for name in (f"{allowed}/../outside.gguf", f"{allowed}/link.gguf", f"{allowed}/dir/outside.gguf"):
        with pytest.raises(InvalidParameter, match="SIMMER_PULL_DIRS"):
            store(tmp_path / "home").pull(name, local_dirs=[allowed])
    assert files_under(tmp_path / "home") == []


def test_local_pull_when_inside_an_allowed_folder_then_installed_and_missing_is_not_found(
    tmp_path: Path, allowed: Path
) -> None:
    gguf = write_gguf(allowed / "Tiny.gguf")
    (tmp_path / "alias").symlink_to(allowed, target_is_directory=True)  # the folder named through a link
    model = store(tmp_path / "home").pull(str(gguf), local_dirs=[tmp_path / "alias"])
    assert model.id == "tiny" and model.manifest["source"]["path"] == str(gguf)
    with pytest.raises(ModelNotFound, match="no such file"):
        store(tmp_path / "home").pull(str(allowed / "ghost.gguf"), local_dirs=[allowed])


def test_local_pull_when_not_a_gguf_then_error_names_no_byte_of_it_and_nothing_left(tmp_path: Path) -> None:
    notes = tmp_path / "notes.gguf"
    notes.write_text("root:x:0:0:secret")
    home = tmp_path / "home"
    with pytest.raises(InvalidModelFile, match="not a GGUF") as e:
        store(home).pull(str(notes))  # the CLI's way: any path
    assert "root" not in e.value.message and "secret" not in e.value.message
    assert files_under(home) == []


def test_pull_when_conversion_fails_on_a_first_install_then_no_model_folder_or_lock_left(
    tmp_path: Path,
) -> None:
    gguf = write_gguf(tmp_path / "Tiny.gguf")
    home = tmp_path / "home"
    failing = ModelStore(home, converter=FakeConverter(fail_with=InvalidModelFile("bad")).as_converter())
    with pytest.raises(InvalidModelFile):
        failing.pull(str(gguf))
    assert files_under(home) == []
    store(home).pull(str(gguf))
    with pytest.raises(InvalidModelFile):  # a reinstall that fails keeps the installed version
        ModelStore(
            home, converter=FakeConverter(fail_with=InvalidModelFile("bad"), version=2).as_converter()
        ).pull(str(gguf), force=True)
    assert store(home).load("tiny").id == "tiny"


# ---- the lock whose file goes away -------------------------------------------------------------------------


def test_held_when_many_threads_take_turns_then_never_two_holders_and_no_file_left(tmp_path: Path) -> None:
    lock = tmp_path / "locks" / "m.lock"
    counter = tmp_path / "counter"
    counter.write_text("0")
    inside_now = 0
    overlaps = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside_now, overlaps
        for _ in range(150):
            with filelock.held(lock):
                with guard:
                    inside_now += 1
                    overlaps += inside_now > 1
                counter.write_text(str(int(counter.read_text()) + 1))
                with guard:
                    inside_now -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert overlaps == 0 and counter.read_text() == "600"
    assert not lock.exists()
