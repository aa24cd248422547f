"""The split forms studies/experiments/split_8bit.py times are exact decompositions of the 8-bit matrix (else
its timings compare different matrices)."""

from __future__ import annotations

import numpy as np
import pytest

from studies.experiments.quant_routes import matmul_session
from studies.experiments.split_8bit import candidates, graph, random_weights


def term_sum(c, k: int) -> np.ndarray:
    """The matrix a candidate multiplies by: its terms (a doubled one folded back onto K) + its correction."""
    w = 0
    for t in c.terms:
        tw = t.weight()
        w = w + (tw[:, :k] + tw[:, k:] if t.doubled else tw)
    if c.correction is not None:
        w = w + np.repeat(c.correction.T.astype(np.float64), c.corr_block, axis=1)
    return w


@pytest.mark.parametrize("fmt", ["Q5_0", "Q6_K"])
def test_every_split_is_the_same_matrix(fmt: str) -> None:
    n, k = 128, 64
    w = random_weights(n, k, fmt, seed=3)
    exact = w.dequantize()
    for name, c in candidates(w, acc=4).items():
        if name.startswith("4-bit alone"):
            continue
        assert np.array_equal(term_sum(c, k), exact), name


@pytest.mark.parametrize("fmt", ["Q5_0", "Q6_K"])
def test_split_graphs_match_the_reference_with_fp32_activations(fmt: str) -> None:
    n, k = 128, 64
    w = random_weights(n, k, fmt, seed=4)
    x = np.random.default_rng(5).standard_normal((3, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.dequantize().T
    for name, c in candidates(w, acc=1).items():
        if name.startswith("4-bit alone"):
            continue
        y = matmul_session(*graph([c], k, n, acc=1), k, n, 1, c.options).run(None, {"x": x})[0]
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), name
