"""A tied head over a vocabulary-sized table runs as MatMulNBits over slices of the one table the lookup
gathers from (models/convert/embedding.py tied_head): onnxruntime then holds only one slice's original codes
beside the packed head while it prepacks, instead of the whole table. Same logits, same bytes on disk."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from models.convert import embedding, linear
from models.convert.model import GGUFModel
from models.convert.pipeline import convert
from models.runtime.session import DecoderSession, KVCache, ModelShape
from tests.models.runtime.helpers import assert_genai_runs_alike
from tests.tiny_gguf import write_tiny_gguf

IDS = [5, 40, 77, 100, 3, 9, 250, 12, 30, 31, 200, 7]
SOURCES = {
    "gemma3-Q8_0": {"family": "gemma3", "matrix_type": "Q8_0"},  # Gemma 3's table: 8-bit, no correction
    "llama-Q4_1": {"matrix_type": "Q4_1"},  # a table with a min: each slice has its own correction
}


def external(t: onnx.TensorProto) -> tuple[int, int]:
    info = {e.key: e.value for e in t.external_data}
    return int(info["offset"]), int(info["length"])


def logits(folder: Path, shape: ModelShape) -> np.ndarray:
    sess = DecoderSession(folder / "q4-a8.onnx", shape, 1)
    kv = KVCache(shape, 64)
    steps = [sess.run(np.array([t]), kv, pos).copy() for pos, t in enumerate(IDS)]
    return np.stack([*steps, sess.run(np.array(IDS), KVCache(shape, 64), 0).copy()])


@pytest.fixture(scope="module", params=sorted(SOURCES))
def whole_and_sliced(request, tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    g = write_tiny_gguf(root / "m.gguf", seed=5, **SOURCES[request.param])
    whole, sliced = root / "whole", root / "sliced"
    whole.mkdir()
    sliced.mkdir()
    convert(g, whole, variants=["q4-a8"], measure=False)
    t = GGUFModel(g).tensor("token_embd.weight")
    assert t.rows % 64, "the last slice should be a short one"
    with pytest.MonkeyPatch.context() as mp:  # slices of 64 rows (the smallest): several, the last short
        mp.setattr(linear, "SLICE_BYTES", 1)
        frag = convert(g, sliced, variants=["q4", "q4-a8"], measure=False)
    (sliced / "manifest.json").write_text(json.dumps(frag))  # what the engine opens
    return g, whole, sliced


def test_tied_head_when_sliced_then_slices_tile_the_lookups_table(whole_and_sliced):
    g, _, sliced = whole_and_sliced
    m = onnx.load(str(sliced / "q4-a8.onnx"), load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    heads = [n for n in m.graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("token_embd.")]
    rows = GGUFModel(g).tensor("token_embd.weight").rows
    assert len(heads) == -(-rows // 64)
    assert "token_embd.qweight" not in inits  # no node reads the whole table but the lookup's alias
    for table, lookup in ((1, "token_embd.gather_qweight"), (2, "token_embd.gather_scales")):
        spans = [external(inits[n.input[table]]) for n in heads]
        start, length = external(inits[lookup])
        assert spans[0][0] == start
        assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(spans))  # back to back
        assert sum(n for _, n in spans) == length
    assert [int(inits[n.input[1]].dims[0]) for n in heads][-1] == rows % 64
    # the exact variant's lookup reads the same bytes: the table is in the weights file once
    q4 = onnx.load(str(sliced / "q4.onnx"), load_external_data=False)
    q4_lookup = {t.name: t for t in q4.graph.initializer}["token_embd.gather_qweight"]
    assert external(q4_lookup) == external(inits["token_embd.gather_qweight"])


def test_tied_head_when_sliced_then_same_logits_as_one_node(whole_and_sliced):
    g, whole, sliced = whole_and_sliced
    c = GGUFModel(g).config
    shape = ModelShape(c.n_layers, c.n_kv_heads, c.head_dim, c.vocab)
    np.testing.assert_allclose(logits(sliced, shape), logits(whole, shape), rtol=0, atol=1e-5)


def test_tied_head_when_sliced_then_onnxruntime_genai_runs_it_alike(whole_and_sliced):
    _, _, sliced = whole_and_sliced
    assert_genai_runs_alike(sliced)


def test_tied_head_when_no_correction_then_it_writes_the_logits_output_with_the_same_values(tmp_path):
    """Gemma 3's Q8_0 table: the head's own last node (Concat of the slices, or the one MatMulNBits) is the
    logits output, with no Reshape copying a vocabulary's worth of floats into the bound buffer each token;
    the values are bit for bit those of the graph that reshaped (converter 8)."""
    g = write_tiny_gguf(tmp_path / "m.gguf", seed=5, **SOURCES["gemma3-Q8_0"])
    c = GGUFModel(g).config
    shape = ModelShape(c.n_layers, c.n_kv_heads, c.head_dim, c.vocab)
    for chunk in (1, linear.SLICE_BYTES):  # sliced (a Concat) and one node
        folders = {}
        for writes in (True, False):
            out = tmp_path / f"{chunk}-{writes}"
            out.mkdir()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(linear, "SLICE_BYTES", chunk)
                mp.setattr(embedding, "HEAD_WRITES_LOGITS", writes)
                convert(g, out, variants=["q4-a8"], measure=False)
            folders[writes] = out
        m = onnx.load(str(folders[True] / "q4-a8.onnx"), load_external_data=False)
        last = next(n for n in m.graph.node if "logits" in n.output)
        assert last.op_type == ("Concat" if chunk == 1 else "MatMulNBits")
        np.testing.assert_array_equal(logits(folders[True], shape), logits(folders[False], shape))
        rows = [  # every position's row at once (a speculative verification pass)
            DecoderSession(folders[w] / "q4-a8.onnx", shape, 1).run_last(
                np.array(IDS), KVCache(shape, 64), 0, len(IDS)
            )
            for w in (True, False)
        ]
        assert rows[0].shape == (len(IDS), c.vocab)
        np.testing.assert_array_equal(rows[0], rows[1])
