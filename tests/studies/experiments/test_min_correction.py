"""studies/experiments/min_correction.py strips exactly the min term's nodes (else its timing difference would
measure something else): every block sum and correction Gemm go, nothing else, and the graph still
runs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx

from studies.experiments.min_correction import stripped_copy


def _ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def _logits(model_dir) -> np.ndarray:
    from models.runtime.engine import load_engine
    from models.runtime.session import KVCache

    s = load_engine(model_dir, variant="q4-a8", threads=1).session()
    ids = np.array([5, 17, 42, 9])
    return s.run(ids, KVCache(s.shape, len(ids)), 0).copy()


def test_stripped_graph_drops_the_min_term_and_only_it(tiny_model_dir, tmp_path) -> None:
    before = _ops(tiny_model_dir / "q4-a8.onnx")
    assert before["Gemm"] > 0  # the tiny model's matrices are Q4_1: every linear carries the min term
    dropped = stripped_copy(tiny_model_dir, "q4-a8", tmp_path / "stripped")
    after = _ops(tmp_path / "stripped" / "q4-a8.onnx")

    # block sums: a ReduceSum per block-summed input (converter 13 on; before, a MatMul with an indicator);
    # the one ReduceSum left is the attention mask's
    sums = before["MatMul"] + before["ReduceSum"] - 1
    assert sums > 0
    assert after["Gemm"] == 0 and after["MatMul"] == 0 and after["ReduceSum"] == 1
    assert dropped == before["Gemm"] + sums
    assert after == before - Counter(
        {"Gemm": before["Gemm"], "MatMul": before["MatMul"], "ReduceSum": before["ReduceSum"] - 1}
    )
    # it runs, and the min term mattered: the stripped graph's logits are not the model's
    full, stripped = _logits(tiny_model_dir), _logits(tmp_path / "stripped")
    assert np.isfinite(stripped).all()
    assert np.abs(full - stripped).max() > 1e-3
