"""The token embedding lookup and the LM head (tied to the embedding when the GGUF has no output.weight).

A vocabulary-sized table is often larger than all the layers together (Gemma 3: 262,144 rows), so where its
bytes live and how many copies stay resident is decided here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from models.convert.linear import MS, linear
from models.gguf.quant import BLOCK, PackedNBits, q8_as_nibble_pair

if TYPE_CHECKING:
    from models.convert.graph import GraphBuilder


def embed_tokens(g: GraphBuilder) -> tuple[str, PackedNBits | None]:
    """Rows of the embedding table for `input_ids` ([tokens, hidden] after a reshape by the caller), and the
    packed table when the LM head can reuse it."""
    cfg, spec = g.cfg, g.spec
    # embeddings (tied to the LM head when the GGUF has no output.weight). The lookup reads its own
    # alias of the table: the head's copy is unmapped after prepacking, and the lookup's stays resident
    # only where rows were read. Sharing one initializer kept the whole table resident twice.
    embd = g.tensor("token_embd.weight")
    embd_packed = None
    if cfg.tied_embeddings and spec.embed_bits is not None and embd.type_name not in ("Q4_0", "Q4_1"):
        embd_packed = g.packed("token_embd.weight", spec.embed_bits)
        g.init(f"token_embd.q{embd_packed.bits}weight", embd_packed.packed)
        g.init(f"token_embd.q{embd_packed.bits}scales", embd_packed.scales)
    # The table's bytes are written under the head's name (whichever variant is built first: once);
    # the graph only holds the lookup's alias unless the head uses the table too.
    if embd.type_name == "Q8_0":
        # Q8_0 rows are exact as (q - 128) * scale in fp32, so every variant gathers from 8-bit rows:
        # a quarter of the bytes an fp32 row takes
        q8 = g.packed("token_embd.weight", 8)
        g.w.add("token_embd.q8weight", q8.packed)
        data = g.alias("token_embd.gather_q8weight", "token_embd.q8weight")
        scales = g.init("token_embd.scales_3d", q8.scales[..., None])
        rows = g.node(
            "GatherBlockQuantized",
            [data, "input_ids", scales],  # no zero points: uint8 data defaults to 128, like ours
            domain=MS,
            bits=8,
            block_size=BLOCK,
            gather_axis=0,
            quantize_axis=2,
        )[0]
    else:
        # other tables gather exact fp32 rows (a 4-bit table has no exact 8-bit form)
        g.w.add("token_embd.weight", g.dequantized("token_embd.weight"))
        table = g.alias("token_embd.gather_weight", "token_embd.weight")
        rows = g.node("Gather", [table, "input_ids"], axis=0)[0]
    return rows, embd_packed


def lm_head(g: GraphBuilder, last: str, embd_packed: PackedNBits | None) -> None:
    """Tied heads reuse the embedding's initializers. A Q4 head stays exact at 4 bits; an fp32-activation
    variant keeps any other head in fp32 (MatMulNBits' 8-bit kernel has no fast fp32-activation path)."""
    cfg, spec = g.cfg, g.spec
    head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    head = g.tensor(head_name)
    if cfg.tied_embeddings and embd_packed is not None:
        logits = g.node(
            "MatMulNBits",
            [last, f"token_embd.q{embd_packed.bits}weight", f"token_embd.q{embd_packed.bits}scales"],
            domain=MS,
            K=embd_packed.k,
            N=embd_packed.n,
            bits=embd_packed.bits,
            block_size=BLOCK,
            accuracy_level=spec.accuracy_level,
        )[0]
    elif spec.matmul_bits == 4 and head.type_name in ("Q4_0", "Q4_1"):
        logits, _ = linear(g, last, "lm_head", [head_name], bits=4)
    elif spec.matmul_bits == 4 and spec.accuracy_level < 4 and head.type_name == "Q8_0":
        # exact, and a quarter of the memory of a fp32 head at the same speed
        p = q8_as_nibble_pair(g.packed(head_name, 8))
        assert p.zero_points is not None
        twice = g.node("Concat", [last, last], axis=1)[0]
        logits = g.node(
            "MatMulNBits",
            [
                twice,
                g.init(f"{head_name}.nibbles", p.packed),
                g.init(f"{head_name}.nibble_scales", p.scales),
                g.init(f"{head_name}.nibble_zero_points", p.zero_points),
            ],
            domain=MS,
            K=p.k,
            N=p.n,
            bits=4,
            block_size=BLOCK,
            accuracy_level=spec.accuracy_level,
        )[0]
    elif spec.embed_bits is None:
        if cfg.tied_embeddings:
            table = g.init("token_embd.weight", g.dequantized("token_embd.weight"))
        else:
            table = g.init("output.weight", head.dequantize())
        logits = g.node("Gemm", [last, table], transB=1)[0]
    else:
        logits, _ = linear(g, last, "lm_head", [head_name], bits=spec.embed_bits)
    g.node("Reshape", [logits, g.const("logits_shape", np.array([1, -1, cfg.vocab], np.int64))])
    g.nodes[-1].output[0] = "logits"
