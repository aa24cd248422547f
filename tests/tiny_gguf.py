"""Write tiny synthetic GGUFs with the `gguf` package: random weights, GQA, chosen tensor types, a small
byte-level BPE vocabulary and a ChatML template, in the layout of each architecture family (`family`):
llama, llama3 (+ rope_freqs), qwen2 (QKV bias), qwen3 (QK-norm, head_dim from key_length), gemma3 (QK-norm,
sandwich norms, head_dim 32 != hidden / heads, a sliding window of 8 on layers 0-4 and a global layer 5).
For `llama` Q and K are permuted exactly as llama.cpp's converter does (and for no other family), so a wrong
RoPE pairing in the converter shows up as wrong logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from tests.ggml_quantize import K_QUANTIZERS, quantize

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "a t", "e n"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def tiny_vocab() -> list[str]:
    table = byte_unicode()
    tokens = CONTROL + [table[b] for b in range(256)] + ["".join(m.split()) for m in MERGES]
    while len(tokens) % 32:
        tokens.append(f"<|reserved_{len(tokens)}|>")
    return tokens


@dataclass(frozen=True)
class TinySpec:
    n_layers: int = 2
    hidden: int = 64
    ffn: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 256
    tied: bool = True
    head_dim: int | None = None  # None: hidden // n_heads (and no key_length key)
    sliding_window: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.n_heads


FAMILY_SPECS = {
    "llama": TinySpec(),
    "llama3": TinySpec(rope_base=500000.0),
    "qwen2": TinySpec(rope_base=1e6, tied=False),
    "qwen3": TinySpec(rope_base=1e6, head_dim=32, rms_eps=1e-6),
    "gemma3": TinySpec(
        n_layers=6, n_kv_heads=1, head_dim=32, rope_base=1e6, rms_eps=1e-6, sliding_window=8, ffn=96
    ),
}
ARCHITECTURE = {"llama3": "llama"}  # GGUF general.architecture per tiny family (default: the same name)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF half-split -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(spec: TinySpec, vocab: int, seed: int, family: str = "llama") -> dict[str, np.ndarray]:
    """Random weights in Hugging Face layout (out, in), with the family's extra tensors."""
    rng = np.random.default_rng(seed)
    hd = spec.hd

    def mat(rows: int, cols: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": mat(vocab, spec.hidden, 0.5), "output_norm.weight": norm(spec.hidden)}
    if not spec.tied:
        w["output.weight"] = mat(vocab, spec.hidden, 0.2)
    if family == "llama3":
        # Llama 3's shape of factors: 1 for the fast frequencies, growing to 8 for the slow ones
        w["rope_freqs.weight"] = (1.0 + 7.0 * np.linspace(0.0, 1.0, hd // 2) ** 2).astype(np.float32)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = norm(spec.hidden)
        w[p + "ffn_norm.weight"] = norm(spec.hidden)
        w[p + "attn_q.weight"] = mat(spec.n_heads * hd, spec.hidden, 0.3)
        w[p + "attn_k.weight"] = mat(spec.n_kv_heads * hd, spec.hidden, 0.3)
        w[p + "attn_v.weight"] = mat(spec.n_kv_heads * hd, spec.hidden)
        w[p + "attn_output.weight"] = mat(spec.hidden, spec.n_heads * hd)
        w[p + "ffn_gate.weight"] = mat(spec.ffn, spec.hidden)
        w[p + "ffn_up.weight"] = mat(spec.ffn, spec.hidden)
        w[p + "ffn_down.weight"] = mat(spec.hidden, spec.ffn)
        if family == "qwen2":
            for n, rows in (
                ("q", spec.n_heads * hd),
                ("k", spec.n_kv_heads * hd),
                ("v", spec.n_kv_heads * hd),
            ):
                w[p + f"attn_{n}.bias"] = (0.5 * rng.standard_normal(rows)).astype(np.float32)
        if family in ("qwen3", "gemma3"):
            w[p + "attn_q_norm.weight"] = norm(hd)
            w[p + "attn_k_norm.weight"] = norm(hd)
        if family == "gemma3":
            w[p + "post_attention_norm.weight"] = norm(spec.hidden)
            w[p + "post_ffw_norm.weight"] = norm(spec.hidden)
    return w


# every type the converter maps (the K-quants need input sizes that are multiples of 256), plus IQ4_NL, which
# it must refuse (written as well-formed blocks of random codes: gguf-py cannot quantize it)
TYPES = {
    name: GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_QUANTIZERS, "IQ4_NL")
}


QUANTIZE_ROWS = 8192


def tensor_bytes(w: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    if type_name == "IQ4_NL":  # 32 values per block: f16 scale + 16 bytes of 4-bit codes
        blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 32, 18), dtype=np.uint8)
        blocks[..., :2] = np.full((*blocks.shape[:2], 1), 0.01, np.float16).view(np.uint8)
        return blocks.reshape(w.shape[0], -1)
    if len(w) <= QUANTIZE_ROWS:
        return quantize(w, type_name)
    # by rows (every format's blocks lie within a row): a vocabulary-sized matrix
    # (studies/experiments/head_memory.py) would otherwise hold the K-quant search's temporaries for all of it
    # at once
    step = QUANTIZE_ROWS
    return np.concatenate([quantize(w[i : i + step], type_name) for i in range(0, len(w), step)])


def write_tiny_gguf(
    path: Path,
    *,
    matrix_type: str = "F32",
    embed_type: str | None = None,
    spec: TinySpec | None = None,
    seed: int = 0,
    family: str = "llama",
    architecture: str | None = None,
    tensor_types: dict[str, str] | None = None,
    vocabulary: dict | None = None,
    chat_template: str | None = CHATML,
    name: str | None = None,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> Path:
    """Matrices stored as `matrix_type`, the embedding as `embed_type` (default: same), norms F32.
    `family` picks the tensor layout (FAMILY_SPECS); `architecture` overrides general.architecture.
    `tensor_types` overrides single tensors by name suffix, e.g. {"attn_v.weight": "Q6_K"} or
    {"blk.1.ffn_down.weight": "Q4_K"} (the mixes of llama.cpp's Q4_K_M).
    `vocabulary`: GGUF tokenizer keys (tests/tiny_vocab.py family_metadata, e.g. a SentencePiece one) instead
    of the small byte-level BPE; `chat_template` None writes none (a base model). `edit` may change the
    float weights (Hugging Face layout, by GGUF tensor name) before they are quantized."""
    spec = spec or FAMILY_SPECS[family]
    tokens = vocabulary["tokenizer.ggml.tokens"] if vocabulary else tiny_vocab()
    hf = hf_weights(spec, len(tokens), seed, family)
    if edit is not None:
        edit(hf)
    rng = np.random.default_rng(seed + 1)
    wr = GGUFWriter(str(path), architecture or ARCHITECTURE.get(family, family))
    wr.add_name(name or ("tiny-llama" if family == "llama" else f"tiny-{family}"))
    wr.add_block_count(spec.n_layers)
    wr.add_context_length(spec.context_length)
    wr.add_embedding_length(spec.hidden)
    wr.add_feed_forward_length(spec.ffn)
    wr.add_head_count(spec.n_heads)
    wr.add_head_count_kv(spec.n_kv_heads)
    wr.add_rope_freq_base(spec.rope_base)
    wr.add_layer_norm_rms_eps(spec.rms_eps)
    wr.add_rope_dimension_count(spec.hd)
    if spec.head_dim is not None:
        wr.add_key_length(spec.head_dim)
        wr.add_value_length(spec.head_dim)
    if spec.sliding_window:
        wr.add_sliding_window(spec.sliding_window)
    wr.add_vocab_size(len(tokens))
    if vocabulary:
        _add_vocabulary(wr, vocabulary)
    else:
        wr.add_tokenizer_model("gpt2")
        wr.add_tokenizer_pre("smollm")
        wr.add_token_list(tokens)
        wr.add_token_types([3 if t in CONTROL or t.startswith("<|reserved") else 1 for t in tokens])
        wr.add_token_merges(MERGES)
        wr.add_bos_token_id(1)
        wr.add_eos_token_id(2)
        wr.add_unk_token_id(0)
        wr.add_pad_token_id(2)
        wr.add_add_bos_token(False)
    if chat_template:
        wr.add_chat_template(chat_template)
    for name, w in hf.items():
        if family in ("llama", "llama3") and name.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, spec.n_heads)
        elif family in ("llama", "llama3") and name.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, spec.n_kv_heads)
        if w.ndim == 1:
            wr.add_tensor(name, w)
            continue
        tname = (embed_type or matrix_type) if name in ("token_embd.weight", "output.weight") else matrix_type
        for suffix, t in (tensor_types or {}).items():
            if name.endswith(suffix):
                tname = t
        data = tensor_bytes(w, tname, rng)
        wr.add_tensor(name, data, raw_dtype=None if tname in ("F32", "F16") else TYPES[tname])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def _add_vocabulary(wr: GGUFWriter, meta: dict) -> None:
    """GGUF tokenizer keys as tests/tiny_vocab.py's family_metadata gives them."""
    wr.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        wr.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    wr.add_token_list(meta["tokenizer.ggml.tokens"])
    wr.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in meta:
        wr.add_token_merges(meta["tokenizer.ggml.merges"])
    if "tokenizer.ggml.scores" in meta:
        wr.add_token_scores([float(s) for s in meta["tokenizer.ggml.scores"]])
    setters = {
        "tokenizer.ggml.bos_token_id": wr.add_bos_token_id,
        "tokenizer.ggml.eos_token_id": wr.add_eos_token_id,
        "tokenizer.ggml.unknown_token_id": wr.add_unk_token_id,
        "tokenizer.ggml.add_bos_token": wr.add_add_bos_token,
        "tokenizer.ggml.add_space_prefix": wr.add_add_space_prefix,
    }
    for key, setter in setters.items():
        if key in meta:
            setter(meta[key])
