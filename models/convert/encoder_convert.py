"""A sentence-transformers folder -> simmer's encoder folder: encoder.onnx (+ its weights), tokenizer.json
and encoder.json (the EncoderConfig the runtime reads; models/runtime/embedder.py).

The tokenizer is saved without the truncation and padding the upstream file carries (128 tokens, fixed):
simmer refuses an input over the context instead of silently cutting it, and pads a batch itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from models.convert.encoder_config import (
    ENCODER_CONFIG,
    TOKENIZER,
    WEIGHTS,
    EncoderConfig,
    read_encoder_config,
)
from models.convert.encoder_graph import build_encoder, save_encoder
from models.convert.safetensors_file import read_safetensors
from models.errors import InvalidModelFile


def convert_encoder(source: Path, out: Path) -> EncoderConfig:
    source, out = Path(source), Path(out)
    cfg = read_encoder_config(source)
    try:
        tokenizer = json.loads((source / TOKENIZER).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidModelFile(f"cannot read {TOKENIZER}: {err}") from err
    tokenizer["truncation"] = None
    tokenizer["padding"] = None
    weights = read_safetensors(source / WEIGHTS)
    save_encoder(build_encoder(weights, cfg), out)
    (out / TOKENIZER).write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (out / ENCODER_CONFIG).write_text(json.dumps(cfg.to_json(), indent=1), encoding="utf-8")
    return cfg
