"""A sentence-transformers folder -> simmer's encoder folder: encoder.onnx (+ its weights), tokenizer.json
and encoder.json (the EncoderConfig the runtime reads; models/runtime/embedder.py); `convert_int8` writes
the int8 variant's graph beside them (encoder-int8.onnx + its weights; models/convert/encoder_int8.py).

The tokenizer is saved without the truncation and padding the upstream file carries (128 tokens, fixed):
simmer refuses an input over the context instead of silently cutting it, and pads a batch itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from models.convert.encoder_config import (
    ENCODER_CONFIG,
    GRAPHS,
    INT8,
    TOKENIZER,
    WEIGHTS,
    EncoderConfig,
    read_encoder_config,
)
from models.convert.encoder_graph import build_encoder, build_traced, save_encoder
from models.convert.encoder_int8 import INT8_ACTIVATIONS, outlier_channels
from models.convert.safetensors_file import read_safetensors
from models.errors import InvalidModelFile


def convert_encoder(source: Path, out: Path) -> EncoderConfig:
    """The exact (f32) variant, the tokenizer and the config."""
    source, out = Path(source), Path(out)
    cfg = read_encoder_config(source)
    try:
        tokenizer = json.loads((source / TOKENIZER).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidModelFile(f"cannot read {TOKENIZER}: {err}") from err
    tokenizer["truncation"] = None
    tokenizer["padding"] = None
    save_encoder(build_encoder(read_safetensors(source / WEIGHTS), cfg), out)
    (out / TOKENIZER).write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (out / ENCODER_CONFIG).write_text(json.dumps(cfg.to_json(), indent=1), encoding="utf-8")
    return cfg


def convert_int8(source: Path, out: Path, accuracy_level: int = INT8_ACTIVATIONS) -> list[str]:
    """The int8 variant's graph (its MatMulNBits at `accuracy_level`) into `out`; returns the files written.
    Its outlier channels come from the f32 graph, built again here in memory (a second of work for MiniLM)
    rather than read back from `out`: the calibration needs the weights inside the model."""
    source, out = Path(source), Path(out)
    cfg = read_encoder_config(source)
    weights = read_safetensors(source / WEIGHTS)
    model, linear_inputs = build_traced(weights, cfg)
    outliers = outlier_channels(model, linear_inputs, cfg.vocab, cfg.context)
    del model
    return save_encoder(build_encoder(weights, cfg, outliers, accuracy_level), out, GRAPHS[INT8])
