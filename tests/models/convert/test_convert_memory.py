"""A conversion streams: one tensor dequantized and encoded at a time, written straight to the weights file,
the reference forward a layer at a time, the variant measured a segment at a time. Peak memory is measured
in a subprocess (its high-water mark) on a synthetic GGUF large enough to show the difference."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from models.convert import measure, pipeline
from models.convert.graph import VARIANTS, GraphBuilder, Segment, WeightFile
from models.convert.memory_need import estimate_memory
from models.convert.model import GGUFModel
from models.convert.pipeline import convert
from models.errors import InsufficientMemory, VerificationFailed
from models.store.store import ModelStore, default_converter
from server.cli import main as cli
from server.settings import Settings
from tests.tiny_gguf import TinySpec, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[3]
# 12 layers of 512 x 1536: 38M parameters, 21 MB as Q4_0, 151 MB in fp32
WIDE = TinySpec(n_layers=12, hidden=512, ffn=1536, n_heads=8, n_kv_heads=4, context_length=256)

PEAK = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import psutil
    sys.modules["llama_cpp"] = None  # the converter's own memory: llama.cpp's, when it measures, is its own
    from models.convert.pipeline import convert
    from tests.tiny_gguf import write_tiny_gguf
    # The same conversion of a tiny model first: the code it runs is then loaded (and, under qemu-user,
    # translated: qemu's code cache is part of this process's RSS, 30-40 MB of it on an emulated
    # Cortex-A76), and the peak is reset after it (clear_refs 5), so what is measured is the data.
    warm = Path(sys.argv[2]) / "warm"
    warm.mkdir()
    tiny = write_tiny_gguf(warm / "t.gguf", matrix_type="Q4_0")
    (warm / "out").mkdir()
    convert(tiny, warm / "out", variants=["q4-a8"], threads=1)
    Path("/proc/self/clear_refs").write_text("5")
    before = psutil.Process().memory_info().rss
    convert(Path(sys.argv[1]), Path(sys.argv[3]), variants=["q4-a8"], threads=1)
    # VmHWM: this process's own high-water mark (ru_maxrss would carry the forking parent's across exec)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    print(json.dumps({"before": before, "peak": int(status["VmHWM"].split()[0]) * 1024}))
    """
)


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("wide") / "wide.gguf", matrix_type="Q4_0", spec=WIDE)


def fp32_bytes(model: GGUFModel) -> int:
    return sum(4 * r * c for r, c in model.shapes.values())


@pytest.fixture(scope="module")
def wide_peak(wide_gguf: Path, tmp_path_factory) -> dict[str, int]:
    """The wide model's conversion in a subprocess: its RSS at the start and its high-water mark. Once per
    module: emulated (make test-arm64) one conversion takes minutes."""
    work = tmp_path_factory.mktemp("peak")
    out = work / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", PEAK, str(wide_gguf), str(work), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_convert_when_model_is_many_times_its_size_in_fp32_then_peak_memory_stays_a_fraction_of_it(
    wide_gguf: Path, wide_peak: dict[str, int]
) -> None:
    got = wide_peak
    grew = got["peak"] - got["before"]
    whole = fp32_bytes(GGUFModel(wide_gguf))
    # Holding the model in fp32 (the reference's old layer cache) or the GGUF's pages, or a whole table's
    # temporaries, would cost more than half of it; streamed, the largest piece is a segment's session.
    assert grew < whole // 2, (
        f"the conversion took {grew / 1e6:.0f} MB over its start ({whole / 1e6:.0f} MB fp32)"
    )


def test_measure_when_split_into_segments_then_the_same_numbers_as_the_whole_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = write_tiny_gguf(tmp_path / "q.gguf", matrix_type="Q4_1", embed_type="Q8_0", family="qwen2")
    got = {}
    for budget in (1 << 40, 1):  # everything in one segment; one layer per segment and the head alone
        monkeypatch.setattr(measure, "SEGMENT_BYTES", budget)
        out = tmp_path / f"out-{budget}"
        out.mkdir()
        fragment = convert(gguf, out, variants=["q4", "q4-a8"], threads=1)
        got[budget] = {name: v["quality"] for name, v in fragment["variants"].items()}
        segments = {v["speed"]["segments"] for v in fragment["variants"].values()}
        assert segments == ({1} if budget > 1 else {3})
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # segment graphs removed
    assert got[1] == got[1 << 40]


def test_plan_segments_when_budget_holds_a_few_layers_then_consecutive_ranges_and_the_head_alone(
    wide_gguf: Path,
) -> None:
    model = GGUFModel(wide_gguf)
    per_layer = measure.layer_bytes(model)[0]
    segments = measure.plan_segments(model, budget=3 * per_layer)
    assert segments == [
        Segment(0, 3),
        Segment(3, 6),
        Segment(6, 9),
        Segment(9, 12),
        Segment(12, 12, head=True),
    ]
    assert measure.plan_segments(model, budget=1 << 40) == [Segment(0, 12, head=True)]


def test_weight_file_when_arrays_written_in_bands_then_the_same_bytes_as_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from models.convert import graph

    gguf = write_tiny_gguf(tmp_path / "t.gguf", matrix_type="Q4_1", embed_type="Q8_0")
    model = GGUFModel(gguf)
    files = {}
    banded: list[int] = []
    write_bands = WeightFile._write_bands
    monkeypatch.setattr(
        WeightFile, "_write_bands", lambda w, items: banded.append(len(items)) or write_bands(w, items)
    )
    for band in (1 << 40, 256):  # whole; a few rows of the table at a time
        monkeypatch.setattr(graph, "BAND_BYTES", band)
        w = WeightFile(tmp_path / f"w-{band}.data")
        proto = GraphBuilder(model, VARIANTS["q4-a8"], w).build()
        w.close()
        places = [
            (t.name, [(e.key, e.value) for e in t.external_data if e.key != "location"])
            for t in proto.graph.initializer
        ]
        files[band] = (w.path.read_bytes(), places)
    assert files[256] == files[1 << 40]
    assert banded == [2]  # the table's codes and scales, together, in the banded build only


def test_pull_when_the_memory_budget_cannot_hold_the_conversion_then_refused_naming_its_need(
    tmp_path: Path, tiny_gguf: Path
) -> None:
    home = tmp_path / "home"
    store = ModelStore(home, converter=default_converter(), memory_free=lambda: 1 << 20)
    with pytest.raises(
        InsufficientMemory, match=r"converting tiny needs about .* of memory .*leaves 1\.0 MB"
    ):
        store.pull(str(tiny_gguf))
    assert store.list() == []
    folder = home / "models" / "tiny"  # a failed first install leaves no folder, or one without entries
    assert not folder.exists() or not [p for p in folder.iterdir() if not p.name.startswith(".")]


def test_cli_pull_when_memory_budget_too_small_then_exit_1_with_the_need(
    tmp_path: Path, tiny_gguf, capsys
) -> None:
    settings = Settings(home=tmp_path / "home", memory_budget_mb=1)
    assert cli.main(["pull", str(tiny_gguf)], settings=settings) == 1
    err = capsys.readouterr().err
    assert "needs about" in err and "SIMMER_MEMORY_BUDGET_MB" in err


def test_estimate_memory_when_measured_then_the_conversion_stays_under_it(
    wide_gguf: Path, wide_peak: dict[str, int]
) -> None:
    """The plan the store checks is an upper bound of what the conversion really takes (measured in a
    subprocess: its high-water mark over its RSS at the start)."""
    got = wide_peak
    planned = max(estimate_memory(GGUFModel(wide_gguf)).values())
    assert got["peak"] - got["before"] <= planned


def test_smoke_test_when_measured_in_segments_then_the_whole_graph_is_loaded_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generating with the whole graph would take the memory the segments kept the conversion under."""
    gguf = write_tiny_gguf(tmp_path / "m.gguf", matrix_type="Q4_1", embed_type="Q8_0")
    monkeypatch.setattr(measure, "SEGMENT_BYTES", 1)
    out = tmp_path / "out"
    out.mkdir()
    manifest = convert(gguf, out, variants=["q4-a8"], threads=1)
    monkeypatch.setattr(pipeline, "DecoderSession", None)  # a run would fail on it
    pipeline.smoke_test(out, manifest)
    # the default variant is what it loads: q4-a8, or where q4-a8 is beyond the floor (ARM's int8 kernels)
    # the exact q4 built beside it
    default = manifest["default_variant"]
    (out / manifest["variants"][default]["file"]).write_bytes(b"not a model")
    with pytest.raises(VerificationFailed, match=f"variant {default} failed to load"):
        pipeline.smoke_test(out, manifest)
