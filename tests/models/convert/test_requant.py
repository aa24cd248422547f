"""The `fast` variant's re-encoder (models/convert/requant.py): its arrays are what MatMulNBits computes
with (one real node against the PackedNBits' own dequantization), a matrix already on such a grid comes
back exactly, and the error-aware search beats plain min/max rounding on the error it minimises."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.convert.fast_plan import PLANS
from models.convert.requant import Encoding, relative_error, requantize
from models.gguf.quant import PackedNBits, pack_nibbles

MS = "com.microsoft"
ENCODINGS = [Encoding(4, 32, True), Encoding(4, 64, False), Encoding(4, 128, True), Encoding(8, 32, False)]


def heavy_tailed(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Weights like a trained model's: mostly small, a few large, each row its own scale."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, (n, k)).astype(np.float32) * 0.02
    return w * rng.uniform(0.5, 2.0, (n, 1)).astype(np.float32) + 0.003


def kernel(p: PackedNBits, x: np.ndarray) -> np.ndarray:
    """One MatMulNBits node over the arrays, fp32 activations (accuracy_level 1: exact arithmetic)."""
    inits = [numpy_helper.from_array(p.packed, "w"), numpy_helper.from_array(p.scales, "s")]
    inputs = ["x", "w", "s"]
    if p.zero_points is not None:
        inits.append(numpy_helper.from_array(p.zero_points, "z"))
        inputs.append("z")
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["y"],
        domain=MS,
        K=p.k,
        N=p.n,
        bits=p.bits,
        block_size=p.block,
        accuracy_level=1,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", p.k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", p.n])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("enc", ENCODINGS, ids=lambda e: e.name)
def test_requantize_when_run_by_matmulnbits_then_kernel_computes_with_the_dequantized_matrix(enc):
    w = heavy_tailed(48, 256)
    p = requantize(w, enc)
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    expected = x @ p.dequantize().T
    np.testing.assert_allclose(kernel(p, x), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert relative_error(w, p) < (0.02 if enc.bits == 4 else 1e-4)


def test_requantize_when_matrix_is_on_a_zero_point_grid_then_exact():
    rng = np.random.default_rng(2)
    n, k, block = 16, 128, 32
    u = rng.integers(0, 16, (n, k // block, block))
    u[..., 0], u[..., 1] = 0, 15  # every block spans the whole range: the first candidate scale is the grid's
    z = rng.integers(0, 16, (n, k // block, 1))
    s = rng.uniform(0.01, 0.1, (n, k // block, 1)).astype(np.float32)
    w = (s * (u - z)).astype(np.float32).reshape(n, k)
    p = requantize(w, Encoding(4, block, True))
    np.testing.assert_allclose(p.dequantize(), w, rtol=1e-6, atol=1e-7)


def test_requantize_when_q8_grid_then_exact_at_8_bits():
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, (8, 2, 32))
    q[..., 0] = 127  # the block's peak: Q8_0 maps it to 127
    d = rng.uniform(0.001, 0.01, (8, 2, 1)).astype(np.float32)
    w = (d * q).astype(np.float32).reshape(8, 64)
    p = requantize(w, Encoding(8, 32, False))
    np.testing.assert_allclose(p.dequantize(), w, rtol=1e-6, atol=1e-8)


def minmax(w: np.ndarray, block: int) -> PackedNBits:
    """The plain rounding the search is measured against: scale = range / 15, the nearest zero point."""
    n, k = w.shape
    x = w.reshape(n, k // block, block)
    mn, mx = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    s = ((mx - mn) / 15).astype(np.float32)
    z = np.clip(np.rint(-mn / s), 0, 15)
    u = np.clip(np.rint(x / s[..., None]) + z[..., None], 0, 15).astype(np.uint8)
    zp = pack_nibbles(np.pad(z.astype(np.uint8), ((0, 0), (0, (k // block) % 2))))
    return PackedNBits(4, n, k, pack_nibbles(u), s, zero_points=zp, block=block)


@pytest.mark.parametrize("block", [32, 128])
def test_requantize_when_compared_with_min_max_rounding_then_smaller_weighted_error(block):
    w = heavy_tailed(64, 512, seed=4)
    searched, plain = requantize(w, Encoding(4, block, True)), minmax(w, block)
    # the weighting of the search: each value by |w| + its block's rms
    x = w.reshape(64, -1, block)
    v = (np.abs(x) + np.sqrt((x * x).mean(-1, keepdims=True))).reshape(w.shape)

    def weighted(p: PackedNBits) -> float:
        return float((v * (w - p.dequantize()) ** 2).sum())

    assert weighted(searched) < 0.97 * weighted(plain)
    assert relative_error(w, searched) < relative_error(w, plain)


def test_requantize_when_k_not_a_multiple_of_block_then_value_error():
    with pytest.raises(ValueError, match="multiple"):
        requantize(np.zeros((2, 96), np.float32), Encoding(4, 64, True))


@pytest.mark.parametrize("bad", [(3, 32, True), (4, 24, False), (4, 8, True)])
def test_encoding_when_not_a_matmulnbits_layout_then_value_error(bad):
    with pytest.raises(ValueError):
        Encoding(*bad)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_plan_choose_when_k_not_a_multiple_of_the_block_then_widest_block_that_divides(plan):
    for type_name, head in (("Q4_K", False), ("Q6_K", False), ("Q8_0", True)):
        enc = plan.choose(type_name, 576, head=head)  # SmolLM2's hidden size: 576 = 9 x 64
        assert enc is None or (576 % enc.block == 0 and enc.block >= 32)
