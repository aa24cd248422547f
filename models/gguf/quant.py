"""Map GGML blocks (models/gguf/blocks.py) onto onnxruntime's MatMulNBits / GatherBlockQuantized layouts,
without re-quantizing.

MatMulNBits computes y = x @ W^T with W[n, j] = (u[n, j] - zp) * scale[n, j // block] for codes u and an
integer zero point zp. We keep the default zero point (8 for 4 bits, 128 for 8 bits): integer zero points
keep the fast kernels, float ones take a slow path, and an explicit zero-point tensor costs 10-35 % at 4 bits
with fp32 activations (Gemma 3 270M's shapes, rounds interleaved). Every GGML value is scale * q
(+ offset), so:

- codes u = q + zp for the symmetric formats (Q4_0, Q3_K at 4 bits; Q5_0, Q6_K, Q8_0 at 8);
- a format with a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) stores q = 0..qmax: its codes are u = q - c + zp with c
  the middle of that range (`shift`: 8 for Q4_1/Q4_K, 16 for Q5_1/Q5_K, 2 for Q2_K), so W = (q - c) * scale,
  and y += blocksum(x) @ corr^T adds the rest per block: corr = offset + c * scale.

Promotions are exact too: 4-bit codes widen to 8 bits (u + 120), a 32-wide block splits into two 16-wide ones
with the same scale; both let tensors of different formats share one fused MatMulNBits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from models.gguf.blocks import FORMATS, Blocks, decode
from models.gguf.reader import Tensor

BLOCK = 32
DEFAULT_ZP = {4: 8, 8: 128}


@dataclass(frozen=True)
class Layout:
    """What a packed matrix looks like, known from the GGUF header alone: its width, size, block, and which
    of the optional arrays it carries. Every packing below has its counterpart here, so the converter can
    name and size its initializers before computing any (models/convert/disk_plan.py sizes a conversion
    that way), and `Packing.get` checks that the codes computed have the layout that was planned."""

    bits: int
    n: int
    k: int
    block: int = BLOCK
    offsets: bool = False
    shift: bool = False
    zero_points: bool = False

    @property
    def nb(self) -> int:
        return self.k // self.block

    @property
    def correction(self) -> bool:
        return self.offsets or self.shift

    # shapes of MatMulNBits' inputs (uint8 codes and zero points, float32 scales) and the correction
    @property
    def packed_shape(self) -> tuple[int, int, int]:
        return (self.n, self.nb, self.block * self.bits // 8)

    @property
    def scales_shape(self) -> tuple[int, int]:
        return (self.n, self.nb)

    @property
    def zero_points_shape(self) -> tuple[int, int]:
        return (self.n, (self.nb + 1) // 2 if self.bits == 4 else self.nb)

    @property
    def correction_shape(self) -> tuple[int, int]:
        return (self.nb, self.n)

    @staticmethod
    def of(type_name: str, n: int, k: int, bits: int | None = None, block: int | None = None) -> Layout:
        """pack_blocks' layout for a tensor of this block format."""
        f = FORMATS[type_name]
        lay = Layout(bits or f.bits, n, k, f.block, offsets=f.has_offset, shift=f.center != 0)
        return lay.split(block) if block else lay

    @staticmethod
    def symmetric(bits: int, n: int, k: int) -> Layout:
        return Layout(bits, n, k)

    def widened(self) -> Layout:
        return replace(self, bits=8)

    def split(self, block: int) -> Layout:
        return replace(self, block=block)

    def nibble_pair(self) -> Layout:
        return Layout(4, self.n, 2 * self.k, self.block, zero_points=True)

    @staticmethod
    def concat(parts: list[Layout]) -> Layout:
        p0 = parts[0]
        return replace(
            p0,
            n=sum(p.n for p in parts),
            offsets=any(p.offsets for p in parts),
            shift=any(p.shift for p in parts),
            zero_points=any(p.zero_points for p in parts),
        )


RowsFn = Callable[[int, int], "PackedNBits"]
# One dequantized band of rows (n, k) float32 -> its encoded arrays: the seam a re-quantizer plugs into
# (packing_from); the exact GGML formats never take it, they move their own codes (pack_blocks).
Encoder = Callable[[np.ndarray], "PackedNBits"]


class Packing:
    """A packed matrix known by its Layout before its codes exist, computed a band of rows at a time.

    Every packing here is row-wise (a GGML block lies within a row; widening, splitting blocks and the
    nibble pair act on each row alone), so rows lo..hi-1 are computed from the source's rows lo..hi-1 only:
    a vocabulary-sized table is converted a band at a time and never held whole. The last band computed is
    kept, so the several arrays of one band (codes, scales, offsets) come from one decode. Each band is
    checked against the layout (a mismatch is a converter bug, never a file problem)."""

    def __init__(self, layout: Layout, rows: RowsFn) -> None:
        self.layout = layout
        self._rows = rows
        self._last: tuple[int, int, PackedNBits] | None = None

    def rows(self, lo: int, hi: int) -> PackedNBits:
        if self._last is not None and self._last[:2] == (lo, hi):
            return self._last[2]
        if not 0 <= lo < hi <= self.layout.n:
            raise ValueError(f"rows {lo}..{hi} of a matrix of {self.layout.n}")
        p = self._rows(lo, hi)
        if p.layout != replace(self.layout, n=hi - lo):
            raise RuntimeError(f"converter bug: planned {self.layout} (rows {lo}..{hi}), packed {p.layout}")
        self._last = (lo, hi, p)
        return p

    def get(self) -> PackedNBits:
        """All rows (kept, as the last band)."""
        return self.rows(0, self.layout.n)

    def then(self, layout: Layout, fn: Callable[[PackedNBits], PackedNBits]) -> Packing:
        """A row-wise transform of this packing (widen, split_blocks, as_nibble_pair)."""
        return Packing(layout, lambda lo, hi: fn(self.rows(lo, hi)))

    def band(self, lo: int, hi: int) -> Packing:
        """Rows lo..hi-1 as a packing of their own (a slice of a vocabulary-sized head)."""
        return Packing(replace(self.layout, n=hi - lo), lambda a, b: self.rows(lo + a, lo + b))

    @staticmethod
    def concat(parts: list[Packing]) -> Packing:
        if len(parts) == 1:
            return parts[0]

        def rows(lo: int, hi: int) -> PackedNBits:
            pieces, start = [], 0
            for part in parts:
                end = start + part.layout.n
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    pieces.append(part.rows(a - start, b - start))
                start = end
            return concat_packed(pieces)

        return Packing(Layout.concat([p.layout for p in parts]), rows)


@dataclass
class PackedNBits:
    """Inputs of one MatMulNBits node (and its per-block correction)."""

    bits: int
    n: int
    k: int
    packed: np.ndarray  # uint8 (n, k/block, block*bits/8)
    scales: np.ndarray  # float32 (n, k/block)
    offsets: np.ndarray | None = None  # float32 (n, k/block): the format's own offset (its min), exact
    shift: np.ndarray | None = None  # uint8 (n,): GGML's q = u - zero point + shift
    zero_points: np.ndarray | None = None  # explicit, packed like MatMulNBits wants them; None = default
    block: int = BLOCK

    @property
    def nb(self) -> int:
        return self.k // self.block

    @property
    def correction(self) -> np.ndarray | None:
        """(k/block, n) float32 with y = MatMulNBits(x) + blocksum(x) @ correction, or None. Where a row has
        a shift, offset + shift * scale is rounded to fp32 once (a relative 6e-8 of that block's term)."""
        if self.offsets is None and self.shift is None:
            return None
        corr = np.zeros((self.n, self.nb), np.float32) if self.offsets is None else self.offsets
        if self.shift is not None:
            corr = corr + self.shift[:, None].astype(np.float32) * self.scales
        return np.ascontiguousarray(corr.T, dtype=np.float32)

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in (self.offsets, self.zero_points) if a is not None)
        return self.packed.nbytes + self.scales.nbytes + extra

    @property
    def layout(self) -> Layout:
        return Layout(
            self.bits,
            self.n,
            self.k,
            self.block,
            offsets=self.offsets is not None,
            shift=self.shift is not None,
            zero_points=self.zero_points is not None,
        )

    def rows(self, lo: int, hi: int) -> PackedNBits:
        """Rows lo..hi-1 (output features), every per-row array sliced alike."""

        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[lo:hi]

        return replace(
            self,
            n=hi - lo,
            packed=self.packed[lo:hi],
            scales=self.scales[lo:hi],
            offsets=cut(self.offsets),
            shift=cut(self.shift),
            zero_points=cut(self.zero_points),
        )

    def codes(self) -> np.ndarray:
        """(n, k/block, block) uint8 codes u."""
        if self.bits == 8:
            return self.packed
        u = np.empty((*self.packed.shape[:-1], 2 * self.packed.shape[-1]), np.uint8)
        u[..., 0::2], u[..., 1::2] = self.packed & 15, self.packed >> 4
        return u

    def q(self) -> np.ndarray:
        """(n, k/block, block) int16: the integer each scale multiplies (GGML's q)."""
        if self.zero_points is not None:
            zp = unpack_nibbles(self.zero_points)[:, : self.nb] if self.bits == 4 else self.zero_points
            q = self.codes().astype(np.int16) - zp[..., None].astype(np.int16)
        else:
            q = self.codes().astype(np.int16) - DEFAULT_ZP[self.bits]
        if self.shift is not None:
            q = q + self.shift[:, None, None].astype(np.int16)
        return q

    def dequantize(self) -> np.ndarray:
        """(n, k) float32 in GGML's order: fl(fl(scale * q) + offset)."""
        v = self.scales[..., None] * self.q().astype(np.float32)
        if self.offsets is not None:
            v = v + self.offsets[..., None]
        return v.reshape(self.n, self.k)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q: (..., 2m) values 0..15 -> (..., m) bytes, element 2i in the low nibble (MatMulNBits order)."""
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(b: np.ndarray) -> np.ndarray:
    u = np.empty((*b.shape[:-1], 2 * b.shape[-1]), np.uint8)
    u[..., 0::2], u[..., 1::2] = b & 15, b >> 4
    return u


def pack_blocks(b: Blocks, bits: int | None = None, block: int | None = None) -> PackedNBits:
    """Exact: `bits` (4 or 8) at least the format's own width, `block` a divisor of the format's block."""
    bits = bits or b.fmt.bits
    if bits not in (4, 8) or bits < b.fmt.bits:
        raise ValueError(
            f"{b.fmt.name} holds {b.fmt.bits}-bit codes; cannot pack it into {bits} bits exactly"
        )
    n, nb, blk = b.q.shape
    # a format with a min stores q from 0 up: its codes sit `center` higher than the default zero point and
    # the correction adds center * scale back. That keeps the kernel's part of each weight centred on zero,
    # which is what keeps int8-activation error down (as in llama.cpp, where the min multiplies the sums
    # of the quantized activations)
    c = b.fmt.center
    q = b.q.astype(np.int16) - c
    packed = (q + 128).astype(np.uint8) if bits == 8 else pack_nibbles(q + 8)
    shift = np.full(n, c, np.uint8) if c else None
    p = PackedNBits(bits, n, nb * blk, packed, b.scales, b.offsets, shift, block=blk)
    return split_blocks(p, block) if block and block != blk else p


def pack_tensor(t: Tensor, bits: int | None = None, block: int | None = None) -> PackedNBits:
    """A block-format tensor exactly (see pack_blocks). Float tensors have no exact form below 16 bits and
    are quantized symmetrically to `bits` (a variant that does so measures what it costs)."""
    if t.type_name in ("F32", "F16", "BF16"):
        if bits is None:
            raise ValueError(f"{t.name}: a float tensor needs an explicit width")
        return quantize_symmetric(t.dequantize(), bits)
    return pack_blocks(decode(t.type_name, t.data, t.rows), bits, block)


def band(t: Tensor, lo: int, hi: int) -> Tensor:
    """Rows lo..hi-1 of a matrix, over the same memory (a GGUF row is whole blocks)."""
    return replace(t, rows=hi - lo, data=np.asarray(t.data)[lo:hi])


def packing(t: Tensor, bits: int | None = None) -> Packing:
    """pack_tensor(t, bits), planned from the tensor's type and shape and computed a band at a time."""
    if t.type_name in ("F32", "F16", "BF16"):
        if bits is None:
            raise ValueError(f"{t.name}: a float tensor needs an explicit width")
        return packing_from(t, Layout.symmetric(bits, t.rows, t.cols), lambda w: quantize_symmetric(w, bits))
    lay = Layout.of(t.type_name, t.rows, t.cols, bits)
    return Packing(lay, lambda lo, hi: pack_tensor(band(t, lo, hi), bits))


def packing_from(t: Tensor, layout: Layout, encode: Encoder) -> Packing:
    """`t`'s rows dequantized to fp32 and encoded by `encode`, a band at a time, planned as `layout`."""
    return Packing(layout, lambda lo, hi: encode(band(t, lo, hi).dequantize()))


def widen(p: PackedNBits) -> PackedNBits:
    """4-bit codes as 8-bit ones, exactly (the same value under the default zero point, the same shift)."""
    if p.bits == 8:
        return p
    if p.zero_points is not None:
        raise ValueError("widen() takes default zero points only")
    return replace(p, bits=8, packed=(p.codes().astype(np.int16) + 120).astype(np.uint8))


def split_blocks(p: PackedNBits, block: int) -> PackedNBits:
    """The same matrix with `block`-wide blocks (a divisor of p.block): each scale and offset repeated."""
    if block == p.block:
        return p
    if p.block % block or p.zero_points is not None:
        raise ValueError(f"cannot split {p.block}-wide blocks into {block}")
    r = p.block // block
    return replace(
        p,
        packed=p.packed.reshape(p.n, p.nb * r, -1),
        scales=np.repeat(p.scales, r, axis=1),
        offsets=None if p.offsets is None else np.repeat(p.offsets, r, axis=1),
        block=block,
    )


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
        return PackedNBits(4, n, k, pack_nibbles(q), np.ascontiguousarray(d16))
    if bits == 8:
        amax = np.abs(blocks).max(axis=-1)
        d = amax / 127.0
        inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0.0)
        q = np.clip(np.round(blocks * inv[..., None]), -127, 127).astype(np.int16) + 128
        d16 = d.astype(np.float16).astype(np.float32)
        return PackedNBits(8, n, k, q.astype(np.uint8), np.ascontiguousarray(d16))
    raise ValueError(f"bits must be 4 or 8, not {bits}")


def layout(p: PackedNBits) -> tuple[int, int]:
    return p.bits, p.block


def concat_packed(parts: list[PackedNBits]) -> PackedNBits:
    """Stack along N (fused QKV, fused gate+up). Parts must share bits, block and input size; one without
    offsets, shift or zero points gets zeros (the default zero point) where another has them."""
    if len({(p.bits, p.block, p.k) for p in parts}) != 1:
        raise ValueError("cannot fuse matrices of different layouts or input sizes")
    if len(parts) == 1:
        return parts[0]
    p0 = parts[0]
    offsets = shift = zero_points = None
    if any(p.zero_points is not None for p in parts):
        zero_points = np.concatenate(
            [p.zero_points if p.zero_points is not None else default_zero_points(p) for p in parts]
        )
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate(
            [p.offsets if p.offsets is not None else np.zeros((p.n, p.nb), np.float32) for p in parts]
        )
    if any(p.shift is not None for p in parts):
        shift = np.concatenate([p.shift if p.shift is not None else np.zeros(p.n, np.uint8) for p in parts])
    return PackedNBits(
        p0.bits,
        sum(p.n for p in parts),
        p0.k,
        np.ascontiguousarray(np.concatenate([p.packed for p in parts], axis=0)),
        np.ascontiguousarray(np.concatenate([p.scales for p in parts], axis=0)),
        offsets,
        shift,
        zero_points,
        block=p0.block,
    )


def default_zero_points(p: PackedNBits) -> np.ndarray:
    """The kernel's default zero points written out, packed as MatMulNBits reads explicit ones."""
    zp = np.full((p.n, p.nb + p.nb % 2 if p.bits == 4 else p.nb), DEFAULT_ZP[p.bits], np.uint8)
    return pack_nibbles(zp) if p.bits == 4 else zp


def as_nibble_pair(p8: PackedNBits) -> PackedNBits:
    """An 8-bit matrix as a 4-bit one over the input repeated twice, exactly.

    With u = q + 128 = 16*hi + lo, a weight s*q = 16s*(hi - 8) + s*lo: the first K columns hold the high
    nibbles (scale 16s, zero point 8), the next K the low nibbles (scale s, zero point 0), so
    y = MatMulNBits(concat(x, x)). The offsets stay with the original K (the caller's correction)."""
    if p8.bits != 8:
        raise ValueError(f"expected an 8-bit matrix, got {p8.bits} bits")
    n, nb = p8.scales.shape
    u = p8.packed
    packed = np.concatenate([pack_nibbles(u >> 4), pack_nibbles(u & 15)], axis=1)
    scales = np.concatenate([16.0 * p8.scales, p8.scales], axis=1).astype(np.float32)
    zp = np.concatenate([np.full((n, nb), 8, np.uint8), np.zeros((n, nb), np.uint8)], axis=1)
    return PackedNBits(
        4,
        n,
        2 * p8.k,
        np.ascontiguousarray(packed),
        np.ascontiguousarray(scales),
        zero_points=pack_nibbles(zp),
        block=p8.block,
    )


# the name the tests and older callers know
q8_as_nibble_pair = as_nibble_pair
