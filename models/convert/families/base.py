"""What every decoder family shares, as data: the hyper-parameters read from a GGUF's `{arch}.*` keys, the
tensors every block has, and the flags a family sets where it differs from Llama.

The graph builder (convert/block.py) and the numpy reference (convert/reference.py) read these flags and
nothing else, so a family is a dataclass value plus, where a flag will not do, a `configure` hook that reads
its own metadata keys (Gemma 3's window pattern, Llama 3's RoPE frequency factors). A family reads its
hyper-parameters from a GGUF's raw metadata and tensor shapes (`Family.read_config`); nothing here imports
the reader or the graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from models.errors import InvalidModelFile, UnsupportedModel

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """One GGUF's hyper-parameters, resolved (every value a layer needs is here, none is implied)."""

    architecture: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # `attention.key_length` when the file has it (Gemma 3: 256 with hidden 640)
    rope_base: float
    rms_eps: float
    context_length: int
    vocab: int
    tied_embeddings: bool
    rope_scale: float = 1.0  # linear RoPE scaling: angles use position * rope_scale (1 / factor)
    attention_scale: float = 0.0  # softmax(q.k * scale); 0 = 1 / sqrt(head_dim)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden))
    # keys a sliding-window layer attends to, itself included (llama.cpp's n_swa: position p sees
    # p - window + 1 .. p); 0 = every layer is global
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    rope_base_local: float = 0.0  # sliding layers' RoPE base (Gemma 3: 10,000); 0 = rope_base
    rope_freqs: bool = False  # Llama 3: rope_freqs.weight divides each RoPE frequency

    def __post_init__(self) -> None:
        if self.attention_scale == 0.0:
            object.__setattr__(self, "attention_scale", 1.0 / math.sqrt(self.head_dim))

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window > 0 and layer in self.sliding_layers

    def layer_rope(self, layer: int) -> RopeKind:
        """Sliding layers of Gemma 3 use their own base, unscaled and without frequency factors."""
        if self.is_sliding(layer) and self.rope_base_local:
            return RopeKind("local", self.rope_base_local, 1.0, False)
        return RopeKind("global", self.rope_base, self.rope_scale, self.rope_freqs)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sliding_layers"] = list(self.sliding_layers)
        return d


@dataclass(frozen=True)
class RopeKind:
    """One RoPE table: the layers that share (base, scale, factors) share one cos/sin cache."""

    name: str
    base: float
    scale: float
    uses_freq_factors: bool

    def inv_freq(self, head_dim: int, factors: np.ndarray | None = None) -> np.ndarray:
        """float64 (head_dim / 2,) angular speeds, scale and (Llama 3) per-frequency divisors applied."""
        inv = 1.0 / (self.base ** (np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim))
        inv = inv * self.scale
        if self.uses_freq_factors:
            if factors is None:
                raise ValueError("this RoPE kind needs the rope_freqs factors")
            inv = inv / np.asarray(factors, np.float64).reshape(-1)
        return inv


Metadata = Mapping[str, Any]
Shapes = Mapping[str, tuple[int, int]]  # tensor name -> (rows, cols); (1, n) for 1-D
Configure = Callable[[ModelConfig, Metadata, Collection[str]], ModelConfig]


def unchanged(cfg: ModelConfig, meta: Metadata, tensors: Collection[str]) -> ModelConfig:
    return cfg


class _Keys:
    """Typed reads of one file's `{arch}.*` keys, with errors that name the file."""

    def __init__(self, meta: Metadata, source: str) -> None:
        self.meta, self.source = meta, source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.meta.get(key, default)
        if value is None:
            raise InvalidModelFile(f"{self.source}: missing metadata key {key}")
        return value

    def int(self, key: str, default: Any = None) -> int:
        value = self.get(key, default)
        if isinstance(value, list) or not isinstance(value, (int, float)):
            # per-layer arrays (OpenELM-style head counts) have no family here
            raise UnsupportedModel(f"{self.source}: {key} = {value!r} is not supported (one value expected)")
        return int(value)


def generic_config(architecture: str, meta: Metadata, shapes: Shapes, source: str) -> ModelConfig:
    """The generic `{arch}.*` keys, as llama.cpp's hparams loader reads them."""
    a, k = architecture, _Keys(meta, source)
    hidden = k.int(f"{a}.embedding_length")
    n_heads = k.int(f"{a}.attention.head_count")
    head_dim = k.int(f"{a}.attention.key_length", hidden // n_heads)
    value_dim = k.int(f"{a}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise UnsupportedModel(
            f"{source}: key length {head_dim} != value length {value_dim} is not supported"
        )
    rope_dim = k.int(f"{a}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModel(f"{source}: partial RoPE ({rope_dim} of {head_dim}) is not supported")
    scaling = meta.get(f"{a}.rope.scaling.type")
    rope_scale = 1.0
    if scaling == "linear":
        rope_scale = 1.0 / float(k.get(f"{a}.rope.scaling.factor"))
    elif scaling not in (None, "none"):
        raise UnsupportedModel(f"{source}: RoPE scaling {scaling!r} is not supported (linear is)")
    embd = shapes.get("token_embd.weight")
    if embd is None:
        raise InvalidModelFile(f"{source}: missing tensor token_embd.weight")
    cfg = ModelConfig(
        architecture=a,
        n_layers=k.int(f"{a}.block_count"),
        hidden=hidden,
        ffn=k.int(f"{a}.feed_forward_length"),
        n_heads=n_heads,
        n_kv_heads=k.int(f"{a}.attention.head_count_kv", n_heads),
        head_dim=head_dim,
        rope_base=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        rms_eps=float(k.get(f"{a}.attention.layer_norm_rms_epsilon")),
        context_length=k.int(f"{a}.context_length"),
        vocab=k.int(f"{a}.vocab_size", embd[0]),
        tied_embeddings="output.weight" not in shapes,
        rope_scale=rope_scale,
    )
    if cfg.n_kv_heads <= 0 or cfg.n_heads % cfg.n_kv_heads:
        raise InvalidModelFile(f"{source}: {cfg.n_heads} heads cannot share {cfg.n_kv_heads} KV heads")
    return cfg


@dataclass(frozen=True)
class Family:
    """A decoder-only transformer family, stated as its differences from Llama's block:

    x = embed(ids) * embed_scale
    per layer:  h = attn_norm(x); q, k, v = h @ Wq, Wk, Wv (+ bias); q, k = qk_norm(q, k)
                a = attention(rope(q), rope(k), v) @ Wo; x = x + post_attention_norm(a)
                h = ffn_norm(x); f = (act(h @ Wgate) * (h @ Wup)) @ Wdown; x = x + post_ffw_norm(f)
    logits = output_norm(x) @ head
    """

    name: str  # general.architecture
    genai_type: str  # onnxruntime-genai's model type for genai_config.json
    # llama.cpp's converter permutes Q/K rows for `llama` only, so its RoPE rotates interleaved pairs
    # (2i, 2i+1) on the stored rows; every other family is NEOX style (i, i + head_dim/2)
    rope_interleaved: bool
    qkv_bias: bool = False
    qk_norm: bool = False  # RMS-norm over each head of Q and K (weights of head_dim), before RoPE
    sandwich_norms: bool = False  # post_attention_norm and post_ffw_norm on each branch output
    activation: str = "silu"
    configure: Configure = unchanged
    examples: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}")

    def read_config(self, meta: Metadata, shapes: Shapes, source: str = "the model") -> ModelConfig:
        """This family's hyper-parameters from a GGUF's raw metadata and tensor shapes: the generic keys,
        then what the family's `configure` reads of its own."""
        return self.configure(generic_config(self.name, meta, shapes, source), meta, shapes.keys())

    def tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """Every tensor a file of this family must have, as (rows, cols) in the torch-Linear sense; 1-D
        tensors are (1, n)."""
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        out = {"token_embd.weight": (cfg.vocab, cfg.hidden), "output_norm.weight": (1, cfg.hidden)}
        if not cfg.tied_embeddings:
            out["output.weight"] = (cfg.vocab, cfg.hidden)
        if cfg.rope_freqs:
            out["rope_freqs.weight"] = (1, cfg.head_dim // 2)
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            out |= {
                p + "attn_norm.weight": (1, cfg.hidden),
                p + "attn_q.weight": (q_dim, cfg.hidden),
                p + "attn_k.weight": (kv_dim, cfg.hidden),
                p + "attn_v.weight": (kv_dim, cfg.hidden),
                p + "attn_output.weight": (cfg.hidden, q_dim),
                p + "ffn_norm.weight": (1, cfg.hidden),
                p + "ffn_gate.weight": (cfg.ffn, cfg.hidden),
                p + "ffn_up.weight": (cfg.ffn, cfg.hidden),
                p + "ffn_down.weight": (cfg.hidden, cfg.ffn),
            }
            if self.qkv_bias:
                out |= {
                    p + "attn_q.bias": (1, q_dim),
                    p + "attn_k.bias": (1, kv_dim),
                    p + "attn_v.bias": (1, kv_dim),
                }
            if self.qk_norm:
                out |= {
                    p + "attn_q_norm.weight": (1, cfg.head_dim),
                    p + "attn_k_norm.weight": (1, cfg.head_dim),
                }
            if self.sandwich_norms:
                out |= {
                    p + "post_attention_norm.weight": (1, cfg.hidden),
                    p + "post_ffw_norm.weight": (1, cfg.hidden),
                }
        return out
