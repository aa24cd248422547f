"""Gemma 3 (text): QK RMS-norm, a norm before and after both the attention and the FFN, GELU(tanh) gate,
embeddings scaled by sqrt(hidden), and sliding-window attention on five layers of every six, whose RoPE has
its own base (10,000; global layers use the file's, 1e6).

The file's norm weights already include Gemma's `1 + w` (llama.cpp's converter adds the one), so they are
plain RMS-norm weights here. llama.cpp reads neither the window pattern nor the local base from Gemma 3
files: both are constants of the architecture, as here.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace

from models.convert.families.base import Family, Metadata, ModelConfig
from models.errors import InvalidModelFile

SLIDING_PATTERN = 6  # layers 5, 11, 17, ... are global (llama.cpp: set_swa_pattern(6))
LOCAL_ROPE_BASE = 10_000.0


def configure(cfg: ModelConfig, meta: Metadata, tensors: Collection[str]) -> ModelConfig:
    window = meta.get(f"{cfg.architecture}.attention.sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise InvalidModelFile(f"gemma3: missing or bad {cfg.architecture}.attention.sliding_window")
    sliding = tuple(i for i in range(cfg.n_layers) if i % SLIDING_PATTERN < SLIDING_PATTERN - 1)
    # gemma_pytorch's query_pre_attn_scalar: hidden / heads for the 27B (62 layers), head_dim otherwise
    per_head = cfg.hidden // cfg.n_heads if cfg.n_layers == 62 else cfg.head_dim
    return replace(
        cfg,
        sliding_window=window,
        sliding_layers=sliding,
        rope_base_local=LOCAL_ROPE_BASE,
        attention_scale=1.0 / math.sqrt(per_head),
        embed_scale=math.sqrt(cfg.hidden),
    )


GEMMA3 = Family(
    "gemma3",
    genai_type="gemma3_text",  # onnxruntime-genai 0.18: "gemma3" is the multimodal package, not a decoder
    rope_interleaved=False,
    qk_norm=True,
    sandwich_norms=True,
    activation="gelu_tanh",
    configure=configure,
    examples=("Gemma 3 270M", "Gemma 3 1B"),
)
