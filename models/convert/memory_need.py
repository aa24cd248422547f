"""How much memory a conversion takes above what the process holds when it starts, from the GGUF's header.

A conversion streams (models/convert/graph.py, reference.py, measure.py), so what it adds at its peak is its
largest single step, not the model:
- building a variant: one fused projection (a layer's gate and up matrices together) decoded and encoded,
  or a band of a vocabulary-sized table (graph.BAND_BYTES), or a slice of a head (linear.SLICE_BYTES);
- the fp32 reference: one tensor dequantized, and a chunk of the LM head's rows;
- measuring a variant: one segment's session (its weights prepacked, about twice their GGUF bytes, plus
  onnxruntime's own memory);
- the quality floor with llama.cpp (llama-cpp-python installed): the GGUF mapped whole, its buffers, the
  reference's logits; without it the int8 reference, as the fp32 one, its logits beside the fp32 ones;
- from the reference on, its logits over the quality text (convert/quality.py: a vocabulary of fp32 per
  position), held until every variant is measured, the re-encoded one built meanwhile.
The bounds are conservative: measured peaks on Qwen2.5-Coder 0.5B and 1.5B and on a synthetic model stay
under them (tests/models/convert/test_convert_memory.py; docs/performance.md).
"""

from __future__ import annotations

import importlib.util

import numpy as np

from models.convert.graph import BAND_BYTES
from models.convert.linear import SLICE_BYTES
from models.convert.measure import plan_segments
from models.convert.model import GGUFModel
from models.convert.quality import QUALITY_POSITIONS
from models.convert.reference import HEAD_CHUNK

# bytes of working memory per parameter while one matrix is encoded (codes widened to int16, scales,
# offsets, the packed result; an fp32 route's dequantized copy and its transpose), and while one is
# dequantized for the reference (its blocks decoded, the fp32 result, a product's temporaries)
ENCODE_BYTES_PER_PARAM = 8
REFERENCE_BYTES_PER_PARAM = 12
SESSION_PER_GGUF_BYTE = 2.5  # a segment's session over its weights' GGUF bytes (prepacked codes, scales)
SESSION_OVERHEAD = 64 << 20  # onnxruntime's arenas, the graph, a small KV buffer
PEER_OVERHEAD = 128 << 20  # llama.cpp's library, its context and compute buffers at one token a batch


def _params(model: GGUFModel, name: str) -> int:
    rows, cols = model.shapes[name]
    return rows * cols


def estimate_memory(model: GGUFModel, measure: bool = True) -> dict[str, int]:
    """Bytes each step of converting `model` may add to the process's RSS at its peak: the largest is what
    the conversion needs beyond what the process holds."""
    cfg = model.config
    layer = [_params(model, n) for n in model.tensors if n.startswith("blk.") and model.shapes[n][0] > 1]
    fused = [
        _params(model, f"blk.{i}.ffn_gate.weight") + _params(model, f"blk.{i}.ffn_up.weight")
        for i in range(cfg.n_layers)
    ]
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    # tables are encoded in bands (BAND_BYTES of output) and heads in slices (SLICE_BYTES of codes), at
    # most a byte a parameter
    tables = [_params(model, "token_embd.weight"), _params(model, head)]
    whole_at_once = max([*fused, *layer, min(tables[1], SLICE_BYTES), min(tables[0], BAND_BYTES)])
    need = {"building: one projection encoded": ENCODE_BYTES_PER_PARAM * whole_at_once}
    if measure:
        chunk = min(HEAD_CHUNK, cfg.vocab) * cfg.hidden * 4  # fp32 rows of the head, and their product
        logits = min(QUALITY_POSITIONS, cfg.context_length - 8) * cfg.vocab * 4
        need["the fp32 reference: one tensor dequantized"] = (
            REFERENCE_BYTES_PER_PARAM * max(layer, default=0) + 3 * chunk + logits
        )
        if importlib.util.find_spec("llama_cpp") is not None:
            need["llama.cpp measuring the quality floor"] = model.path.stat().st_size + PEER_OVERHEAD + logits
        else:
            need["the int8 reference (the quality floor without llama.cpp)"] = (
                REFERENCE_BYTES_PER_PARAM * max(layer, default=0) + 3 * chunk + 2 * logits
            )
        sizes = _segment_bytes(model, plan_segments(model))
        need["measuring: one segment's session"] = (
            int(SESSION_PER_GGUF_BYTE * max(sizes)) + SESSION_OVERHEAD + logits
        )
        need["building the re-encoded variant: one projection encoded"] = (
            ENCODE_BYTES_PER_PARAM * whole_at_once + logits
        )
    return need


def _segment_bytes(model: GGUFModel, segments: list) -> list[int]:
    """The GGUF bytes of each segment's weights (a head segment: the head's table)."""
    cfg = model.config
    sizes = []
    for seg in segments:
        total = 0
        for name in model.tensors:
            if name.startswith("blk.") and seg.lo <= int(name.split(".")[1]) < seg.hi:
                total += int(np.asarray(model.tensor(name).data).nbytes)
        if seg.head:
            head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
            total += int(np.asarray(model.tensor(head).data).nbytes)
        sizes.append(total)
    return sizes
