"""Map GGUF weights onto onnxruntime's MatMulNBits / GatherBlockQuantized layouts.

MatMulNBits computes y = x @ W^T with W[n, k] = (q[n, k] - zp) * scale[n, k // 32]. We always use the default
zero point (8 for 4 bits, 128 for 8 bits): integer zero points keep the fast kernels, float ones take a slow
path. A Q4_1 block (value = d*q + m) then needs a per-block correction: d*q + m = (q - 8)*d + (m + 8d), so
y = MatMulNBits(x) + blocksum(x) @ corr^T with corr[n, b] = m + 8d. This is exact, not a re-quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.gguf.reader import BLOCK_BYTES, Tensor, unpack_q4_nibbles

BLOCK = 32


@dataclass
class PackedNBits:
    """Inputs of one MatMulNBits node (and the optional Q4_1 correction)."""

    bits: int
    n: int
    k: int
    packed: np.ndarray  # uint8 (n, k/32, 32*bits/8)
    scales: np.ndarray  # float32 (n, k/32)
    correction: np.ndarray | None = None  # float32 (k/32, n): blocksum(x) @ correction
    zero_points: np.ndarray | None = None  # uint8 (n, ceil(k/32 / 2)) for 4 bits; None = the default

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in (self.correction, self.zero_points) if a is not None)
        return self.packed.nbytes + self.scales.nbytes + extra


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q: (..., 32) values 0..15 -> (..., 16) bytes, element 2i in the low nibble (MatMulNBits order)."""
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def pack_tensor(t: Tensor, bits: int) -> PackedNBits:
    """Exact mapping where the source allows it (Q4_0/Q4_1 -> 4 bits, Q8_0 -> 8 bits); otherwise quantize
    the dequantized floats symmetrically (the variant's measured quality says what that costs)."""
    n, k = t.rows, t.cols
    if k % BLOCK:
        raise ValueError(f"{t.name}: input size {k} is not a multiple of {BLOCK}")
    nb = k // BLOCK
    if bits == 4 and t.type_name in ("Q4_0", "Q4_1"):
        blocks = t.data.reshape(n, nb, BLOCK_BYTES[t.type_name])
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
        off = 2 if t.type_name == "Q4_0" else 4
        q = unpack_q4_nibbles(blocks[..., off:])
        packed = _pack_nibbles(q)
        corr = None
        if t.type_name == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
            corr = np.ascontiguousarray((m + 8.0 * d).T, dtype=np.float32)
        return PackedNBits(4, n, k, packed, np.ascontiguousarray(d), corr)
    if bits == 8 and t.type_name == "Q8_0":
        blocks = t.data.reshape(n, nb, BLOCK_BYTES["Q8_0"])
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
        return PackedNBits(8, n, k, q.astype(np.uint8), np.ascontiguousarray(d))
    return quantize_symmetric(t.dequantize(), bits)


def quantize_symmetric(w: np.ndarray, bits: int) -> PackedNBits:
    """Block-32 symmetric quantization (GGML Q4_0 / Q8_0 rounding) of float weights (n, k)."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    if bits == 4:
        # Q4_0: the value with the largest magnitude maps to -8 exactly
        idx = np.abs(blocks).argmax(axis=-1)
        maxv = np.take_along_axis(blocks, idx[..., None], axis=-1)[..., 0]
        d = maxv / -8.0
        inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0.0)
        q = np.clip(np.floor(blocks * inv[..., None] + 8.5), 0, 15)
        d16 = d.astype(np.float16).astype(np.float32)
        return PackedNBits(4, n, k, _pack_nibbles(q), np.ascontiguousarray(d16))
    if bits == 8:
        amax = np.abs(blocks).max(axis=-1)
        d = amax / 127.0
        inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0.0)
        q = np.clip(np.round(blocks * inv[..., None]), -127, 127).astype(np.int16) + 128
        d16 = d.astype(np.float16).astype(np.float32)
        return PackedNBits(8, n, k, q.astype(np.uint8), np.ascontiguousarray(d16))
    raise ValueError(f"bits must be 4 or 8, not {bits}")


def concat_packed(parts: list[PackedNBits]) -> PackedNBits:
    """Stack along N (fused QKV, fused gate+up). A part without correction gets a zero correction when
    another part has one."""
    bits = {p.bits for p in parts}
    ks = {p.k for p in parts}
    if len(bits) != 1 or len(ks) != 1:
        raise ValueError("cannot fuse matrices of different bits or input size")
    k = ks.pop()
    if any(p.correction is not None for p in parts):
        corrs = [
            p.correction if p.correction is not None else np.zeros((k // BLOCK, p.n), np.float32)
            for p in parts
        ]
        corr = np.ascontiguousarray(np.concatenate(corrs, axis=1))
    else:
        corr = None
    return PackedNBits(
        bits.pop(),
        sum(p.n for p in parts),
        k,
        np.ascontiguousarray(np.concatenate([p.packed for p in parts], axis=0)),
        np.ascontiguousarray(np.concatenate([p.scales for p in parts], axis=0)),
        corr,
    )


def q8_as_nibble_pair(p8: PackedNBits) -> PackedNBits:
    """An 8-bit matrix (a Q8_0 one packed by pack_tensor) as a 4-bit one over the input repeated twice,
    exactly.

    With u = q + 128 = 16*hi + lo, a weight d*q = 16d*(hi - 8) + d*lo: the first K columns hold the high
    nibbles (scale 16d, zero point 8), the next K the low nibbles (scale d, zero point 0), so
    y = MatMulNBits(concat(x, x)). MatMulNBits' 8-bit kernel is 35x slower than the 4-bit one with fp32
    activations, and a fp32 copy of a vocabulary-sized head is 4x the bytes."""
    if p8.bits != 8:
        raise ValueError(f"expected an 8-bit matrix, got {p8.bits} bits")
    n, nb = p8.scales.shape
    u = p8.packed.reshape(n, nb, BLOCK)
    packed = np.concatenate([_pack_nibbles(u >> 4), _pack_nibbles(u & 15)], axis=1)
    scales = np.concatenate([16.0 * p8.scales, p8.scales], axis=1).astype(np.float32)
    zp = np.concatenate([np.full((n, nb), 8, np.uint8), np.zeros((n, nb), np.uint8)], axis=1)
    return PackedNBits(
        4,
        n,
        2 * p8.k,
        np.ascontiguousarray(packed),
        np.ascontiguousarray(scales),
        zero_points=_pack_nibbles(zp),
    )
