"""The BERT sentence encoder as data: how a GGUF of llama.cpp's `bert` architecture names what a
sentence-transformers checkpoint names, so both sources feed one graph builder (convert/encoder_graph.py,
which reads the checkpoint's names).

This is no decoder `Family` (families/base.py): an encoder has no RoPE, no KV cache and no LM head, and its
converter is convert/encoder_convert.py. The tables are gguf-py's name map for `bert` read backwards
(a test checks them against it), the pooling codes are llama.cpp's `LLAMA_POOLING_TYPE_*`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EncoderFamily:
    architecture: str  # the GGUF's `general.architecture`
    # GGUF tensor stem -> checkpoint stem; `.weight` / `.bias` follow both unchanged
    tensors: dict[str, str]
    # the same for `blk.{i}.<stem>` -> `encoder.layer.{i}.<stem>`
    layer_tensors: dict[str, str]
    layer_prefix: str = "encoder.layer"
    unbiased: frozenset[str] = frozenset()  # stems with a `.weight` alone (the embedding tables)
    # `{arch}.pooling_type` -> the pooling the graph builds (codes with no entry are refused)
    pooling: dict[int, str] = field(default_factory=dict)

    def checkpoint_name(self, gguf_name: str) -> str | None:
        """The checkpoint's name for a GGUF tensor, or None when the family has no place for it."""
        stem, dot, suffix = gguf_name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            return None
        if stem in self.tensors:
            return f"{self.tensors[stem]}.{suffix}"
        blk, _, rest = stem.partition(".")
        layer, _, part = rest.partition(".")
        if blk == "blk" and layer.isdigit() and part in self.layer_tensors:
            return f"{self.layer_prefix}.{int(layer)}.{self.layer_tensors[part]}.{suffix}"
        return None

    def gguf_names(self, layers: int) -> list[str]:
        """Every tensor a GGUF of `layers` layers holds."""
        stems = [*self.tensors, *(f"blk.{i}.{part}" for i in range(layers) for part in self.layer_tensors)]
        return [
            f"{s}.{x}" for s in stems for x in ("weight", "bias") if x == "weight" or s not in self.unbiased
        ]


BERT = EncoderFamily(
    architecture="bert",
    tensors={
        "token_embd": "embeddings.word_embeddings",
        "position_embd": "embeddings.position_embeddings",
        "token_types": "embeddings.token_type_embeddings",
        "token_embd_norm": "embeddings.LayerNorm",
    },
    layer_tensors={
        "attn_q": "attention.self.query",
        "attn_k": "attention.self.key",
        "attn_v": "attention.self.value",
        "attn_output": "attention.output.dense",
        "attn_output_norm": "attention.output.LayerNorm",
        "ffn_up": "intermediate.dense",
        "ffn_down": "output.dense",
        "layer_output_norm": "output.LayerNorm",
    },
    unbiased=frozenset({"token_embd", "position_embd", "token_types"}),
    pooling={1: "mean"},  # 2 (CLS) is llama.cpp's too, but the graph pools by the mean alone
)

ENCODER_FAMILIES: dict[str, EncoderFamily] = {f.architecture: f for f in (BERT,)}
