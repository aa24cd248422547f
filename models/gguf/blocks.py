"""GGML's block formats, decoded into what every one of them is: integer codes times a per-block scale, plus
(for the formats with a min) a per-block offset.

    value = fl(fl(scale * q) + offset)        (offset omitted where the format has none)

with q, scale and offset computed in GGML's own float32 order, so this is bit-for-bit GGML's dequantization
(tests check it against gguf.quants.dequantize). The converter never re-quantizes: it moves q, scale and
offset into onnxruntime's layouts as they are.

| type | block | q range | bits that hold q | scale | offset |
|---|---|---|---|---|---|
| Q4_0 | 32 | -8..7 | 4 | d | - |
| Q4_1 | 32 | 0..15 | 4 | d | m |
| Q5_0 | 32 | -16..15 | 8 | d | - |
| Q5_1 | 32 | 0..31 | 8 | d | m |
| Q8_0 | 32 | -128..127 | 8 | d | - |
| Q2_K | 16 | 0..3 | 4 | d * sc (4-bit) | -(dmin * m) (4-bit) |
| Q3_K | 16 | -4..3 | 4 | d * (sc - 32) (6-bit) | - |
| Q4_K | 32 | 0..15 | 4 | d * sc (6-bit) | -(dmin * m) (6-bit) |
| Q5_K | 32 | 0..31 | 8 | d * sc (6-bit) | -(dmin * m) (6-bit) |
| Q6_K | 16 | -32..31 | 8 | d * sc (int8) | - |
The K-quants pack 256 values per super-block; their scales come from the super-block's fp16 d (and dmin).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256


@dataclass(frozen=True)
class Format:
    name: str
    block: int  # values per scale (the sub-block of the K-quants)
    super_block: int  # values per stored block
    type_size: int  # bytes per stored block
    bits: int  # MatMulNBits width that holds q exactly (4 or 8)
    has_offset: bool
    q_min: int
    q_max: int

    @property
    def center(self) -> int:
        """The middle of q's range for formats with a min (Q4_1: 8), 0 for the symmetric ones."""
        return (self.q_min + self.q_max + 1) // 2 if self.has_offset else 0


FORMATS = {
    f.name: f
    for f in (
        Format("Q4_0", 32, 32, 18, 4, False, -8, 7),
        Format("Q4_1", 32, 32, 20, 4, True, 0, 15),
        Format("Q5_0", 32, 32, 22, 8, False, -16, 15),
        Format("Q5_1", 32, 32, 24, 8, True, 0, 31),
        Format("Q8_0", 32, 32, 34, 8, False, -128, 127),
        Format("Q2_K", 16, QK_K, 84, 4, True, 0, 3),
        Format("Q3_K", 16, QK_K, 110, 4, False, -4, 3),
        Format("Q4_K", 32, QK_K, 144, 4, True, 0, 15),
        Format("Q5_K", 32, QK_K, 176, 8, True, 0, 31),
        Format("Q6_K", 16, QK_K, 210, 8, False, -32, 31),
    )
}


@dataclass
class Blocks:
    """A tensor of n rows as (n, k // block, block) codes, with (n, k // block) scales and offsets."""

    fmt: Format
    q: np.ndarray  # int8 (n, nb, block): GGML's integer multiplier
    scales: np.ndarray  # float32 (n, nb)
    offsets: np.ndarray | None  # float32 (n, nb), added after scale * q

    def dequantize(self) -> np.ndarray:
        v = self.scales[..., None] * self.q.astype(np.float32)
        if self.offsets is not None:
            v = v + self.offsets[..., None]
        return v.reshape(self.q.shape[0], -1)


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...,) float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _lo_hi(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5_x layout: byte j holds element j (low nibble) and element j + 16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _qh_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes -> the fifth bit of each of the 32 values (bit i of the little-endian uint32)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (get_scale_min_k4)."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = np.concatenate([d & 63, (md & 0x0F) | ((d >> 6) << 4)], axis=-1)
    mins = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=-1)
    return scales, mins


def decode(type_name: str, data: np.ndarray, rows: int) -> Blocks:
    """data: the tensor's bytes, (rows, bytes_per_row) uint8 (or anything of that many bytes)."""
    f = FORMATS[type_name]
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, f.type_size)
    n, ns = b.shape[:2]
    offsets = None
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b[..., 0:2])
        if type_name == "Q4_0":
            q = _lo_hi(b[..., 2:]).astype(np.int8) - 8
        elif type_name == "Q4_1":
            offsets = _f16(b[..., 2:4])
            q = _lo_hi(b[..., 4:]).astype(np.int8)
        elif type_name == "Q5_0":
            q = (_lo_hi(b[..., 6:]) | (_qh_bits(b[..., 2:6]) << 4)).astype(np.int8) - 16
        elif type_name == "Q5_1":
            offsets = _f16(b[..., 2:4])
            q = (_lo_hi(b[..., 8:]) | (_qh_bits(b[..., 4:8]) << 4)).astype(np.int8)
        else:
            q = b[..., 2:].view(np.int8)
        return Blocks(f, np.ascontiguousarray(q), d, offsets)

    nsub = QK_K // f.block
    if type_name == "Q2_K":
        sc = b[..., 0:16]
        qs = b[..., 16:80].reshape(n, ns, 2, 1, 32)
        d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
        scales = d * (sc & 0x0F).astype(np.float32)
        offsets = -(dmin * (sc >> 4).astype(np.float32))
        q = (qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # (n, ns, 2, 4, 32): element 128c+32j+l
    elif type_name == "Q3_K":
        hmask = b[..., 0:32].reshape(n, ns, 1, 32)
        qs = b[..., 32:96].reshape(n, ns, 2, 1, 32)
        sc = b[..., 96:108]
        d = _f16(b[..., 108:110])[..., None]
        lo = (sc[..., 0:8, None] >> np.array([0, 4], np.uint8)).swapaxes(-1, -2).reshape(n, ns, 16) & 0x0F
        hi = (sc[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).swapaxes(-1, -2).reshape(n, ns, 16) & 3
        scales = d * ((lo | (hi << 4)).astype(np.int8) - 32).astype(np.float32)
        ql = ((qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(n, ns, QK_K)
        # the high bit of value 32j + l (j = 0..7) is bit j of hmask[l]; a clear bit means minus 4
        h = ((hmask >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(n, ns, QK_K)
        q = ql.astype(np.int8) - ((h ^ 1) << 2).astype(np.int8)
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _k4_scales(b[..., 4:16])
        scales = d * sc.astype(np.float32)
        offsets = -(dmin * mn.astype(np.float32))
        if type_name == "Q4_K":
            qs = b[..., 16:144].reshape(n, ns, 4, 1, 32)
            q = (qs >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # 64-value chunks: low then high nibbles
        else:
            qh = b[..., 16:48].reshape(n, ns, 1, 32)
            qs = b[..., 48:176].reshape(n, ns, 4, 1, 32)
            ql = ((qs >> np.array([0, 4], np.uint8)[:, None]) & 0x0F).reshape(n, ns, QK_K)
            h = ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(n, ns, QK_K)
            q = ql | (h << 4)
    else:  # Q6_K
        ql = b[..., 0:128].reshape(n, ns, 2, 1, 64)
        qh = b[..., 128:192].reshape(n, ns, 2, 1, 32)
        sc = b[..., 192:208].view(np.int8)
        d = _f16(b[..., 208:210])[..., None]
        scales = d * sc.astype(np.float32)
        low = ((ql >> np.array([0, 4], np.uint8)[:, None]) & 0x0F).reshape(n, ns, 2, 4, 32)
        high = ((qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(n, ns, 2, 4, 32)
        q = (low | (high << 4)).astype(np.int8) - 32
    q = np.ascontiguousarray(q.astype(np.int8).reshape(n, ns * nsub, f.block))
    scales = np.ascontiguousarray(scales.reshape(n, ns * nsub), dtype=np.float32)
    if offsets is not None:
        offsets = np.ascontiguousarray(offsets.reshape(n, ns * nsub), dtype=np.float32)
    return Blocks(f, q, scales, offsets)
