"""A file that changed since it was verified is never served: stat check, re-hash, bad mark, fallback.

Fake converter (tests/models/store/test_store.py); the real model through the engine factory and /health is in
tests/server/serving/test_model_integrity.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from models.errors import VerificationFailed
from models.store.store import ModelStore
from tests.models.store.helpers import FakeConverter, make_store, write_gguf

MODEL = "tiny-llama"


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "Tiny-Llama.gguf")


@pytest.fixture
def two_versions(tmp_path: Path, gguf: Path) -> tuple[Path, str, str]:
    """home, previous version, current version (converter versions 1 then 2)."""
    home = tmp_path / "home"
    old = make_store(home, FakeConverter(version=1)).pull(str(gguf)).version
    new = make_store(home, FakeConverter(version=2)).pull(str(gguf)).version
    return home, old, new


def flip_byte(path: Path, *, keep_times: bool = False) -> None:
    """Flip one byte in place (same size, same inode). keep_times: put atime and mtime back as they were."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_times:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        after = path.stat()
        assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def store(home: Path, warnings: list[str] | None = None) -> ModelStore:
    return make_store(home, warn=(warnings.append if warnings is not None else lambda m: None))


def test_pull_when_installed_then_verification_recorded(tmp_path: Path, gguf: Path) -> None:
    model = make_store(tmp_path / "home").pull(str(gguf))
    record = json.loads((model.path / "verified.json").read_text())
    assert set(record["files"]) == set(model.manifest["files"])
    entry = record["files"]["q4/model.onnx"]
    st = (model.path / "q4" / "model.onnx").stat()
    assert entry == {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "sha256": model.manifest["files"]["q4/model.onnx"]["sha256"],
    }


@pytest.mark.parametrize("keep_times", [False, True], ids=["mtime-changed", "mtime-restored"])
def test_load_when_file_changed_then_marked_bad_and_previous_served(two_versions, keep_times) -> None:
    """With mtime restored by os.utime the stat check still sees it: the write moved ctime, which no
    system call can set back."""
    home, old, new = two_versions
    flip_byte(home / "models" / MODEL / new / "q4" / "model.onnx", keep_times=keep_times)
    warnings: list[str] = []
    served = store(home, warnings).load(MODEL)
    assert served.version == old
    assert any(f"{MODEL} {new} is marked bad" in w and "q4/model.onnx (sha256" in w for w in warnings)
    assert any(f"serving the previous version {old}" in w and "simmer pull --force" in w for w in warnings)
    mark = json.loads((home / "models" / MODEL / new / "bad.json").read_text())
    assert (
        mark["files"] == ["q4/model.onnx"]
        and mark["summary"] == "q4/model.onnx changed after it was verified"
    )
    # persistent: a new process skips it without hashing, and `current` was not rewritten
    assert store(home).load(MODEL).version == old
    assert (home / "models" / MODEL / "current").read_text().strip() == new


def test_load_when_change_invisible_to_stat_then_served_and_only_verify_finds_it(two_versions) -> None:
    """The documented limit: a change that leaves size, mtime, ctime and inode as recorded (the medium
    itself rotting) is not hashed at load; `simmer verify` hashes everything and then the load falls back.
    Simulated by recording the changed file's stat as verified."""
    home, old, new = two_versions
    target = home / "models" / MODEL / new / "q4" / "model.onnx"
    flip_byte(target)
    record_path = home / "models" / MODEL / new / "verified.json"
    record = json.loads(record_path.read_text())
    st = target.stat()
    record["files"]["q4/model.onnx"].update(
        size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns, inode=st.st_ino
    )
    record_path.write_text(json.dumps(record))
    assert store(home).load(MODEL).version == new  # trusted: nothing was hashed
    with pytest.raises(VerificationFailed, match=r"q4/model\.onnx \(sha256"):
        store(home).verify(MODEL)
    assert store(home).load(MODEL).version == old


def test_load_when_only_cache_damaged_then_rehashed_not_marked(two_versions) -> None:
    home, _, new = two_versions
    (home / "models" / MODEL / new / "verified.json").write_text("{not json")
    assert store(home).load(MODEL).version == new
    assert not (home / "models" / MODEL / new / "bad.json").exists()
    assert json.loads((home / "models" / MODEL / new / "verified.json").read_text())["files"]


def test_load_when_file_replaced_by_identical_copy_then_rehashed_and_served(two_versions) -> None:
    """A new inode with the same bytes (a restore from backup): hashed again, fine, recorded anew."""
    home, _, new = two_versions
    target = home / "models" / MODEL / new / "q4" / "model.onnx"
    copy = target.with_name("copy")
    copy.write_bytes(target.read_bytes())
    copy.replace(target)
    assert store(home).load(MODEL).version == new
    record = json.loads((home / "models" / MODEL / new / "verified.json").read_text())
    assert record["files"]["q4/model.onnx"]["inode"] == target.stat().st_ino


def test_load_when_no_good_version_then_error_names_file_and_fix(two_versions, gguf) -> None:
    home, old, new = two_versions
    flip_byte(home / "models" / MODEL / new / "q4" / "model.onnx")
    (home / "models" / MODEL / old / "tokenizer.json").unlink()
    with pytest.raises(VerificationFailed) as e:
        store(home).load(MODEL)
    msg = e.value.message
    assert f"{MODEL} has no good version to serve" in msg
    assert f"{new}: " in msg and "q4/model.onnx" in msg
    assert f"{old}: " in msg and "tokenizer.json is missing" in msg
    assert f"To fix: `simmer pull --force {gguf}`" in msg


def test_verify_when_file_put_back_then_mark_cleared_and_served_again(two_versions) -> None:
    home, old, new = two_versions
    target = home / "models" / MODEL / new / "q4" / "model.onnx"
    original = target.read_bytes()
    flip_byte(target)
    assert store(home).load(MODEL).version == old
    target.write_bytes(original)
    assert store(home).load(MODEL).version == old  # the mark holds until someone checks
    warnings: list[str] = []
    store(home, warnings).verify(MODEL)
    assert any("no longer marked bad" in w for w in warnings)
    assert store(home).load(MODEL).version == new


def test_pull_when_current_marked_bad_then_reinstalled_and_previous_kept(two_versions, gguf) -> None:
    home, old, new = two_versions
    flip_byte(home / "models" / MODEL / new / "q4" / "model.onnx")
    assert store(home).load(MODEL).version == old
    fake = FakeConverter(version=2)
    again = make_store(home, fake).pull(str(gguf))
    assert fake.calls == 1 and again.version == new
    assert store(home).load(MODEL).version == new
    versions = sorted(p.name for p in (home / "models" / MODEL).iterdir() if not p.name.startswith("."))
    assert versions == sorted([old, new, "current"])  # the previous version is still kept


def test_list_and_problem_when_current_bad_then_shown_with_fallback(two_versions, gguf) -> None:
    home, old, new = two_versions
    s = store(home)
    assert s.problem(MODEL) is None
    flip_byte(home / "models" / MODEL / new / "q4" / "model.onnx")
    s.load(MODEL)
    infos = {i.version: i for i in s.list()}
    assert infos[new].current and infos[new].bad and not infos[new].serving
    assert infos[new].problem == "q4/model.onnx changed after it was verified"
    assert infos[old].serving and not infos[old].bad and infos[old].problem is None
    problem = s.problem(MODEL)
    assert problem is not None
    assert problem["version"] == new and problem["serving_version"] == old
    assert problem["files"] == ["q4/model.onnx"] and problem["fix"] == f"simmer pull --force {gguf}"


def test_load_when_size_changed_then_marked_bad_without_hashing(two_versions) -> None:
    home, old, new = two_versions
    target = home / "models" / MODEL / new / "f32" / "model.onnx"
    target.write_bytes(target.read_bytes()[:-5])
    assert store(home).load(MODEL).version == old
    summary = json.loads((home / "models" / MODEL / new / "bad.json").read_text())["summary"]
    assert re.fullmatch(r"f32/model\.onnx has \d+ bytes, expected \d+", summary)


def test_pull_force_when_reinstall_fails_verification_then_old_files_back(tmp_path: Path, gguf: Path) -> None:
    """A forced reinstall of the current version moves the old folder aside; if the new one fails, the old
    one comes back (before, `current` named a folder that was gone)."""
    home = tmp_path / "home"
    model = make_store(home).pull(str(gguf))

    def corrupt_new(stage: str) -> None:
        if stage == "renamed":
            (model.path / "tokenizer.json").write_text('{"model": "FAKE"}')

    with pytest.raises(VerificationFailed, match=r"tokenizer\.json"):
        make_store(home, checkpoint=corrupt_new).pull(str(gguf), force=True)
    assert store(home).load(MODEL).version == model.version
    store(home).verify(MODEL)
    assert not list((home / "models" / MODEL).glob(".tmp-*"))
