"""Llama: SmolLM2, TinyLlama, Llama 3.x. The baseline every other family is written against.

llama.cpp's converter permuted the Q/K rows of this family only, so RoPE rotates interleaved pairs of the
stored rows. Llama 3.1+ files carry their RoPE scaling as per-frequency divisors (`rope_freqs.weight`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from models.convert.families.base import Family, Metadata, ModelConfig


def configure(cfg: ModelConfig, meta: Metadata, tensors: Collection[str]) -> ModelConfig:
    return replace(cfg, rope_freqs="rope_freqs.weight" in tensors)


LLAMA = Family(
    "llama",
    genai_type="llama",
    rope_interleaved=True,
    configure=configure,
    examples=("SmolLM2", "TinyLlama", "Llama 3.x"),
)
