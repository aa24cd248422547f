"""The quantized linear layer: y = x @ concat(W...)^T on MatMulNBits, with the exact Q4_1 offset correction.

Every architecture family builds its projections through `linear`, so how a GGUF tensor type maps onto
onnxruntime's kernels is decided here and nowhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from models.gguf.quant import BLOCK, concat_packed, pack_tensor

if TYPE_CHECKING:
    from models.convert.graph import GraphBuilder

MS = "com.microsoft"


def linear(
    g: GraphBuilder, x: str, key: str, names: list[str], blocksum: str | None = None, bits: int | None = None
) -> tuple[str, str | None]:
    """y = x @ concat(W_names)^T. Returns (y, blocksum of x) so a caller can reuse the block sums."""
    bits = bits or g.spec.matmul_bits
    if bits is None:
        w = np.concatenate([g.tensor(n).dequantize() for n in names], axis=0)
        wt = g.init(f"{key}.weight_t", np.ascontiguousarray(w.T))
        return g.node("MatMul", [x, wt])[0], None
    p = concat_packed([pack_tensor(g.tensor(n), bits) for n in names])
    y = g.node(
        "MatMulNBits",
        [x, g.init(f"{key}.qweight", p.packed), g.init(f"{key}.scales", p.scales)],
        domain=MS,
        K=p.k,
        N=p.n,
        bits=p.bits,
        block_size=BLOCK,
        accuracy_level=g.spec.accuracy_level,
    )[0]
    if p.correction is None:
        return y, blocksum
    if blocksum is None:
        # block sums as one small MatMul with a 0/1 block-indicator matrix (no Reshape + ReduceSum)
        ind = np.kron(np.eye(p.k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32))
        blocksum = g.node("MatMul", [x, g.init(f"block_indicator_{p.k}", ind)])[0]
    corr = g.init(f"{key}.q41_correction", p.correction)
    # Gemm adds the correction to y in the same node (the graph is 2-D: [tokens, features])
    return g.node("Gemm", [blocksum, corr, y])[0], blocksum
