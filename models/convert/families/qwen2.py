"""Qwen 2 / 2.5: Llama's block with biases on the Q, K and V projections, NEOX RoPE."""

from __future__ import annotations

from models.convert.families.base import Family

QWEN2 = Family(
    "qwen2",
    genai_type="qwen2",
    rope_interleaved=False,
    qkv_bias=True,
    examples=("Qwen2.5 0.5B-7B",),
)
