"""How many bytes a conversion will write, per output file, from the GGUF's header alone (no weights read).

The store checks free disk space against this before converting. The plan is the converter itself: each
variant's graph is built exactly as `build_variant` builds it, over a dry WeightFile. Every weight is declared
with its shape before its values are computed (graph.Planned, quant.Layout), so the dry build names, aligns
and deduplicates the same initializers at the same offsets as the real one without computing any: the
weights file and each .onnx file are predicted exactly, and a real build checks every array it computes
against its declared shape. Only the tokenizer files and the small files are bounds (JSON, zip headers).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from models.convert.fast_plan import PLANS
from models.convert.graph import VARIANTS, GraphBuilder, SplitWeights, VariantSpec, WeightFile
from models.convert.kv_dtype import FP32, variant_kv_dtype
from models.convert.model import GGUFModel
from models.runtime import bpe, spm

WEIGHTS_FILE = "weights.data"  # pipeline.WEIGHTS_FILE (the pipeline imports this module)
SMALL_FILES = 64 << 10  # chat template, tokenizer_config.json, genai_config.json
NPZ_HEADERS = 16 << 10  # a compact tokenizer's zip and .npy headers, and its pre-tokenizer's JSON


def _string_array(model: GGUFModel, key: str) -> tuple[int, int]:
    """(count, total UTF-8 bytes) of a string array in the header, without decoding it."""
    field = model.reader.fields.get(key)
    if field is None:
        return 0, 0
    return len(field.data), sum(len(field.parts[i]) for i in field.data)


def _tokenizer_bytes(model: GGUFModel) -> int:
    """tokenizer.json spells each token twice at most (vocabulary, added tokens) and each merge once, with
    a few bytes of JSON around each; escapes (\\uXXXX) can take up to 6 bytes for a 2-byte character."""
    n_tokens, token_bytes = _string_array(model, "tokenizer.ggml.tokens")
    n_merges, merge_bytes = _string_array(model, "tokenizer.ggml.merges")
    return 3 * (token_bytes + merge_bytes) + 24 * (n_tokens + n_merges) + (64 << 10)


def _compact_tokenizer(model: GGUFModel) -> dict[str, int]:
    """The compact vocabulary file simmer loads (tokenizer.bpe.npz or tokenizer.spm.npz), bounded from its
    arrays: the token texts, a few bytes per token and per merge, and the .npz's own headers."""
    field = model.reader.fields.get("tokenizer.ggml.model")
    kind = field.contents() if field is not None else None
    n_tokens, token_bytes = _string_array(model, "tokenizer.ggml.tokens")
    if kind == "gpt2":  # lengths, sorted ids (int32 each), types (a byte); a merge's key, rank and id
        n_merges, _ = _string_array(model, "tokenizer.ggml.merges")
        return {bpe.VOCAB_FILE: token_bytes + 9 * n_tokens + 16 * n_merges + NPZ_HEADERS}
    if kind == "llama":  # lengths, scores, types; at most one pair of characters per byte of text
        return {spm.VOCAB_FILE: 9 * token_bytes + 9 * n_tokens + NPZ_HEADERS}
    return {}


def estimate_output(model: GGUFModel, names: list[str], kv_dtype: str = FP32) -> dict[str, int]:
    """Bytes per file the converter will write for these variants of an opened GGUF, in this order, with
    `kv_dtype` as convert() takes it (an fp16 attention adds its fp16 RoPE caches)."""
    weights = WeightFile(Path(WEIGHTS_FILE), dry=True)
    out: dict[str, int] = {}

    def spec(name: str, **changes: Any) -> VariantSpec:
        kv = variant_kv_dtype(kv_dtype, VARIANTS[name].accuracy_level)
        return replace(VARIANTS[name], kv_dtype=kv, **changes)

    for name in [n for n in names if VARIANTS[n].requant is None]:
        out[f"{name}.onnx"] = GraphBuilder(model, spec(name), weights).build().ByteSize()
    # a re-encoded variant is built plan by plan until one is kept: the largest plan bounds it
    for name in [n for n in names if VARIANTS[n].requant is not None]:
        for plan in PLANS:
            own = WeightFile(Path(f"{name}.data"), dry=True)
            graph = GraphBuilder(model, spec(name, requant=plan), SplitWeights(weights, own)).build()
            out[f"{name}.onnx"] = max(out.get(f"{name}.onnx", 0), graph.ByteSize())
            out[own.path.name] = max(out.get(own.path.name, 0), own.size)
    out[WEIGHTS_FILE] = weights.size
    out["tokenizer.json"] = _tokenizer_bytes(model)
    out |= _compact_tokenizer(model)
    out["small files"] = SMALL_FILES
    return out
