"""Qwen 3 (dense): Llama's block with an RMS-norm over each head of Q and K before RoPE, NEOX RoPE, and
head_dim from `attention.key_length` (128 for every size, whatever hidden / heads is)."""

from __future__ import annotations

from models.convert.families.base import Family

QWEN3 = Family(
    "qwen3",
    genai_type="qwen3",
    rope_interleaved=False,
    qk_norm=True,
    examples=("Qwen3 0.6B-8B",),
)
