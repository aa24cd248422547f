"""Weights of the variants kept rewritten into one file holding only their bytes: the same logits from the
same graphs, the other data files gone, the copied-at-load spans moved with their bytes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from models.convert.consolidate import consolidate
from models.convert.fast_plan import PLANS
from models.convert.graph import VARIANTS, SplitWeights, WeightFile, build_variant
from models.convert.model import GGUFModel
from models.convert.pipeline import architecture_entry, remove_variant_files
from models.runtime.session import DecoderSession, KVCache, ModelShape
from tests.tiny_gguf import TinySpec, write_tiny_gguf

SPEC = TinySpec(hidden=256, ffn=256, tied=False)


def build(tmp_path: Path) -> tuple[Path, ModelShape, dict]:
    gguf = write_tiny_gguf(
        tmp_path / "t.gguf",
        matrix_type="Q4_1",
        embed_type="Q8_0",
        spec=SPEC,
        tensor_types={"output.weight": "Q6_K", "ffn_down.weight": "Q6_K"},
        name="t",
    )
    model = GGUFModel(gguf)
    out = tmp_path / "out"
    out.mkdir()
    shared, own = WeightFile(out / "weights.data"), WeightFile(out / "fast.data")
    built = {"q4-a8": build_variant(model, VARIANTS["q4-a8"], shared, out / "q4-a8.onnx")}
    fast = replace(VARIANTS["fast"], requant=PLANS[0])
    built["fast"] = build_variant(model, fast, SplitWeights(shared, own), out / "fast.onnx")
    shared.close()
    own.close()
    return out, ModelShape.from_architecture(architecture_entry(model)), built


def logits(path: Path, shape: ModelShape) -> np.ndarray:
    sess = DecoderSession(path, shape, 1)
    kv = KVCache(shape, 8)
    return np.stack([sess.run(np.array([t]), kv, i) for i, t in enumerate([3, 17, 5, 9])])


def locations(path: Path) -> set[str]:
    g = onnx.load(str(path), load_external_data=False)
    return {e.value for t in g.graph.initializer for e in t.external_data if e.key == "location"}


@pytest.mark.parametrize("keep", [["fast"], ["q4-a8"], ["q4-a8", "fast"]])
def test_consolidate_when_variants_kept_then_same_logits_from_one_file_of_their_bytes(tmp_path, keep):
    out, shape, built = build(tmp_path)
    before = {n: logits(out / f"{n}.onnx", shape) for n in keep}
    assert locations(out / "fast.onnx") == {"weights.data", "fast.data"}
    size = (out / "weights.data").stat().st_size + (out / "fast.data").stat().st_size
    for name in {"q4-a8", "fast"} - set(keep):
        remove_variant_files(out, name)
    copied = consolidate(out, "weights.data", {n: built[n].copied_by_file for n in keep})
    assert not (out / "fast.data").exists()
    for name in keep:
        assert locations(out / f"{name}.onnx") == {"weights.data"}
        np.testing.assert_array_equal(logits(out / f"{name}.onnx", shape), before[name])
        n_spans = sum(len(s) for s in built[name].copied_by_file.values())
        assert len(copied[name]) == n_spans > 0
    data = (out / "weights.data").read_bytes()
    if keep != ["q4-a8", "fast"]:
        assert len(data) < size  # the bytes of the variant dropped are gone
    # a copied span moved with its bytes: the same initializer's bytes are at the new offset
    g = onnx.load(str(out / f"{keep[0]}.onnx"), load_external_data=False)
    starts = {
        int(ext["offset"]): int(ext["length"])
        for t in g.graph.initializer
        if (ext := {e.key: e.value for e in t.external_data})
    }
    assert all(starts.get(off) == n for off, n in copied[keep[0]])
