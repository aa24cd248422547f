"""The token embedding lookup and the LM head (tied to the embedding when the GGUF has no output.weight).

A vocabulary-sized table is often larger than all the layers together (Gemma 3: 262,144 x 640, 168 MB as
Q8_0), so where its bytes live and how many copies stay resident is decided here:

- The lookup gathers exact rows from the table's own codes in every variant (GatherBlockQuantized over the
  4- or 8-bit codes, plus a gathered offset for formats with a min: bit-for-bit GGML's values), or fp32 rows
  from a float table.
- The lookup reads its own alias of the bytes the head uses (WeightFile.alias): onnxruntime unmaps the head's
  initializer once MatMulNBits has prepacked it, and of the alias only the pages of rows actually looked up
  become resident. Sharing one initializer kept the whole table resident twice.
- A tied head with int8 activations runs on the very same codes (one copy on disk, one prepacked in memory),
  as MatMulNBits nodes over 32 MiB slices of them (tied_head), so that loading holds one slice's original
  codes beside the packed head, not the whole table. With fp32 activations an 8-bit head is a nibble pair
  (linear.py): its own bytes, and the lookup keeps gathering from the 8-bit codes.
- Neither is read in at load when the mapped tables are large (session.prefault_mappings): of the lookup's
  alias only rows looked up become resident.

What stays resident of Gemma 3's table (q4-a8, measured): the packed head (~210 MB by MLAS's layout: int8
codes, fp32 scales and block sums; 319 MB are packed in all), the head's fp32 scales as mapped (21 MB: the
x86 kernel copies them but keeps the initializer), and the pages of looked-up rows. No single 8-bit copy
serves both: MatMulNBits without its packed form dequantizes the whole table to fp32 on every
call (671 MB, `session.disable_prepacking`), and no stock gather reads the packed layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from models.convert.linear import FLOAT_TYPES, MS, form, linear, matmul_nbits, note, planned_array
from models.gguf.quant import DEFAULT_ZP, Layout, Packing

if TYPE_CHECKING:
    from models.convert.graph import GraphBuilder

TABLE = "token_embd.weight"
QWEIGHT, SCALES = "token_embd.qweight", "token_embd.scales"  # a packed table's codes and scales
HEAD_CHUNK_BYTES = 32 << 20  # codes per MatMulNBits node of a tied head (tied_head)


def embed_tokens(g: GraphBuilder) -> tuple[str, Packing | None]:
    """Rows of the embedding table for `input_ids` ([tokens, hidden] after a reshape by the caller), and the
    table's packed codes when the LM head can run on them."""
    table = g.tensor(TABLE)
    if table.type_name in FLOAT_TYPES:
        # the bytes are written under the head's name (once, whichever variant is built first); the graph
        # holds only the lookup's alias unless the head uses the table too
        g.w.add(TABLE, g.dequantized(TABLE))
        note(g, TABLE, "lookup: fp32 rows, exact")
        rows = g.node("Gather", [g.alias("token_embd.gather_weight", TABLE), "input_ids"], axis=0)[0]
        return rows, None
    p = g.packed(TABLE)
    lay = p.layout
    note(
        g, TABLE, f"lookup: {lay.bits}-bit rows gathered" + (" + offsets" if lay.offsets else "") + ", exact"
    )
    g.w.add(QWEIGHT, g.planned(lay.packed_shape, lambda: p.get().packed, np.uint8))
    g.w.add(SCALES, g.planned(lay.scales_shape, lambda: p.get().scales))
    inputs = [
        g.alias("token_embd.gather_qweight", QWEIGHT),
        "input_ids",
        g.alias("token_embd.gather_scales", SCALES, dims=(lay.n, lay.nb, 1)),
    ]
    if lay.shift:  # codes sit `shift` above the default zero point: gather (u - zp) * s exactly

        def zero_points() -> np.ndarray:
            shift = planned_array(p.get().shift)
            zp = DEFAULT_ZP[lay.bits] - shift[:, None, None] + np.zeros((1, lay.nb, 1), np.uint8)
            return zp.astype(np.uint8)

        zp = g.planned((lay.n, lay.nb, 1), zero_points, np.uint8)
        inputs.append(g.init("token_embd.gather_zero_points", zp))
    rows = g.node(
        "GatherBlockQuantized",
        inputs,
        domain=MS,
        bits=lay.bits,
        block_size=lay.block,
        gather_axis=0,
        quantize_axis=2,
    )[0]
    if lay.offsets:
        offsets = g.planned((lay.n, lay.nb, 1), lambda: planned_array(p.get().offsets)[..., None])
        table_offsets = g.init("token_embd.offsets", offsets)
        rows = g.node("Add", [rows, g.node("Gather", [table_offsets, "input_ids"], axis=0)[0]])[0]
    return rows, p


def lm_head(g: GraphBuilder, last: str, embd_packed: Packing | None) -> None:
    """logits [1, positions kept, vocab]. A tied head runs on the lookup's table where the kernel
    takes its codes as they are (MatMulNBits at any width with int8 activations, 4 bits with fp32 ones)."""
    cfg = g.cfg
    if not cfg.tied_embeddings:
        logits, _ = linear(g, last, "lm_head", ["output.weight"], small=True)
    elif embd_packed is None:  # a float table
        f = form(g, TABLE, small=True)
        note(g, TABLE, "head: " + f.describe())
        if f.packed is None:
            logits = g.node("Gemm", [last, g.init(TABLE, g.dequantized(TABLE))], transB=1)[0]
        else:
            logits = matmul_nbits(g, last, f.packed, "lm_head")
    else:
        f = form(g, TABLE, small=True, packed=embd_packed)
        if f.packed is not None and f.packed is embd_packed and not f.pair:
            note(g, TABLE, "head: " + f.describe() + " on the lookup's codes")
            logits = tied_head(g, last, embd_packed)
        else:
            logits, _ = linear(g, last, "lm_head", [TABLE], small=True)
    g.node("Reshape", [logits, g.const("logits_shape", np.array([1, -1, cfg.vocab], np.int64))])
    g.nodes[-1].output[0] = "logits"


def head_chunk_rows(lay: Layout, chunk_bytes: int) -> int:
    """Rows of the table per MatMulNBits node of a tied head: about `chunk_bytes` of codes, a multiple of
    64 rows so that every slice starts 64-byte aligned in the weights file, as the whole table does."""
    row_bytes = lay.nb * lay.block * lay.bits // 8
    return max(64, chunk_bytes // row_bytes // 64 * 64)


def tied_head(g: GraphBuilder, last: str, p: Packing) -> str:
    """logits over the lookup's own codes and scales, as MatMulNBits over slices of the table concatenated.

    Why slices (HEAD_CHUNK_BYTES each): onnxruntime prepacks each node's codes into memory of its own and
    only then unmaps the initializer, so while the head is packed the original codes are resident too. For
    Gemma 3's 262,144 x 640 table as one node that was 160 MB on top of everything at load, and it set the
    peak RSS; slice by slice only one slice is. The lookup keeps its alias over the whole table."""
    lay = p.layout
    codes = g.planned(lay.packed_shape, lambda: p.get().packed, np.uint8)
    scales = g.planned(lay.scales_shape, lambda: p.get().scales)
    rows = head_chunk_rows(lay, HEAD_CHUNK_BYTES)
    if rows >= lay.n:
        return matmul_nbits(
            g, last, p, "token_embd", weight_names=(g.init(QWEIGHT, codes), g.init(SCALES, scales))
        )
    g.w.add(QWEIGHT, codes)  # written once (the lookup has it already); the graph reads it by slices
    g.w.add(SCALES, scales)
    sums: dict[int, str] = {}
    outs = []
    for i, lo in enumerate(range(0, lay.n, rows)):
        hi = min(lo + rows, lay.n)
        part = p.then(replace(lay, n=hi - lo), lambda whole, lo=lo, hi=hi: whole.rows(lo, hi))
        names = (
            g.alias(f"{QWEIGHT}.{i}", QWEIGHT, rows=(lo, hi)),
            g.alias(f"{SCALES}.{i}", SCALES, rows=(lo, hi)),
        )
        outs.append(matmul_nbits(g, last, part, f"token_embd.{i}", sums, weight_names=names))
    return g.node("Concat", outs, axis=-1)[0]
