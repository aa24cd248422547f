"""Facts a load measures, kept beside the model file (models/runtime/measured.py): measured once per file,
machine, onnxruntime and thread count, and read back by the next load."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from models.runtime import measured
from models.runtime.engine import load_engine
from models.runtime.measured import MEASURED, cpu_signature, remembered
from models.runtime.session import Exactness, is_bool
from models.store import integrity


class Counter:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    """A model file in a folder the store verified."""
    monkeypatch.setattr(measured, "_process", {})  # as a new process would start
    path = tmp_path / "q4.onnx"
    path.write_bytes(b"graph")
    integrity.write_verified(tmp_path, {})
    return path


def test_remembered_when_the_folder_is_not_the_stores_then_nothing_is_written_there(tmp_path, monkeypatch):
    monkeypatch.setattr(measured, "_process", {})
    path = tmp_path / "q4.onnx"
    path.write_bytes(b"graph")
    once = Counter(True)
    assert remembered(path, 2, "rows_exact", once, is_bool) is True
    assert remembered(path, 2, "rows_exact", once, is_bool) is True
    assert once.calls == 1  # kept for the process
    assert [p.name for p in tmp_path.iterdir()] == ["q4.onnx"]


def test_remembered_when_measured_once_then_a_new_process_reads_it(model_file, monkeypatch):
    first = Counter({"one_position": False, "passes": True})
    assert remembered(model_file, 2, "exactness", first, Exactness.valid) == first.value
    monkeypatch.setattr(measured, "_process", {})
    again = Counter({"one_position": True, "passes": True})
    assert remembered(model_file, 2, "exactness", again, Exactness.valid) == first.value
    assert (first.calls, again.calls) == (1, 0)


@pytest.mark.parametrize("change", ["threads", "file", "cpu", "onnxruntime"])
def test_remembered_when_what_the_kernels_depend_on_changes_then_measured_again(
    model_file, monkeypatch, change
):
    remembered(model_file, 2, "rows_exact", Counter(True), is_bool)
    monkeypatch.setattr(measured, "_process", {})
    threads = 2
    if change == "threads":
        threads = 1
    elif change == "file":
        st = model_file.stat()
        os.utime(model_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    elif change == "cpu":
        monkeypatch.setattr(measured, "cpu_signature", lambda: "aarch64|Features=asimd")
    else:
        monkeypatch.setattr(measured.ort, "__version__", "9.9.9")
    again = Counter(False)
    assert remembered(model_file, threads, "rows_exact", again, is_bool) is False
    assert again.calls == 1


def test_remembered_when_the_folder_is_read_only_then_kept_for_the_process(model_file, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(measured.Path, "write_text", refuse)
    once = Counter(True)
    assert remembered(model_file, 2, "rows_exact", once, is_bool) is True
    assert remembered(model_file, 2, "rows_exact", once, is_bool) is True
    assert once.calls == 1
    assert sorted(p.name for p in model_file.parent.iterdir()) == ["q4.onnx", integrity.VERIFIED]


@pytest.mark.parametrize(
    "junk", ["{not json", '{"schema": 1, "facts": []}', '{"schema": 99, "facts": {}}', "[]", "WRONG_TYPE"]
)
def test_remembered_when_the_file_is_damaged_then_measured_again(model_file, junk):
    if junk == "WRONG_TYPE":  # a well-formed file whose fact is not what the probe gives
        junk = json.dumps(
            {"schema": measured.SCHEMA, "facts": {measured.fact_key(model_file, 2, "rows_exact"): {}}}
        )
    (model_file.parent / MEASURED).write_text(junk)
    again = Counter(True)
    assert remembered(model_file, 2, "rows_exact", again, is_bool) is True
    assert again.calls == 1
    assert json.loads((model_file.parent / MEASURED).read_text())["schema"] == measured.SCHEMA


def test_cpu_signature_when_x86_or_arm_then_the_first_core_names_it(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\nflags\t\t: avx2 avx512f fma\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\nflags\t\t: avx2\n"
    )
    arm = tmp_path / "arm"
    arm.write_text(
        "processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\nCPU implementer\t: 0x41\nCPU part\t: 0xd0b\n"
    )
    sig = cpu_signature.__wrapped__
    assert "flags=avx2 avx512f fma" in sig(x86) and "model name=Xeon" in sig(x86)
    assert "Features=asimd asimddp fp i8mm" in sig(arm) and "CPU part=0xd0b" in sig(arm)
    assert sig(tmp_path / "absent").count("|") == 0  # the architecture alone


def test_engine_when_loaded_twice_then_the_second_load_reads_the_probes(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The real seam: a load writes the probes' results beside the variant's file in a folder the store
    verified; a load in a new process reads them, and its session's properties say the same."""
    monkeypatch.setattr(measured, "_process", {})
    vdir = shutil.copytree(tiny_model_dir, tmp_path / "version", ignore=shutil.ignore_patterns(MEASURED))
    integrity.write_verified(vdir, {})
    first = load_engine(vdir, variant="q4-a8")
    sess = first.session()
    facts = json.loads((vdir / MEASURED).read_text())["facts"]
    exactness = next(v for k, v in facts.items() if k.startswith("exactness|q4-a8.onnx|"))
    assert exactness == {"one_position": sess.positions_exact, "passes": sess.passes_exact}

    monkeypatch.setattr(measured, "_process", {})
    monkeypatch.setattr("models.runtime.session.measure_exactness", lambda *a: pytest.fail("probed again"))
    second = load_engine(vdir, variant="q4-a8").session()
    assert (second.positions_exact, second.passes_exact) == (sess.positions_exact, sess.passes_exact)
