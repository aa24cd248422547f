"""The quantized linear layer: y = x @ concat(W...)^T, every GGUF tensor type mapped exactly.

Every architecture family builds its projections through `linear`, so how a GGUF tensor type maps onto
onnxruntime's kernels is decided here and nowhere else (the manifest's quant map describes the same rules).

How one tensor runs, by variant (`form`):
| tensor | f32 | q4 (fp32 activations, exact) | q4-a8 (int8 activations) | q8 |
|---|---|---|---|---|
| Q4_0 Q4_1 Q4_K Q2_K Q3_K | fp32 MatMul | MatMulNBits 4-bit | MatMulNBits 4-bit | 8-bit (widened) |
| Q5_0 Q5_1 Q5_K Q6_K Q8_0 | fp32 MatMul | fp32 MatMul; head: nibble pair | MatMulNBits 8-bit | 8-bit |
| F32 F16 BF16 | fp32 MatMul | fp32 MatMul | 4-bit symmetric (a head: 8) | 8-bit symmetric |
Formats with a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) add blocksum(x) @ offsets^T, exactly (quant.py).

Why fp32 MatMul for the 8-bit formats of the exact variant (measured on Gemma 3 270M's qkv / gate_up / down
shapes, 18 distinct matrices per call so the weights stream from memory as in a decode step, 2 threads,
interleaved rounds on a shared machine; times relative to 8-bit, int8 activations):
| route | 1 token | 256 tokens |
|---|---|---|
| MatMulNBits 8-bit, fp32 activations | 32-48x | 0.55-0.66x |
| nibble pair (as_nibble_pair: two 4-bit halves over the input twice) | 6.4-11.9x | 0.82-0.92x |
| fp32 MatMul on the dequantized weights | 1.7-3.4x | 0.34-0.40x |
All three are exact; fp32 MatMul is the fastest at both sizes (2.9-3.7x faster than the nibble pair at one
token), for 4x the bytes of the 8-bit codes. A vocabulary-sized head is where those bytes hurt: Gemma 3's
tied 262,144 x 640 table as an fp32 head is 649 MB resident against 231 MB as a nibble pair, though 3.4x
slower there (169 against 577 ms a token on the loaded machine); a head takes the nibble pair (`small=True`).

Fusion (group mixed, llama.cpp Q4_K_M's attn_q/attn_k Q4_K with attn_v Q6_K): projections that share a
layout (bits, block) are one MatMulNBits; where they do not, each run of one layout gets its own node and a
Concat joins them. With int8 activations, widening the 4-bit part to 8 bits instead was 1.2-1.5x slower
(1.3-4.3x at one token); with fp32 ones, promoting everything to fp32 MatMul was 10-30 % faster but costs 8x
the bytes of the 4-bit part, so the 4-bit part stays 4-bit.

Why Q5_0 / Q6_K stay one 8-bit node in q4-a8 rather than a sum of narrower ones (two runs on a shared
machine): Q5_0 = d*(lo4 - 8) + 8d*(2*hi - 1) is exactly a 4-bit plus a 2-bit (or 4-bit) MatMulNBits with
default zero points, and with int8 activations the sum equals the 8-bit node to ~3e-6 relative. But a 4-bit
term alone costs 0.5-0.7x of the 8-bit node at 256 tokens and the 2-bit kernel (onnxruntime 1.32, AVX2) is no
cheaper than the 4-bit one, so every split (two nodes, one 4-bit node over [x, x], the 2-bit LUT kernel)
measured 1.0-1.5x of the 8-bit node at 256 tokens and 0.9-2.7x at one token; Q6_K's 16-wide blocks as 4 + 4
bits were 1.3-1.5x and 1.7-4.7x, and 2-bit with 16-wide blocks falls back to a dequantizing kernel (20-57x).
With fp32 activations every split is 3-5x slower than fp32 MatMul at one token. Only fp32 MatMul beats the
8-bit node at 256 tokens (0.37-0.41x), at 4x the bytes and 1.5-2.2x the time at one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from models.convert.requant import Encoding, requantize
from models.gguf.quant import BLOCK, Layout, Packing, as_nibble_pair, packing, packing_from, widen
from models.gguf.reader import Tensor

if TYPE_CHECKING:
    from models.convert.graph import GraphBuilder, Planned

MS = "com.microsoft"
FLOAT_TYPES = ("F32", "F16", "BF16")
SLICE_BYTES = 32 << 20  # codes per MatMulNBits node of a vocabulary-sized head (row_sliced)
REQUANT_TAG = ".rq"  # in the name of every re-encoded initializer: no exact variant's can collide with it


@dataclass
class Form:
    """How one tensor runs: `packed` on MatMulNBits (as a nibble pair when `pair`), else fp32 `weight`.
    Both are planned (known by shape before any value is computed)."""

    packed: Packing | None = None
    pair: bool = False
    weight: Planned | None = None
    exact: bool = True
    requant: bool = False  # re-encoded by convert/requant.py (its initializers are named apart)
    accuracy: int | None = None  # MatMulNBits' accuracy_level when not the variant's (fast_plan.fp32_inputs)

    def describe(self) -> str:
        if self.packed is None:
            return "fp32 MatMul on the dequantized weights, exact"
        p = self.packed.layout
        if self.requant:
            zp = " + zero points" if p.zero_points else ""
            return f"{p.bits}-bit block {p.block}{zp}, re-encoded (error-aware rounding, not exact)"
        if self.pair:
            how = f"nibble pair (8-bit codes as two 4-bit halves over the input twice), block {p.block}"
        else:
            how = f"{p.bits}-bit block {p.block}"
        if p.offsets:
            how += " + offset correction"
        if self.accuracy == 1:
            how += ", fp32 activations"
        return how + (", exact" if self.exact else ", re-quantized symmetrically (not exact)")

    @property
    def layout(self) -> tuple:
        if self.packed is None:
            return ("fp32",)
        kind = "requant" if self.requant else "pair" if self.pair else "nbits"
        return (kind, self.packed.layout.bits, self.packed.layout.block, self.accuracy)


def form(g: GraphBuilder, name: str, small: bool = False, packed: Packing | None = None) -> Form:
    """The rule table in the module docstring, for one tensor of this variant, decided from the tensor's
    type alone. `packed`: the tensor already planned at its own width (the embedding table's)."""
    spec, t = g.spec, g.tensor(name)
    enc = spec.requant.choose(t.type_name, t.cols, head=small) if spec.requant is not None else None
    if enc is not None and not exact_already(t, enc):
        return Form(packed=requantized(t, enc), exact=False, requant=True)
    fp32 = Form(weight=g.planned((t.rows, t.cols), t.dequantize))
    if not spec.exact_blocks:
        return fp32
    if t.type_name in FLOAT_TYPES:
        if spec.float_bits is None:
            return fp32
        bits = max(spec.float_bits, 8) if small else spec.float_bits
        return Form(packed=packing(t, bits), exact=False)
    p = packed if packed is not None else packing(t)
    if spec.min_bits == 8 and p.layout.bits == 4:
        p = p.then(p.layout.widened(), widen)
    if p.layout.bits == 8 and spec.accuracy_level < 4:
        return Form(packed=p, pair=True) if small else fp32
    if spec.requant is not None and spec.requant.fp32_input(name) and p.layout.bits == 4 and not small:
        g.fp32_inputs += 1
        return Form(packed=p, accuracy=1)
    return Form(packed=p)


def exact_already(t: Tensor, enc: Encoding) -> bool:
    """Whether the tensor's exact mapping is that encoding already (Q8_0 and Q5_0 at 8 bits block 32, Q4_0 at
    4 bits block 32, all symmetric): re-encoding would reproduce its codes under another name, so it keeps
    them, shared with the exact variants."""
    if t.type_name in FLOAT_TYPES or enc.zero_point:
        return False
    lay = Layout.of(t.type_name, t.rows, t.cols)
    return (lay.bits, lay.block, lay.correction) == (enc.bits, enc.block, False)


def requantized(t: Tensor, enc: Encoding) -> Packing:
    """The tensor re-encoded (convert/requant.py), planned from its shape and computed a band of rows at a
    time from its dequantized rows (a vocabulary-sized table is never whole in fp32)."""
    lay = Layout(enc.bits, t.rows, t.cols, enc.block, zero_points=enc.zero_point)
    return packing_from(t, lay, lambda w: requantize(w, enc))


def planned_array(a: np.ndarray | None) -> np.ndarray:
    """An optional array the layout said would be there."""
    if a is None:
        raise RuntimeError("converter bug: the layout planned an array the packing does not have")
    return a


def note(g: GraphBuilder, name: str, how: str) -> None:
    """Record in the variant's quant map how a tensor of this source type was mapped."""
    ways = g.quant_map.setdefault(g.tensor(name).type_name, [])
    if how not in ways:
        ways.append(how)


def linear(
    g: GraphBuilder,
    x: str,
    key: str,
    names: list[str],
    blocksum: str | None = None,
    *,
    bias: list[str] | None = None,
    small: bool = False,
) -> tuple[str, str | None]:
    """y = x @ concat(W_names)^T (+ concat(bias)). `small`: keep the bytes down (a vocabulary-sized head).
    Returns (y, the block-32 sums of x when they were computed) so a caller can reuse them."""
    forms = [form(g, n, small) for n in names]
    for n, f in zip(names, forms, strict=True):
        note(g, n, ("head: " if small else "") + f.describe())
    outs: list[str] = []
    sums: dict[int, str] = {BLOCK: blocksum} if blocksum else {}
    runs: list[list[Form]] = []
    for f in forms:
        if runs and runs[-1][0].layout == f.layout:
            runs[-1].append(f)
        else:
            runs.append([f])
    start = 0
    for fs in runs:
        # a run's initializers are named after its tensors and layout: variants that map them alike share
        # the bytes in the weights file, and ones that do not never collide
        k = key if len(runs) == 1 else f"{key}.{start}_{start + len(fs)}"
        k += REQUANT_TAG if fs[0].requant else ""
        start += len(fs)
        if fs[0].packed is None:
            ws = [f.weight for f in fs if f.weight is not None]
            shape = (ws[0].shape[1], sum(w.shape[0] for w in ws))
            wt = g.planned(
                shape, lambda ws=ws: np.ascontiguousarray(np.concatenate([w.make() for w in ws]).T)
            )
            outs.append(g.node("MatMul", [x, g.init(f"{k}.weight_t", wt)])[0])
        else:
            p = Packing.concat([f.packed for f in fs if f.packed is not None])
            outs.append(matmul_nbits(g, x, p, k, sums, pair=fs[0].pair, accuracy=fs[0].accuracy))
    y = outs[0] if len(outs) == 1 else g.node("Concat", outs, axis=-1)[0]
    if bias:
        parts = [g.dequantized(n) for n in bias]
        b = g.planned(
            (sum(pt.shape[1] for pt in parts),),
            lambda: np.concatenate([pt.make().reshape(-1) for pt in parts]),
        )
        y = g.node("Add", [y, g.init(f"{key}.bias", b)])[0]
    return y, sums.get(BLOCK)


def matmul_nbits(
    g: GraphBuilder,
    x: str,
    p: Packing,
    key: str,
    sums: dict[int, str] | None = None,
    *,
    pair: bool = False,
    weight_names: tuple[str, str] | None = None,
    accuracy: int | None = None,
) -> str:
    """One MatMulNBits node (+ the per-block correction). `weight_names`: existing initializers holding
    the packed codes and scales (a tied table shares them with the lookup). `accuracy`: its
    accuracy_level, when not the variant's."""
    sums = {} if sums is None else sums
    level = g.spec.accuracy_level if accuracy is None else accuracy
    lay: Layout = p.layout
    q = p.then(lay.nibble_pair(), as_nibble_pair) if pair else p
    ql = q.layout
    key = f"{key}.q{lay.bits}" + ("" if lay.block == BLOCK else f"b{lay.block}") + ("pair" if pair else "")
    if weight_names is None:
        inputs = [
            g.init(f"{key}.qweight", g.planned(ql.packed_shape, lambda: q.get().packed, np.uint8)),
            g.init(f"{key}.scales", g.planned(ql.scales_shape, lambda: q.get().scales)),
        ]
    else:
        inputs = list(weight_names)
    if ql.zero_points:
        zp = g.planned(ql.zero_points_shape, lambda: planned_array(q.get().zero_points), np.uint8)
        inputs.append(g.init(f"{key}.zero_points", zp))
    if level >= 4 and weight_names is None:
        # with int8 activations MatMulNBits (x86, onnxruntime 1.32) copies the scales into its packed
        # weights and keeps the initializer mapped, read once: 247 MB of Qwen2.5 1.5B's RSS, never read
        # again (the runtime gives those pages back after loading: runtime/session.py). Not a tied head's:
        # they are the lookup table's scales, which the gather reads from a mapping at the same offset.
        g.copied_at_load.add(inputs[1])
    xin = g.node("Concat", [x, x], axis=-1)[0] if pair else x
    y = g.node(
        "MatMulNBits",
        [xin, *inputs],
        domain=MS,
        K=ql.k,
        N=ql.n,
        bits=ql.bits,
        block_size=ql.block,
        accuracy_level=level,
    )[0]
    if not lay.correction:
        return y
    if lay.block not in sums:
        sums[lay.block] = block_sums(g, x, lay.k, lay.block)
    corr = g.planned(lay.correction_shape, lambda: planned_array(p.get().correction))
    # Gemm adds the correction to y in the same node (the graph is 2-D: [tokens, features])
    return g.node("Gemm", [sums[lay.block], g.init(f"{key}.correction", corr), y])[0]


# The largest 0/1 block-indicator matrix the block sums read by a MatMul (k * k / 32 fp32: k 2,896 at 32).
# Up to here it stays in cache and one MatMul is no slower than two nodes: a Reshape + ReduceSum everywhere
# decoded SmolLM2 (k 576 and 1,536) 1-7 % slower in each of three interleaved rounds. Past it the reads
# dominate: Qwen2.5 1.5B's ffn_down (k 8,960) read a 10 MB indicator a call, 6 % of its decode step's kernel
# time, and ReduceSum decoded 5 % faster.
INDICATOR_MAX_BYTES = 1 << 20


def block_sums(g: GraphBuilder, x: str, k: int, block: int) -> str:
    """[tokens, k / block]: the sums of x over each block, exactly: a MatMul with a 0/1 block-indicator
    matrix while that matrix is small, else a Reshape and a ReduceSum that read x alone."""
    nb = k // block
    if k * nb * 4 <= INDICATOR_MAX_BYTES:

        def indicator() -> np.ndarray:
            return np.kron(np.eye(nb, dtype=np.float32), np.ones((block, 1), np.float32))

        name = f"block_indicator_{k}" if block == BLOCK else f"block_indicator_{k}_{block}"
        return g.node("MatMul", [x, g.init(name, g.planned((k, nb), indicator))])[0]
    blocks = g.node("Reshape", [x, g.const(f"blocks_{k}_{block}", np.array([-1, nb, block], np.int64))])[0]
    return g.node("ReduceSum", [blocks, g.const("last_axis", np.array([-1], np.int64))], keepdims=0)[0]


def slice_rows(lay: Layout, slice_bytes: int) -> int:
    """Rows per MatMulNBits node of a sliced matrix: about `slice_bytes` of codes, a multiple of 64 rows so
    that a slice aliased into a whole table starts 64-byte aligned in the weights file, as the table does."""
    row_bytes = lay.nb * lay.block * lay.bits // 8
    return max(64, slice_bytes // row_bytes // 64 * 64)


def row_sliced(
    g: GraphBuilder,
    x: str,
    p: Packing,
    key: str,
    *,
    pair: bool = False,
    whole: tuple[str, str] | None = None,
) -> str:
    """y = x @ W^T for a vocabulary-sized W as MatMulNBits nodes over slices of its rows (SLICE_BYTES of
    codes each), concatenated; one node when W is no larger than a slice. `whole`: initializers already in
    the weights file holding W's codes and scales (a tied head reads the lookup's table), which each slice
    aliases by rows; without it each slice writes codes of its own (an untied head).

    Why slices: onnxruntime prepacks each node's codes into memory of its own and only then unmaps the
    initializer, so while a head is packed its original codes are resident too; slice by slice only one slice
    is. Peak RSS while the session is created, one node -> slices (MB over the RSS before it, a shared
    machine, identical to 0.2 MB over three interleaved rounds):
    | head | q4-a8 | q4 (exact) |
    |---|---|---|
    | untied Q8_0 151,936 x 896 (Qwen 2.5 0.5B's shape), 5 slices | 338 -> 226 | 280 -> 180 (nibble pair) |
    | untied Q6_K 128,256 x 1024 (Llama 3's vocabulary), 4 slices | 391 -> 272 | 274 -> 178 (nibble pair) |
    | untied Q4_K 128,256 x 1024, 2 slices | 203 -> 171 | 146 -> 122 |
    | Gemma 3 270M's tied Q8_0 262,144 x 640, 6 slices | 542 -> 398 | 641 -> 513 (nibble pair) |
    Resident after loading: 0-23 MB less with int8 activations, 0-8 MB more for the exact variant.
    Every per-row array is cut alike (PackedNBits.rows): scales, offsets and shifts, so each slice carries
    its own part of the correction for formats with a min; a nibble pair is made per slice from the slice's
    8-bit codes. The block sums of x are computed once for all slices."""
    lay = p.layout
    rows = slice_rows(lay, SLICE_BYTES)
    if rows >= lay.n:
        # one node reads the whole initializers themselves (aliasing a name to itself adds it to the graph)
        names = None if whole is None else (g.alias(whole[0], whole[0]), g.alias(whole[1], whole[1]))
        return matmul_nbits(g, x, p, key, pair=pair, weight_names=names)
    sums: dict[int, str] = {}
    outs = []
    for i, lo in enumerate(range(0, lay.n, rows)):
        hi = min(lo + rows, lay.n)
        part = p.band(lo, hi)
        names = None
        if whole is not None:
            names = (
                g.alias(f"{whole[0]}.{i}", whole[0], rows=(lo, hi)),
                g.alias(f"{whole[1]}.{i}", whole[1], rows=(lo, hi)),
            )
        outs.append(matmul_nbits(g, x, part, f"{key}.{i}", sums, pair=pair, weight_names=names))
        g.settle()  # a slice's rows of the source are read and written: give them back
    return g.node("Concat", outs, axis=-1)[0]
