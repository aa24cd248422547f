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
- Every other head on MatMulNBits (an untied output.weight, a nibble pair, a widened or float table) is
  sliced the same way (linear.row_sliced), over codes of its own.
- Neither is read in at load when the mapped tables are large (session.prefault_mappings): of the lookup's
  alias only rows looked up become resident.

What stays resident of Gemma 3's table (q4-a8, measured): the packed head (~210 MB by MLAS's layout: int8
codes, fp32 scales and block sums; 319 MB are packed in all), the head's fp32 scales as mapped (21 MB: the
x86 kernel copies them but keeps the initializer), and the pages of looked-up rows. No single 8-bit copy
serves both: MatMulNBits without its packed form dequantizes the whole table to fp32 on every
call (671 MB, `session.disable_prepacking`), and no stock gather reads the packed layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from models.convert.linear import (
    FLOAT_TYPES,
    MS,
    REQUANT_TAG,
    form,
    linear,
    note,
    planned_array,
    row_sliced,
)
from models.gguf.quant import DEFAULT_ZP, PackedNBits, Packing

if TYPE_CHECKING:
    from models.convert.graph import GraphBuilder, Planned

TABLE = "token_embd.weight"
QWEIGHT, SCALES = "token_embd.qweight", "token_embd.scales"  # a packed table's codes and scales
HEAD_WRITES_LOGITS = True  # a tied head without correction emits the logits output itself (lm_head)


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
    table = table_arrays(g, p)
    inputs = [
        g.alias("token_embd.gather_qweight", QWEIGHT),
        "input_ids",
        g.alias("token_embd.gather_scales", SCALES, dims=(lay.n, lay.nb, 1)),
    ]
    if lay.shift:  # codes sit `shift` above the default zero point: gather (u - zp) * s exactly
        inputs.append(g.init("token_embd.gather_zero_points", table["token_embd.gather_zero_points"]))
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
        table_offsets = g.init("token_embd.offsets", table["token_embd.offsets"])
        rows = g.node("Add", [rows, g.node("Gather", [table_offsets, "input_ids"], axis=0)[0]])[0]
    return rows, p


def table_arrays(g: GraphBuilder, p: Packing) -> dict[str, Planned]:
    """The lookup's arrays of the packed table, written into the weights file together a band of rows at a
    time (WeightFile.add_many): the table is decoded once and never whole in memory."""
    lay = p.layout

    def planned(shape: tuple[int, ...], dtype: type, band: Callable[[PackedNBits], np.ndarray]) -> Planned:
        return g.planned(shape, lambda: band(p.get()), dtype, rows=lambda lo, hi: band(p.rows(lo, hi)))

    def zero_points(b: PackedNBits) -> np.ndarray:
        zp = DEFAULT_ZP[lay.bits] - planned_array(b.shift)[:, None, None] + np.zeros((1, lay.nb, 1), np.uint8)
        return zp.astype(np.uint8)

    arrays = {
        QWEIGHT: planned(lay.packed_shape, np.uint8, lambda b: b.packed),
        SCALES: planned(lay.scales_shape, np.float32, lambda b: b.scales),
    }
    if lay.shift:
        arrays["token_embd.gather_zero_points"] = planned((lay.n, lay.nb, 1), np.uint8, zero_points)
    if lay.offsets:
        arrays["token_embd.offsets"] = planned(
            (lay.n, lay.nb, 1), np.float32, lambda b: planned_array(b.offsets)[..., None]
        )
    g.w.add_many(list(arrays.items()))
    return arrays


def lm_head(g: GraphBuilder, last: str, embd_packed: Packing | None) -> None:
    """logits [batch, positions kept, vocab]. A tied head runs on the lookup's table where the kernel
    takes its codes as they are (MatMulNBits at any width with int8 activations, 4 bits with fp32 ones).
    Every head on MatMulNBits is sliced by rows when it is large (row_sliced), tied or not."""
    cfg = g.cfg
    if not cfg.tied_embeddings:
        logits = head(g, last, "output.weight")
    elif embd_packed is None:  # a float table
        f = form(g, TABLE, small=True)
        if f.packed is None:
            note(g, TABLE, "head: " + f.describe())
            logits = g.node("Gemm", [last, g.init(TABLE, g.dequantized(TABLE))], transB=1)[0]
        else:
            logits = head(g, last, TABLE)
    else:
        f = form(g, TABLE, small=True, packed=embd_packed)
        if f.packed is not None and f.packed is embd_packed and not f.pair:
            note(g, TABLE, "head: " + f.describe() + " on the lookup's codes")
            if HEAD_WRITES_LOGITS and not embd_packed.layout.correction:
                # fed [batch, positions, hidden], the head's last node (the slices' Concat, or the one
                # MatMulNBits) writes [batch, positions, vocab] straight into the caller's logits buffer: a
                # final Reshape into a bound output copies all of them (1 MB a token for Gemma 3), a Reshape
                # of the hidden state copies nothing. A head with a correction stays 2-D (its Gemm).
                tied_head(g, g.to_seq(last, cfg.hidden), embd_packed)
                g.nodes[-1].output[0] = "logits"
                return
            logits = tied_head(g, last, embd_packed)
        else:
            logits = head(g, last, TABLE, embd_packed)
    g.to_seq(logits, cfg.vocab)
    g.nodes[-1].output[0] = "logits"


def head(g: GraphBuilder, last: str, name: str, packed: Packing | None = None) -> str:
    """A head on codes of its own: MatMulNBits by slices (an untied output.weight, or a tied table at
    another width or as a nibble pair than the lookup's), or fp32 MatMul where the variant says so."""
    f = form(g, name, small=True, packed=packed)
    if f.packed is None:
        return linear(g, last, "lm_head", [name], small=True)[0]
    note(g, name, "head: " + f.describe())
    return row_sliced(g, last, f.packed, "lm_head" + REQUANT_TAG if f.requant else "lm_head", pair=f.pair)


def tied_head(g: GraphBuilder, last: str, p: Packing) -> str:
    """logits over the lookup's own codes and scales, by slices of the table (row_sliced): the table is in
    the weights file once, and the lookup keeps its alias over the whole of it."""
    table_arrays(g, p)  # the lookup's already
    return row_sliced(g, last, p, "token_embd", whole=(QWEIGHT, SCALES))
