"""How many bytes a conversion will write, per output file, from the GGUF's header alone (no weights read).

The store checks free disk space against this before converting. It follows the graph builder's naming:
weights.data holds each initializer name once however many variants use it (WeightFile dedups by name),
aligned to 64 bytes, so the cost of a variant depends on which variants come before it. The .onnx files
and the tokenizer are bounded from above (their exact size depends on protobuf and JSON encoding).
A test converts real and tiny models and checks actual <= estimate <= actual + a few percent: when the
builder changes what it writes, that test says so.
"""

from __future__ import annotations

from models.convert.families import ModelConfig
from models.convert.graph import ALIGN, VARIANTS, VariantSpec
from models.gguf.quant import BLOCK
from models.gguf.reader import SUPPORTED_TYPES, GGUFModel

WEIGHTS_FILE = "weights.data"  # pipeline.WEIGHTS_FILE (the pipeline imports this module)
# Graph nodes and per-initializer external-data records of one .onnx file; measured ~1.6 KB per layer and
# ~5 KB per layer for the 4-bit graphs (which also carry their constants inline): bounded with room.
ONNX_FIXED = 64 << 10
ONNX_PER_LAYER = 8 << 10
SMALL_FILES = 64 << 10  # chat template, tokenizer_config.json, genai_config.json


def _tensor(model: GGUFModel, name: str) -> tuple[str, int, int]:
    """(type, rows, cols) of a tensor, from the header only."""
    t = model.tensors[name]
    shape = [int(x) for x in t.shape]
    rows, cols = (shape[1], shape[0]) if len(shape) == 2 else (1, shape[0])
    return SUPPORTED_TYPES[t.tensor_type], rows, cols


class _Weights:
    """Mirrors WeightFile: one entry per name, each aligned to ALIGN."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}

    def add(self, name: str, nbytes: int) -> None:
        self.names.setdefault(name, nbytes)

    def total(self) -> int:
        pos = 0
        for nbytes in self.names.values():
            pos += (-pos) % ALIGN
            pos += nbytes
        return pos


def _linear(w: _Weights, model: GGUFModel, key: str, names: list[str], bits: int | None) -> None:
    parts = [_tensor(model, n) for n in names]
    n = sum(rows for _, rows, _ in parts)
    k = parts[0][2]
    if bits is None:
        w.add(f"{key}.weight_t", n * k * 4)
        return
    w.add(f"{key}.qweight", n * k * bits // 8)
    w.add(f"{key}.scales", n * (k // BLOCK) * 4)
    # exact 4-bit packing of a Q4_1 matrix carries a per-block correction and a block-sum indicator
    if bits == 4 and any(t == "Q4_1" for t, _, _ in parts):
        w.add(f"block_indicator_{k}", k * (k // BLOCK) * 4)
        w.add(f"{key}.q41_correction", (k // BLOCK) * n * 4)


def _variant(w: _Weights, model: GGUFModel, cfg: ModelConfig, spec: VariantSpec) -> None:
    half = cfg.head_dim // 2
    w.add("rope.cos", cfg.context_length * half * 4)
    w.add("rope.sin", cfg.context_length * half * 4)
    embd_type, vocab, hidden = _tensor(model, "token_embd.weight")
    embd_packed_bits = None
    if cfg.tied_embeddings and spec.embed_bits is not None and embd_type not in ("Q4_0", "Q4_1"):
        embd_packed_bits = spec.embed_bits
        w.add(f"token_embd.q{spec.embed_bits}weight", vocab * hidden * spec.embed_bits // 8)
        w.add(f"token_embd.q{spec.embed_bits}scales", vocab * (hidden // BLOCK) * 4)
    if embd_type == "Q8_0":
        w.add("token_embd.q8weight", vocab * hidden)
        w.add("token_embd.scales_3d", vocab * (hidden // BLOCK) * 4)
    else:
        w.add("token_embd.weight", vocab * hidden * 4)
    w.add("blk.0.attn_norm.weight", hidden * 4)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        _linear(w, model, p + "attn_qkv", [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                spec.matmul_bits)  # fmt: skip
        _linear(w, model, p + "attn_output", [p + "attn_output.weight"], spec.matmul_bits)
        w.add(p + "ffn_norm.weight", hidden * 4)
        _linear(w, model, p + "ffn_gate_up", [p + "ffn_gate.weight", p + "ffn_up.weight"], spec.matmul_bits)
        _linear(w, model, p + "ffn_down", [p + "ffn_down.weight"], spec.matmul_bits)
        w.add(f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.n_layers else "output_norm.weight", hidden * 4)
    head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    head_type, head_rows, head_cols = _tensor(model, head_name)
    if cfg.tied_embeddings and embd_packed_bits is not None:
        return
    if spec.matmul_bits == 4 and head_type in ("Q4_0", "Q4_1"):
        _linear(w, model, "lm_head", [head_name], 4)
    elif spec.matmul_bits == 4 and spec.accuracy_level < 4 and head_type == "Q8_0":
        nb = head_cols // BLOCK
        w.add(f"{head_name}.nibbles", head_rows * head_cols)
        w.add(f"{head_name}.nibble_scales", head_rows * 2 * nb * 4)
        w.add(f"{head_name}.nibble_zero_points", head_rows * nb)
    elif spec.embed_bits is None:
        w.add(head_name, head_rows * head_cols * 4)
    else:
        _linear(w, model, "lm_head", [head_name], spec.embed_bits)


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


def estimate_output(model: GGUFModel, names: list[str]) -> dict[str, int]:
    """Bytes per file the converter will write for these variants of an opened GGUF."""
    cfg = model.config
    weights = _Weights()
    for name in names:
        _variant(weights, model, cfg, VARIANTS[name])
    out = {
        WEIGHTS_FILE: weights.total(),
        "tokenizer.json": _tokenizer_bytes(model),
        "small files": SMALL_FILES,
    }
    for name in names:
        out[f"{name}.onnx"] = ONNX_FIXED + ONNX_PER_LAYER * cfg.n_layers
    return out
