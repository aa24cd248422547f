"""Write a tiny BERT GGUF with the `gguf` package, in llama.cpp's `bert` layout, from the tiny checkpoint of
tests/reference_bert.py (its config and weights, its WordPiece vocabulary in llama.cpp's phantom-space
spelling); and read its weights back under the checkpoint's names with the `gguf` package alone, so the
numpy reference runs on exactly what the file holds (f16 or Q8_0 rounding included).

Tensor names come from gguf-py's own name map, not from simmer's table (models/convert/families/bert.py),
so a wrong entry there shows up as a wrong vector or a refused file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFReader,
    GGUFWriter,
    PoolingType,
    TokenType,
    get_tensor_name_map,
    quants,
)

from tests.reference_bert import TINY_SPECIALS, TINY_WORDS

F32, F16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16
# kept f32 whatever the file type, as convert_hf_to_gguf.py keeps them (vectors and norms are, too)
_F32_TABLES = ("position_embd.weight", "token_types.weight")


def gguf_name(checkpoint_name: str, layers: int) -> str:
    found = get_tensor_name_map(MODEL_ARCH.BERT, layers).get_type_and_name(
        checkpoint_name, try_suffixes=(".weight", ".bias")
    )
    assert found is not None, checkpoint_name
    return found[1]


def phantom_vocabulary() -> tuple[list[str], list[int]]:
    tokens = [*TINY_SPECIALS]
    for word in TINY_WORDS:
        tokens.append(word[2:] if word.startswith("##") else "\u2581" + word)
    types = [TokenType.CONTROL] * len(TINY_SPECIALS) + [TokenType.NORMAL] * len(TINY_WORDS)
    return tokens, [int(t) for t in types]


def write_tiny_bert_gguf(
    path: Path,
    cfg: dict,
    weights: dict[str, np.ndarray],
    *,
    matrix_type: GGMLQuantizationType = F32,
    pooling: int = PoolingType.MEAN,
    extra_tensors: dict[str, np.ndarray] | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """`matrix_type`: the type of every matrix but the f32 tables (F32, F16 or a block type)."""
    layers = cfg["num_hidden_layers"]
    w = GGUFWriter(path, "bert")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(PoolingType(pooling))
    w.add_token_type_count(cfg["type_vocab_size"])
    tokens, types = phantom_vocabulary()
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    ids = {t: i for i, t in enumerate(TINY_SPECIALS)}
    w.add_pad_token_id(ids["[PAD]"])
    w.add_unk_token_id(ids["[UNK]"])
    w.add_bos_token_id(ids["[CLS]"])  # gguf-py writes [CLS] as the BOS (it has no CLS key)
    w.add_eos_token_id(ids["[SEP]"])
    w.add_sep_token_id(ids["[SEP]"])
    w.add_mask_token_id(ids["[MASK]"])
    for key, value in (meta or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    for name, data in weights.items():
        target = gguf_name(name, layers)
        keep = data.ndim == 1 or target.endswith("_norm.weight") or target in _F32_TABLES
        if keep or matrix_type == F32:
            w.add_tensor(target, data.astype(np.float32))
        elif matrix_type == F16:
            w.add_tensor(target, data.astype(np.float16))
        else:
            w.add_tensor(target, quants.quantize(data.astype(np.float32), matrix_type), raw_dtype=matrix_type)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def checkpoint_weights(path: Path, cfg: dict, names: list[str]) -> dict[str, np.ndarray]:
    """The GGUF's tensors as fp32 under the checkpoint's `names`, dequantized by the gguf package."""
    stored = {t.name: t for t in GGUFReader(path).tensors}
    out = {}
    for name in names:
        t = stored[gguf_name(name, cfg["num_hidden_layers"])]
        data = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        out[name] = data.reshape([int(n) for n in reversed(t.shape)] if len(t.shape) == 2 else [-1])
    return out
