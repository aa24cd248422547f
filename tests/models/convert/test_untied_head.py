"""An untied head (output.weight, as in Llama 3 and some Qwen GGUFs) runs as MatMulNBits over slices of its
rows (models/convert/linear.py row_sliced, the function the tied head uses): onnxruntime then holds one
slice's original codes beside the packed head while it prepacks, not the whole matrix. Each slice carries its
own rows of the scales, of the correction for formats with a min, and of a nibble pair's codes in the exact
variant; the logits are those of one node."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from models.convert import linear
from models.convert.model import GGUFModel
from models.convert.pipeline import convert
from models.convert.reference import ReferenceForward
from models.gguf.quant import Layout
from tests.helpers import shape_of
from tests.models.convert.helpers import logits_per_position, small_logits
from tests.models.runtime.helpers import assert_genai_runs_alike
from tests.tiny_gguf import TinySpec, write_tiny_gguf

IDS = [5, 40, 77, 100, 3, 9, 250, 12, 30, 31, 200, 7]
VARIANTS = ("q4", "q4-a8")  # the exact variant and int8 activations
SPEC = TinySpec(hidden=256, ffn=256, tied=False)  # K-quant blocks hold 256 values
SOURCES = {  # how each head runs in q4 / q4-a8
    "Q6_K": "nibble pair, 16-wide blocks / 8-bit block 16",
    "Q8_0": "nibble pair / 8-bit",
    "Q4_K": "4-bit + offset correction (a min) in both",
    "Q2_K": "4-bit, 16-wide blocks + offset correction in both",
    "Q4_1": "4-bit + offset correction in both",
    "Q5_K": "nibble pair + offset correction / 8-bit + offset correction",
    "Q3_K": "4-bit, 16-wide blocks in both",
}
SLICE = 64  # rows per slice when SLICE_BYTES is 1 (the smallest slice)


@pytest.fixture(scope="module", params=sorted(SOURCES))
def whole_and_sliced(request, tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    g = small_logits(
        write_tiny_gguf(
            root / "m.gguf",
            seed=7,
            matrix_type="Q8_0",
            spec=SPEC,
            tensor_types={"output.weight": request.param},
        )
    )
    assert GGUFModel(g).tensor("output.weight").type_name == request.param
    whole, sliced = root / "whole", root / "sliced"
    whole.mkdir()
    sliced.mkdir()
    convert(g, whole, variants=list(VARIANTS), measure=False)
    with pytest.MonkeyPatch.context() as mp:  # slices of 64 rows: several, the last one short
        mp.setattr(linear, "SLICE_BYTES", 1)
        frag = convert(g, sliced, variants=list(VARIANTS), measure=False)
    (sliced / "manifest.json").write_text(json.dumps(frag))  # what the engine opens
    return g, whole, sliced


def head_parts(folder: Path, variant: str) -> list[dict[str, np.ndarray | int]]:
    """Per head MatMulNBits node, in the order the Concat joins them: its N and its weights (codes, scales,
    zero points, and the correction the Gemm after it adds), read from the weights file."""
    m = onnx.load(str(folder / f"{variant}.onnx"))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    nodes = [n for n in m.graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("lm_head.")]
    gemm_of = {n.input[2]: n for n in m.graph.node if n.op_type == "Gemm" and len(n.input) == 3}
    parts, outs = [], []
    for n in nodes:
        attrs = {a.name: a.i for a in n.attribute}
        part: dict[str, np.ndarray | int] = {"N": attrs["N"], "qweight": inits[n.input[1]]}
        part["scales"] = inits[n.input[2]]
        if len(n.input) > 3:
            part["zero_points"] = inits[n.input[3]]
        out = n.output[0]
        if out in gemm_of:
            part["correction"] = inits[gemm_of[out].input[1]]
            out = gemm_of[out].output[0]
        parts.append(part)
        outs.append(out)
    if len(parts) > 1:
        assert any(n.op_type == "Concat" and list(n.input) == outs for n in m.graph.node)
    return parts


@pytest.mark.parametrize("variant", VARIANTS)
def test_untied_head_when_sliced_then_slices_cover_the_rows_back_to_back(whole_and_sliced, variant):
    g, whole, sliced = whole_and_sliced
    rows = GGUFModel(g).tensor("output.weight").rows
    assert rows % SLICE, "the last slice should be a short one"
    (one,) = head_parts(whole, variant)  # a tiny head stays one node by default
    parts = head_parts(sliced, variant)
    assert [p["N"] for p in parts] == [SLICE] * (rows // SLICE) + [rows % SLICE]
    assert set(parts[0]) == set(one)
    for key in set(one) - {"N"}:
        axis = 1 if key == "correction" else 0  # the correction is (blocks, rows)
        joined = np.concatenate([p[key] for p in parts], axis=axis)
        assert joined.tobytes() == one[key].tobytes(), key  # exactly the one node's rows, in order


@pytest.mark.parametrize("variant", VARIANTS)
def test_untied_head_when_sliced_then_same_logits_as_one_node(whole_and_sliced, variant):
    g, whole, sliced = whole_and_sliced
    shape = shape_of(g)
    np.testing.assert_allclose(
        logits_per_position(sliced / f"{variant}.onnx", shape, IDS),
        logits_per_position(whole / f"{variant}.onnx", shape, IDS),
        rtol=0,
        atol=1e-5,
    )


def test_untied_head_when_sliced_then_exact_variant_matches_reference(whole_and_sliced):
    g, _, sliced = whole_and_sliced
    ref = ReferenceForward(GGUFModel(g)).logits(IDS)
    got = logits_per_position(sliced / "q4.onnx", shape_of(g), IDS)
    np.testing.assert_allclose(got, np.concatenate([ref, ref[-1:]]), rtol=0, atol=1e-4)


def test_untied_head_when_sliced_then_onnxruntime_genai_runs_it_alike(whole_and_sliced):
    _, _, sliced = whole_and_sliced
    assert_genai_runs_alike(sliced)


@pytest.mark.parametrize(
    ("layout", "slices"),
    [
        (Layout.of("Q6_K", 128256, 640, bits=8, block=16), 3),  # 82 MB of codes: Llama 3.2 1B's shape
        (Layout.of("Q8_0", 151936, 896, bits=8), 5),  # Qwen 2.5 0.5B's (136 MB)
        (Layout.of("Q4_K", 128256, 4096), 8),  # Llama 3 8B's at 4 bits (263 MB)
        (Layout.of("Q8_0", 49152, 576, bits=8), 1),  # SmolLM2's size: 28 MB stays one node
    ],
)
def test_slice_rows_when_vocabulary_sized_then_slices_of_about_32_mib_on_64_row_bounds(layout, slices):
    rows = linear.slice_rows(layout, linear.SLICE_BYTES)
    assert rows % 64 == 0
    assert -(-layout.n // rows) == slices
    if slices > 1:
        assert linear.SLICE_BYTES - 64 * layout.k * layout.bits // 8 < rows * layout.k * layout.bits // 8
        assert rows * layout.k * layout.bits // 8 <= linear.SLICE_BYTES
