"""GGML's reference quantizers for the K-quants, ported to numpy (gguf-py has none for them), so the tiny
test GGUFs hold blocks made the way llama.cpp's own `quantize_row_q*_K_ref` makes them.

Read from ggml/src/ggml-quants.c (ggml-org/ggml) and written again here: every loop over a sub-block's values
runs over all sub-blocks at once (rows), in float32, with the sequential sums done as float32 cumulative sums
so the arithmetic follows the C order. `quantize(w, type_name)` covers every type the converter supports.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
F = np.float32


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (the 1.5 * 2**23 trick)."""
    return np.rint(np.asarray(v, np.float32)).astype(np.int32)


def seqsum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis in order, in float32 (a C loop's `s += a[i]`): one vector add per column."""
    cols = np.moveaxis(np.asarray(a, np.float32), -1, 0).copy()
    acc = cols[0].copy()
    for c in cols[1:]:
        acc += c
    return acc


def fp16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(np.float16)


def make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    """Rows of x (R, n) -> (scale (R,), the_min (R,), L (R, n) uint8): an asymmetric grid searched over
    `nstep` scales, weighted least squares for scale and min."""
    x, weights = x.astype(F), weights.astype(F)
    nmax_f = F(nmax)
    mn = mn0 = np.minimum(x.min(axis=1), F(0))
    mx = x.max(axis=1)
    sum_w = seqsum(weights)
    sum_x = seqsum(weights * x)
    flat = mx == mn
    rng = np.where(flat, F(1), mx - mn).astype(F)
    iscale = (nmax_f / rng).astype(F)
    scale = (F(1) / iscale).astype(F)

    def err(sc, lv, m):
        diff = (sc[:, None] * lv.astype(F) + m[:, None] - x).astype(F)
        diff = np.abs(diff) if use_mad else diff * diff
        return seqsum(weights * diff)

    L = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = err(scale, L, mn)
    for step in range(nstep + 1):
        isc = ((F(rmin) + F(rdelta) * F(step) + nmax_f) / np.where(flat, F(1), mx - mn)).astype(
            F
        )  # min moves as better fits are found
        laux = np.clip(nearest_int(isc[:, None] * (x - mn[:, None])), 0, nmax)
        lf = laux.astype(F)
        sum_l = seqsum(weights * lf)
        sum_l2 = seqsum(weights * lf * lf)
        sum_xl = seqsum(weights * lf * x)
        d = (sum_w * sum_l2 - sum_l * sum_l).astype(F)
        ok = d > 0
        dd = np.where(ok, d, F(1))
        this_scale = ((sum_w * sum_xl - sum_x * sum_l) / dd).astype(F)
        this_min = ((sum_l2 * sum_x - sum_l * sum_xl) / dd).astype(F)
        pos = this_min > 0
        this_min = np.where(pos, F(0), this_min).astype(F)
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 != 0, sum_l2, F(1)), this_scale).astype(F)
        cur = err(this_scale, laux, this_min)
        better = ok & (cur < best)
        L = np.where(better[:, None], laux, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, F(0), scale).astype(F)
    L = np.where(flat[:, None], 0, L)
    return scale, (-np.where(flat, mn0, mn)).astype(F), L.astype(np.uint8)


def _max_abs(x):
    """The value of largest magnitude (first one on ties) and that magnitude, per row."""
    idx = np.abs(x).argmax(axis=1)
    mx = np.take_along_axis(x, idx[:, None], axis=1)[:, 0]
    return mx.astype(F), np.abs(mx).astype(F)


def make_qx_quants(x, nmax):
    """rmse_type 1, no importance weights: a symmetric grid, 18 scales tried around nmax."""
    x = x.astype(F)
    mx, amax = _max_abs(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, F(1), mx).astype(F)
    w = x * x

    def grid(iscale):
        lv = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = lv.astype(F)
        return lv, seqsum(w * x * lf), seqsum(w * lf * lf)

    lv, sumlx, suml2 = grid((F(-nmax) / mx).astype(F))
    L = lv + nmax
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, F(1)), F(0)).astype(F)
    best = (scale * sumlx).astype(F)
    for step in range(-9, 10):
        if step == 0:
            continue
        lv, sumlx, suml2 = grid((-(F(nmax) + F(0.1) * F(step)) / mx).astype(F))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better[:, None], lv + nmax, L)
        new_scale = (sumlx / np.where(suml2 != 0, suml2, F(1))).astype(F)
        scale = np.where(better, new_scale, scale)
        best = np.where(better, (new_scale * sumlx).astype(F), best)
    return np.where(zero, F(0), scale).astype(F), np.where(zero[:, None], 0, L)


def make_q3_quants(x, nmax):
    """do_rmse: start from the nearest grid, then up to 5 passes moving single values (in order)."""
    x = x.astype(F)
    mx, amax = _max_abs(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, F(1), mx).astype(F)
    iscale = (F(-nmax) / mx).astype(F)
    L = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
    w = x * x
    sumlx = seqsum(w * x * L.astype(F))
    suml2 = seqsum(w * L.astype(F) * L.astype(F))
    active = np.ones(len(x), bool)
    for _ in range(5):
        changed = np.zeros(len(x), bool)
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], L[:, i].astype(F)
            slx = (sumlx - wi * xi * li).astype(F)
            sl2 = (suml2 - wi * li * li).astype(F)
            cand = active & (slx > 0)
            new_l = np.clip(nearest_int(xi * sl2 / np.where(slx != 0, slx, F(1))), -nmax, nmax - 1)
            cand &= new_l != L[:, i]
            nl = new_l.astype(F)
            slx2 = (slx + wi * xi * nl).astype(F)
            sl22 = (sl2 + wi * nl * nl).astype(F)
            take = cand & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(take, new_l, L[:, i])
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
            changed |= take
        active &= changed
        if not active.any():
            break
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, F(1)), F(0)).astype(F)
    return np.where(zero, F(0), scale).astype(F), np.where(zero[:, None], 0, L + nmax)


def _pack_2bit(L):
    """(S, 256) values 0..3 -> (S, 64): qs[32c + l] holds values 128c + l + 32j in bits 2j."""
    L = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    xs = x.reshape(-1, QK_K).astype(F)
    s = len(xs)
    sub = xs.reshape(-1, 16)
    scales, mins, L = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, True)
    scales, mins, L = scales.reshape(s, 16), mins.reshape(s, 16), L.reshape(s, 16, 16).astype(np.int32)
    max_scale = np.maximum(scales.max(axis=1), F(0))
    max_min = np.maximum(mins.max(axis=1), F(0))
    has_s, has_m = max_scale > 0, max_min > 0
    isc = np.where(has_s, F(15) / np.where(has_s, max_scale, F(1)), F(0)).astype(F)
    imn = np.where(has_m, F(15) / np.where(has_m, max_min, F(1)), F(0)).astype(F)
    sc = np.where(has_s[:, None], nearest_int(isc[:, None] * scales), 0)
    sc = sc | np.where(has_m[:, None], nearest_int(imn[:, None] * mins) << 4, 0)
    sc = sc.astype(np.uint8)
    d = fp16(np.where(has_s, max_scale / F(15), F(0)))
    dmin = fp16(np.where(has_m, max_min / F(15), F(0)))
    dl = d.astype(F)[:, None] * (sc & 0x0F).astype(F)
    ml = dmin.astype(F)[:, None] * (sc >> 4).astype(F)
    nz = dl != 0
    q = np.clip(
        nearest_int((sub.reshape(s, 16, 16) + ml[..., None]) / np.where(nz, dl, F(1))[..., None]), 0, 3
    )
    L = np.where(nz[..., None], q, L).reshape(s, QK_K)
    return np.concatenate(
        [sc, _pack_2bit(L), d.view(np.uint8).reshape(s, 2), dmin.view(np.uint8).reshape(s, 2)], 1
    )


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    xs = x.reshape(-1, QK_K).astype(F)
    s = len(xs)
    scales, L = make_q3_quants(xs.reshape(-1, 16), 4)
    scales, L = scales.reshape(s, 16), L.reshape(s, 16, 16)
    max_scale, amax = _max_abs(scales)
    has = amax != 0
    iscale = np.where(has, F(-32) / np.where(has, max_scale, F(1)), F(0)).astype(F)
    ls = np.where(has[:, None], np.clip(nearest_int(iscale[:, None] * scales), -32, 31) + 32, 0).astype(
        np.uint8
    )
    packed = np.zeros((s, 12), np.uint8)
    packed[:, :8] = (ls[:, :8] & 0x0F) | ((ls[:, 8:] & 0x0F) << 4)
    hi = ls >> 4
    for j in range(16):
        packed[:, 8 + j % 4] |= hi[:, j] << (2 * (j // 4))
    d = fp16(np.where(has, F(1) / np.where(has, iscale, F(1)), F(0)))
    dl = d.astype(F)[:, None] * (ls.astype(np.int32) - 32).astype(F)
    nz = dl != 0
    q = np.clip(nearest_int(xs.reshape(s, 16, 16) / np.where(nz, dl, F(1))[..., None]), -4, 3) + 4
    L = np.where(nz[..., None], q, L).reshape(s, QK_K).astype(np.uint8)
    high = L > 3
    L = np.where(high, L - 4, L)
    hmask = np.zeros((s, 32), np.uint8)
    for bit in range(8):  # value 32 * bit + m sets bit `bit` of hmask[m]
        hmask |= high[:, 32 * bit : 32 * bit + 32].astype(np.uint8) << bit
    return np.concatenate([hmask, _pack_2bit(L), packed, d.view(np.uint8).reshape(s, 2)], axis=1)


def _k4_pack(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    out = np.zeros((len(ls), 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4]
    out[:, 4:8] = lm[:, 0:4]
    out[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    out[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    return out


def _quantize_k_scale_min(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Q4_K / Q5_K: eight 32-value sub-blocks per super-block, 6-bit scales and mins."""
    xs = x.reshape(-1, QK_K).astype(F)
    s = len(xs)
    sub = xs.reshape(-1, 32)
    av_x = np.sqrt(seqsum(sub * sub) / F(32)).astype(F)
    scales, mins, L = make_qkx2_quants(sub, av_x[:, None] + np.abs(sub), nmax, rmin, 0.1, nstep, False)
    scales, mins, L = scales.reshape(s, 8), mins.reshape(s, 8), L.reshape(s, 8, 32).astype(np.int32)
    max_scale = np.maximum(scales.max(axis=1), F(0))
    max_min = np.maximum(mins.max(axis=1), F(0))
    inv_s = np.where(max_scale > 0, F(63) / np.where(max_scale > 0, max_scale, F(1)), F(0)).astype(F)
    inv_m = np.where(max_min > 0, F(63) / np.where(max_min > 0, max_min, F(1)), F(0)).astype(F)
    ls = np.minimum(nearest_int(inv_s[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(nearest_int(inv_m[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d = fp16(max_scale / F(63))
    dmin = fp16(max_min / F(63))
    dl = d.astype(F)[:, None] * ls.astype(F)
    dm = dmin.astype(F)[:, None] * lm.astype(F)
    nz = dl != 0
    q = nearest_int((xs.reshape(s, 8, 32) + dm[..., None]) / np.where(nz, dl, F(1))[..., None])
    L = np.where(nz[..., None], np.clip(q, 0, nmax), L).reshape(s, QK_K).astype(np.uint8)
    head = np.concatenate(
        [d.view(np.uint8).reshape(s, 2), dmin.view(np.uint8).reshape(s, 2), _k4_pack(ls, lm)], axis=1
    )
    return head, L


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    head, L = _quantize_k_scale_min(x, 15, -1.0, 20)
    L = L.reshape(-1, 4, 2, 32)  # per 64 values: the first 32 in the low nibbles, the next 32 in the high
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(len(L), 128)
    return np.concatenate([head, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    head, L = _quantize_k_scale_min(x, 31, -0.5, 15)
    L = L.reshape(-1, 4, 2, 32)
    high = (L >> 4) & 1
    low = L & 0x0F
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(len(L), 128)
    qh = np.zeros((len(L), 32), np.uint8)
    for c in range(4):  # chunk c of 64 values: bit 2c for its first 32, bit 2c + 1 for the next
        qh |= (high[:, c, 0] << (2 * c)) | (high[:, c, 1] << (2 * c + 1))
    return np.concatenate([head, qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    xs = x.reshape(-1, QK_K).astype(F)
    s = len(xs)
    scales, L = make_qx_quants(xs.reshape(-1, 16), 32)
    scales, L = scales.reshape(s, 16), L.reshape(s, 16, 16)
    max_scale, max_abs = _max_abs(scales)
    zero = max_abs < GROUP_MAX_EPS
    iscale = (F(-128) / np.where(zero, F(1), max_scale)).astype(F)
    d = fp16(np.where(zero, F(0), F(1) / iscale))
    sc = np.where(zero[:, None], 0, np.minimum(127, nearest_int(iscale[:, None] * scales))).astype(np.int8)
    dl = d.astype(F)[:, None] * sc.astype(F)
    nz = dl != 0
    q = np.clip(nearest_int(xs.reshape(s, 16, 16) / np.where(nz, dl, F(1))[..., None]), -32, 31) + 32
    L = np.where(nz[..., None], q, L).reshape(s, 2, 4, 32).astype(np.uint8)
    L = np.where(zero[:, None, None, None], 0, L)
    low, high = L & 0x0F, L >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [ql.reshape(s, 128), qh.reshape(s, 64), sc.view(np.uint8), d.view(np.uint8).reshape(s, 2)], axis=1
    )


K_QUANTIZERS = {
    "Q2_K": quantize_q2_k,
    "Q3_K": quantize_q3_k,
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
}


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """(rows, cols) float32 -> what GGUFWriter.add_tensor takes for `type_name` (raw bytes per row for the
    block formats)."""
    w = np.asarray(w, np.float32)
    if type_name == "F32":
        return w
    if type_name == "F16":
        return w.astype(np.float16)
    if type_name in K_QUANTIZERS:
        return K_QUANTIZERS[type_name](w).reshape(w.shape[0], -1)
    return gguf_quantize(w, GGMLQuantizationType[type_name])
