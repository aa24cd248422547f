"""Model store: atomic install, kill -9 at every step, corruption, rollback, idempotency, disk space.

A fake converter (same seam as models/convert/pipeline.py) writes a few files and returns a manifest fragment;
the real end-to-end pull is tested with the real converter elsewhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from models.errors import (
    HashMismatch,
    InsufficientDisk,
    InvalidModelFile,
    ModelNotFound,
    ModelNotInstalled,
    UnsupportedModel,
    VerificationFailed,
)
from tests.models.store.helpers import FakeConverter, make_store, write_gguf

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "Tiny-Llama.gguf")


def test_pull_when_local_gguf_then_installed_with_full_manifest(tmp_path: Path, gguf: Path) -> None:
    store = make_store(tmp_path / "home")
    model = store.pull(str(gguf))
    assert model.id == "tiny-llama"
    assert model.path == tmp_path / "home" / "models" / "tiny-llama" / model.version
    m = json.loads((model.path / "manifest.json").read_text())
    assert m["source"]["kind"] == "local" and m["source"]["size"] == gguf.stat().st_size
    assert model.version == m["source"]["sha256"][:12] + "-c1"
    assert set(m["files"]) == {"q4/model.onnx", "f32/model.onnx", "tokenizer.json"}
    for rel, meta in m["files"].items():
        assert meta["size"] == (model.path / rel).stat().st_size
    assert set(m["variants"]) == {"q4", "f32"} and m["context_length"] == 128
    assert m["default_variant"] == "f32"  # the variant the model opens on is the converter's choice
    assert m["memory"]["kv_bytes_per_token"] == 2 * 2 * 1 * 8 * 4
    assert m["memory"]["variants"]["q4"]["estimate_bytes"] == 1000 + 128 * 2 * 2 * 1 * 8 * 4
    assert m["memory"]["variants"]["f32"]["load_bytes"] == m["files"]["f32/model.onnx"]["size"]
    assert m["source"]["gguf_path"] == str(gguf)
    assert (tmp_path / "home" / "models" / "tiny-llama" / "current").read_text().strip() == model.version
    assert store.load("tiny-llama").manifest == m


def test_pull_when_called_twice_then_second_does_nothing(tmp_path: Path, gguf: Path) -> None:
    fake = FakeConverter()
    messages: list[str] = []
    store = make_store(tmp_path / "home", fake, log=messages.append)
    first = store.pull(str(gguf))
    second = store.pull(str(gguf))
    assert fake.calls == 1
    assert second.version == first.version
    assert "already installed" in messages[-1]


def test_load_when_file_truncated_then_size_check_fails(tmp_path: Path, gguf: Path) -> None:
    store = make_store(tmp_path / "home")
    model = store.pull(str(gguf))
    target = model.path / "f32" / "model.onnx"
    target.write_bytes(target.read_bytes()[:-5])
    with pytest.raises(VerificationFailed, match=r"f32/model\.onnx has \d+ bytes, expected \d+"):
        store.load("tiny-llama")


def test_verify_when_file_corrupted_then_names_file(tmp_path: Path, gguf: Path) -> None:
    store = make_store(tmp_path / "home")
    model = store.pull(str(gguf))
    store.verify("tiny-llama")  # intact: passes
    target = model.path / "q4" / "model.onnx"
    data = bytearray(target.read_bytes())
    data[3] ^= 0xFF  # same size: only the hash can tell
    target.write_bytes(bytes(data))
    # the write moved mtime/ctime, so the load hashes it again; no other version: a clear error
    fix = f"simmer pull --force {gguf}"
    with pytest.raises(VerificationFailed, match=r"q4/model\.onnx \(sha256 [0-9a-f]{64}, expected.*" + fix):
        store.load("tiny-llama")
    with pytest.raises(VerificationFailed, match=r"q4/model\.onnx \(sha256 [0-9a-f]{64}, expected"):
        store.verify("tiny-llama")


def test_pull_when_installed_version_damaged_then_reinstalls(tmp_path: Path, gguf: Path) -> None:
    fake = FakeConverter()
    store = make_store(tmp_path / "home", fake)
    model = store.pull(str(gguf))
    (model.path / "tokenizer.json").unlink()
    again = store.pull(str(gguf))
    assert fake.calls == 2 and again.version == model.version
    store.verify("tiny-llama")
    assert not list((tmp_path / "home" / "models" / "tiny-llama").glob(".tmp-*"))


def test_pull_when_new_version_fails_smoke_test_then_previous_stays_current(
    tmp_path: Path, gguf: Path
) -> None:
    home = tmp_path / "home"
    old = make_store(home, FakeConverter(version=1)).pull(str(gguf))
    with pytest.raises(VerificationFailed, match=f"smoke test.*current version stays {old.version}"):
        make_store(home, FakeConverter(version=2, smoke_ok=False)).pull(str(gguf))
    store = make_store(home)
    assert store.load("tiny-llama").version == old.version
    assert [p.name for p in (home / "models" / "tiny-llama").iterdir() if p.is_dir()] == [old.version]


def test_pull_when_new_version_fails_verification_then_rolled_back(tmp_path: Path, gguf: Path) -> None:
    home = tmp_path / "home"
    old = make_store(home, FakeConverter(version=1)).pull(str(gguf))

    def corrupt_after_rename(stage: str) -> None:
        if stage == "renamed":  # the disk lies: a file changes between writing and reading back
            new = home / "models" / "tiny-llama" / old.version.replace("-c1", "-c2") / "tokenizer.json"
            new.write_text('{"model": "FAKE"}')

    store = make_store(home, FakeConverter(version=2), checkpoint=corrupt_after_rename)
    with pytest.raises(VerificationFailed, match=f"tokenizer.json.*current version stays {old.version}"):
        store.pull(str(gguf))
    assert store.load("tiny-llama").version == old.version
    assert not (home / "models" / "tiny-llama" / old.version.replace("-c1", "-c2")).exists()


def test_pull_when_new_version_then_one_previous_kept(tmp_path: Path, gguf: Path) -> None:
    home = tmp_path / "home"
    versions = [make_store(home, FakeConverter(version=v)).pull(str(gguf)).version for v in (1, 2, 3)]
    infos = make_store(home).list()
    assert {(i.version, i.current) for i in infos} == {(versions[2], True), (versions[1], False)}


def test_pull_when_not_enough_disk_then_refused_and_nothing_installed(tmp_path: Path, gguf: Path) -> None:
    fake = FakeConverter()
    store = make_store(tmp_path / "home", fake, free_bytes=lambda p: 150 * 10**6)
    with pytest.raises(InsufficientDisk, match=r"install needs about 200 MB .*, 150 MB free"):
        store.pull(str(gguf))
    assert fake.calls == 0
    with pytest.raises(ModelNotInstalled):
        store.load("tiny-llama")


def test_pull_when_disk_factor_configured_then_used(tmp_path: Path) -> None:
    big = write_gguf(tmp_path / "big.gguf", bytes(1024 * 1024))
    store = make_store(
        tmp_path / "home", free_bytes=lambda p: 9 * 1024 * 1024, disk_factor=10, disk_extra_mb=0
    )
    with pytest.raises(InsufficientDisk, match=r"needs about 10 MB"):
        store.pull(str(big))
    assert make_store(
        tmp_path / "home", free_bytes=lambda p: 11 * 1024 * 1024, disk_factor=10, disk_extra_mb=0
    ).pull(str(big))


def test_pull_when_local_hash_wrong_then_hash_mismatch_and_nothing_installed(
    tmp_path: Path, gguf: Path
) -> None:
    store = make_store(tmp_path / "home")
    with pytest.raises(HashMismatch, match="expected " + "ab" * 32 + ", got [0-9a-f]{64}"):
        store.pull(str(gguf), sha256="ab" * 32)
    assert store.list() == []


@pytest.mark.parametrize(
    ("content", "error", "message"),
    [
        (b"PK\x03\x04 a zip, not a gguf", InvalidModelFile, "not a GGUF file"),
        (b"GGUF\x03\x00", InvalidModelFile, "truncated"),
    ],
)
def test_pull_when_not_a_gguf_then_clear_error(tmp_path: Path, content: bytes, error, message: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    fake = FakeConverter()
    store = make_store(tmp_path / "home", fake)
    with pytest.raises(error, match=message):
        store.pull(str(bad))
    assert fake.calls == 0 and store.list() == []


def test_pull_when_converter_rejects_then_nothing_installed(tmp_path: Path, gguf: Path) -> None:
    fake = FakeConverter(fail_with=UnsupportedModel("unsupported architecture 'mamba'"))
    store = make_store(tmp_path / "home", fake)
    with pytest.raises(UnsupportedModel, match="mamba"):
        store.pull(str(gguf))
    assert store.list() == []
    assert not list((tmp_path / "home" / "models" / "tiny-llama").glob(".tmp-*"))


def test_pull_when_unknown_id_then_lists_known_ids(tmp_path: Path) -> None:
    with pytest.raises(
        ModelNotFound,
        match=r"unknown model 'smollm2'.*known models: all-minilm-l6-v2, gemma3-270m, qwen2\.5-coder-0\.5b, "
        r"qwen2\.5-coder-1\.5b, smollm2-135m-instruct",
    ):
        make_store(tmp_path / "home").pull("smollm2")


def test_remove_when_installed_then_gone_and_second_remove_fails(tmp_path: Path, gguf: Path) -> None:
    store = make_store(tmp_path / "home")
    store.pull(str(gguf))
    store.remove("tiny-llama")
    assert store.list() == []
    with pytest.raises(ModelNotInstalled, match="tiny-llama"):
        store.remove("tiny-llama")


def test_list_when_folder_has_no_manifest_then_not_listed(tmp_path: Path, gguf: Path) -> None:
    store = make_store(tmp_path / "home")
    model = store.pull(str(gguf))
    (model.path / "manifest.json").unlink()
    assert store.list() == []
    with pytest.raises(ModelNotInstalled, match="no valid manifest"):
        store.load("tiny-llama")


# ---- kill -9 during an install --------------------------------------------------------------------------

CHILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.models.store.helpers import FakeConverter, make_store
home, gguf, stage, signal_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
version = int(sys.argv[5])
fake = FakeConverter(version=version)
def checkpoint(name):
    if name == stage:
        signal_file.write_text(name)
        time.sleep(60)
if stage == "converting":
    fake.pause_file = signal_file
make_store(home, fake, checkpoint=checkpoint).pull(gguf)
"""


def _pull_and_kill(home: Path, gguf: Path, stage: str, signal_file: Path, version: int) -> None:
    script = CHILD.format(root=str(ROOT))
    cmd = [sys.executable, "-c", script, str(home), str(gguf), stage, str(signal_file), str(version)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE)
    try:
        # a hang detector, not a timing: an emulated arm64 child on a busy machine takes a minute to import
        deadline = time.monotonic() + 180
        while not signal_file.exists():
            if proc.poll() is not None:
                pytest.fail(f"child ended before {stage}: {proc.stderr.read().decode()}")
            assert time.monotonic() < deadline, f"child never reached {stage}"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    signal_file.unlink()


KILL_POINTS = ["converting", "converted", "manifest-written", "renamed"]


@pytest.mark.parametrize("stage", KILL_POINTS)
def test_pull_when_killed_then_not_installed_and_next_pull_cleans_up(
    tmp_path: Path, gguf: Path, stage: str
) -> None:
    home = tmp_path / "home"
    _pull_and_kill(home, gguf, stage, tmp_path / "reached", version=1)
    store = make_store(home)
    with pytest.raises(ModelNotInstalled):
        store.load("tiny-llama")
    assert store.list() == [] or stage == "renamed"  # after the rename, a complete but uncommitted folder
    assert all(not i.current for i in store.list())
    model = store.pull(str(gguf))
    store.verify("tiny-llama")
    assert store.load("tiny-llama").version == model.version
    assert not list((home / "models" / "tiny-llama").glob(".tmp-*"))


def test_sweep_when_a_forced_pull_was_killed_then_its_leftovers_go_and_a_held_model_is_left(
    tmp_path: Path, gguf: Path
) -> None:
    """A SIGTERM mid-install (`simmer pull --force`) leaves a .tmp-* folder beside the installed version;
    the next server start sweeps it, but not from a model another process is installing into now."""
    home = tmp_path / "home"
    make_store(home).pull(str(gguf))
    _pull_and_kill(home, gguf, "converting", tmp_path / "reached", version=2)
    model_dir = home / "models" / "tiny-llama"
    assert list(model_dir.glob(".tmp-*"))
    busy = home / "models" / "busy"
    (busy / ".tmp-abc").mkdir(parents=True)
    store = make_store(home)
    held = subprocess.Popen(  # another process's install holds the lock of "busy"
        [sys.executable, "-c", HOLD_LOCK, str(home), "busy"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert held.stdout is not None and held.stdout.readline().strip() == "held"
        assert store.sweep() == ["tiny-llama"]
        assert not list(model_dir.glob(".tmp-*")) and (busy / ".tmp-abc").is_dir()
        assert store.load("tiny-llama").version
    finally:
        held.kill()
        held.wait()


HOLD_LOCK = """
import sys, time
from pathlib import Path
from models.store.store import ModelStore
with ModelStore(Path(sys.argv[1]))._lock(sys.argv[2]):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("stage", ["converting", "manifest-written", "renamed"])
def test_pull_when_upgrade_killed_then_previous_version_still_current(
    tmp_path: Path, gguf: Path, stage: str
) -> None:
    home = tmp_path / "home"
    old = make_store(home, FakeConverter(version=1)).pull(str(gguf))
    _pull_and_kill(home, gguf, stage, tmp_path / "reached", version=2)
    store = make_store(home, FakeConverter(version=2))
    assert store.load("tiny-llama").version == old.version
    store.verify("tiny-llama")
    new = store.pull(str(gguf))
    assert new.version != old.version and store.load("tiny-llama").version == new.version
    assert not list((home / "models" / "tiny-llama").glob(".tmp-*"))


def test_pull_when_more_variants_requested_then_same_version_rebuilt(tmp_path: Path, gguf: Path) -> None:
    fake = FakeConverter()
    store = make_store(tmp_path / "home", fake)
    first = store.pull(str(gguf), variants=["q4"])
    assert set(first.variants) == {"q4"}
    assert store.pull(str(gguf)).version == first.version and fake.calls == 1  # installed is enough
    both = store.pull(str(gguf), variants=["q4", "f32"])
    assert fake.calls == 2 and both.version == first.version and set(both.variants) == {"q4", "f32"}
    assert set(store.verify("tiny-llama").variants) == {"q4", "f32"}
