"""Re-encode one dequantized matrix for MatMulNBits' cheapest stock layout (the `fast` variant).

A pure function from a float matrix (n, k) to the arrays of one MatMulNBits node: codes, fp32 scales and,
for the asymmetric form, uint4 / uint8 zero points. Nothing here reads a file or knows a model.

    W[r, j] ~= scale[r, b] * (u[r, j] - zp[r, b])        b = j // block

Unlike the exact variants (models/gguf/quant.py), this is a second quantization: its error is measured by
the converter (KL against the fp32 reference) and a variant worse than the floor is not installed.

The rounding is error-aware, as llama.cpp's quantizers do it (make_qkx2_quants, make_qx_quants): for every
block, a grid of candidate scales is tried; for each, the codes are rounded, then the scale (and the zero
point, an integer here) are refitted by weighted least squares, and the candidate with the smallest
weighted squared error is kept. `importance` weights the columns (the mean square of the activations that
multiply them, when known); within a block each value is also weighted by its own magnitude
(llama.cpp's `av_x + |x|`), so the large weights, which dominate the products, are kept closest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.gguf.quant import PackedNBits, pack_nibbles

ROWS_PER_CHUNK = 1024  # rows re-encoded at a time: a few (rows, k) float32 temporaries stay small
SEARCH_STEPS = 12  # candidate scales per block (llama.cpp's make_qkx2_quants tries 21 for Q4_K)
SEARCH_LO, SEARCH_HI = -1.0, 1.0


@dataclass(frozen=True)
class Encoding:
    """One MatMulNBits layout: `bits` 4 or 8, `block` a power of two >= 16 dividing k, and whether each
    block has an integer zero point of its own (asymmetric) or the kernel's default (8 or 128: symmetric)."""

    bits: int
    block: int
    zero_point: bool

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"no MatMulNBits layout {self}")

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    @property
    def name(self) -> str:
        return f"{self.bits}-bit block {self.block}" + (" + zero points" if self.zero_point else "")


def requantize(w: np.ndarray, enc: Encoding, importance: np.ndarray | None = None) -> PackedNBits:
    """w (n, k) float -> the PackedNBits of one MatMulNBits node (zero points packed as the kernel reads
    them: two 4-bit ones a byte, low nibble first). `importance` (k,) >= 0 weights the columns."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    if k % enc.block:
        raise ValueError(f"k={k} is not a multiple of the block {enc.block}")
    nb = k // enc.block
    imp = None if importance is None else np.asarray(importance, np.float32).reshape(nb, enc.block)
    codes = np.empty((n, nb, enc.block), np.uint8)
    scales = np.empty((n, nb), np.float32)
    zps = np.empty((n, nb), np.uint8)
    for lo in range(0, n, ROWS_PER_CHUNK):
        hi = min(lo + ROWS_PER_CHUNK, n)
        x = w[lo:hi].reshape(hi - lo, nb, enc.block)
        fit = _fit_asymmetric if enc.zero_point else _fit_symmetric
        codes[lo:hi], scales[lo:hi], zps[lo:hi] = fit(x, _weights(x, imp), enc)
    packed = pack_nibbles(codes) if enc.bits == 4 else codes
    zero_points = None
    if enc.zero_point:
        zero_points = pack_nibbles(np.pad(zps, ((0, 0), (0, nb % 2)))) if enc.bits == 4 else zps
    return PackedNBits(enc.bits, n, k, packed, scales, zero_points=zero_points, block=enc.block)


def _weights(x: np.ndarray, imp: np.ndarray | None) -> np.ndarray:
    """Per value: the column's importance times (rms of the block + |x|)."""
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
    v = rms + np.abs(x)
    if imp is not None:
        v = v * imp[None]
    return v + np.float32(1e-30)


def _keep_best(best: list[np.ndarray], err: np.ndarray, s: np.ndarray, z: np.ndarray, q: np.ndarray) -> None:
    """best = [err, scale, zero point, codes]: where err is lower, take the candidate's."""
    better = err < best[0]
    best[0][better], best[1][better], best[2][better] = err[better], s[better], z[better]
    best[3][better] = q[better]


def _refit(vx: np.ndarray, v: np.ndarray, sxx: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The least-squares scale for fixed integer codes q (x ~ s * q) and its weighted squared error,
    sum(v x^2) - (sum(v x q))^2 / sum(v q^2), with no pass over the reconstruction."""
    sxq = np.sum(vx * q, axis=-1)
    sqq = np.sum(v * q * q, axis=-1)
    ok = sqq > 0
    s = np.where(ok, sxq / np.where(ok, sqq, 1), 0).astype(np.float32)
    return s, sxx - np.where(ok, sxq * s, 0)


def _fit_symmetric(x: np.ndarray, v: np.ndarray, enc: Encoding) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q in [-half, half - 1] (u = q + half): candidate scales put the value of largest magnitude near
    either end of the range; each is refitted by least squares for its rounded codes."""
    half = 1 << (enc.bits - 1)
    idx = np.abs(x).argmax(axis=-1)
    peak = np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]  # signed
    safe = np.where(peak == 0, np.float32(1), peak)
    vx = v * x
    sxx = np.sum(vx * x, axis=-1)
    shape = x.shape[:-1]
    best = [np.full(shape, np.inf, np.float32), np.zeros(shape, np.float32), np.zeros(shape, np.float32)]
    best.append(np.zeros(x.shape, np.float32))
    # 8 bits: the peak at either end, no search (the rounding error is ~1e-5 of the weights' energy)
    offsets = np.linspace(-0.5, 0.5, SEARCH_STEPS // 2) if enc.bits == 4 else np.zeros(1)
    targets = np.concatenate([-half + offsets, half - 1 + offsets])
    for target in targets:
        q = np.clip(np.rint(x * (np.float32(target) / safe)[..., None]), -half, half - 1)
        s, err = _refit(vx, v, sxx, q)
        _keep_best(best, err, s, best[2], q)
    codes = (best[3] + half).astype(np.uint8)
    return codes, best[1], np.full(shape, half, np.uint8)


def _fit_asymmetric(x: np.ndarray, v: np.ndarray, enc: Encoding) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """u in [0, qmax] with an integer zero point z per block: W = s * (u - z). Candidate scales spread the
    block's range over qmax + step levels; z puts zero on the grid; the scale is refitted by least squares
    for the rounded codes."""
    qmax = enc.qmax
    mn = np.minimum(x.min(axis=-1), 0)  # the range always holds zero: z is then inside [0, qmax]
    mx = np.maximum(x.max(axis=-1), 0)
    span = np.where(mx > mn, mx - mn, np.float32(1))
    vx = v * x
    sxx = np.sum(vx * x, axis=-1)
    shape = x.shape[:-1]
    best = [np.full(shape, np.inf, np.float32), np.zeros(shape, np.float32), np.zeros(shape, np.float32)]
    best.append(np.zeros(x.shape, np.float32))
    steps = SEARCH_STEPS if enc.bits == 4 else 1
    for step in np.linspace(SEARCH_LO, SEARCH_HI, steps) if steps > 1 else [0.0]:
        inv = (qmax + np.float32(step)) / span
        z = np.clip(np.rint(-mn * inv), 0, qmax)
        q = np.clip(np.rint(x * inv[..., None]) + z[..., None], 0, qmax) - z[..., None]
        s, err = _refit(vx, v, sxx, q)
        _keep_best(best, err, s, z, q)
    # then the neighbouring zero points at the best scale: the candidates put z where the minimum lands,
    # which for a skewed block is not always where the weighted error is smallest
    for dz in (-1, 1):
        s0 = np.where(best[1] > 0, best[1], 1)
        z = np.clip(best[2] + dz, 0, qmax)
        q = np.clip(np.rint(x / s0[..., None]) + z[..., None], 0, qmax) - z[..., None]
        s, err = _refit(vx, v, sxx, q)
        _keep_best(best, err, s, z, q)
    codes = (best[3] + best[2][..., None]).astype(np.uint8)
    return codes, best[1], best[2].astype(np.uint8)


def relative_error(w: np.ndarray, p: PackedNBits, importance: np.ndarray | None = None) -> float:
    """sum(imp * (w - w')^2) / sum(imp * w^2): how much of the matrix's (weighted) energy the encoding
    loses. With `importance` the mean square activation per column, it is the relative error of the layer's
    output on those activations when the errors of different columns do not correlate."""
    d = (np.asarray(w, np.float32) - p.dequantize()) ** 2
    ref = np.asarray(w, np.float32) ** 2
    if importance is not None:
        d, ref = d * importance[None], ref * importance[None]
    return float(d.sum() / max(float(ref.sum()), 1e-30))
