"""A sentence encoder's source -> simmer's encoder folder: encoder.onnx (+ its weights), tokenizer.json and
encoder.json (the EncoderConfig the runtime reads; models/runtime/embedder.py), and the manifest fragment
that says so; `convert_int8` writes the int8 variant's graph beside them (encoder-int8.onnx + its weights;
models/convert/encoder_int8.py), from a sentence-transformers folder.

Two sources, one folder: a sentence-transformers folder (`convert_encoder`) and a GGUF of llama.cpp's
`bert` (`convert_encoder_gguf`, read by convert/encoder_gguf.py into the folder's names). Both end in
`write_encoder`, so the graph, the tokenizer's form and the config are the same code whatever the source.

The tokenizer is saved without the truncation and padding the upstream file carries (128 tokens, fixed):
simmer refuses an input over the context instead of silently cutting it, and pads a batch itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from models.convert import encoder_quality
from models.convert.encoder_config import (
    ENCODER_CONFIG,
    F32,
    GRAPHS,
    INT8,
    TOKENIZER,
    WEIGHTS,
    EncoderConfig,
    read_encoder_config,
)
from models.convert.encoder_gguf import encoder_plan, read_encoder_gguf
from models.convert.encoder_graph import build_encoder, build_traced, save_encoder
from models.convert.encoder_int8 import INT8_ACTIVATIONS, outlier_channels
from models.convert.safetensors_file import read_safetensors
from models.errors import InvalidModelFile, InvalidParameter, SimmerError, VerificationFailed
from models.types import KIND_EMBEDDING


def check_variants(variants: list[str] | None, allowed: tuple[str, ...] = (F32,)) -> None:
    """The variants a pull asks for, within what this source can build (int8 is calibrated on a
    sentence-transformers folder's weights: a GGUF gives f32 alone)."""
    if variants and not set(variants) <= set(allowed):
        raise InvalidParameter(
            f"this sentence encoder's variants are {', '.join(allowed)}, not {', '.join(variants)}",
            param="variants",
        )


def write_encoder(
    cfg: EncoderConfig, weights: dict[str, np.ndarray], tokenizer: dict[str, Any], out: Path
) -> None:
    out = Path(out)
    tokenizer = {**tokenizer, "truncation": None, "padding": None}
    save_encoder(build_encoder(weights, cfg), out)
    (out / TOKENIZER).write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (out / ENCODER_CONFIG).write_text(json.dumps(cfg.to_json(), indent=1), encoding="utf-8")


def convert_encoder(source: Path, out: Path) -> EncoderConfig:
    """A sentence-transformers folder (config.json, modules.json, the pooling's, model.safetensors)."""
    source = Path(source)
    cfg = read_encoder_config(source)
    try:
        tokenizer = json.loads((source / TOKENIZER).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidModelFile(f"cannot read {TOKENIZER}: {err}") from err
    write_encoder(cfg, read_safetensors(source / WEIGHTS), tokenizer, out)
    return cfg


def convert_encoder_gguf(source: Path, out: Path) -> EncoderConfig:
    """A GGUF of llama.cpp's `bert` architecture."""
    model = read_encoder_gguf(Path(source))
    write_encoder(model.config, model.weights, model.tokenizer, out)
    return model.config


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


def encoder_fragment(
    cfg: EncoderConfig,
    out: Path,
    entries: dict[str, dict[str, Any]] | None = None,
    refused: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The manifest fragment of a converted encoder in `out`: each variant's files and what was measured of
    it (`entries`; by default f32 alone, exact), those refused and why, and the floor int8 was held to when
    it was built or tried."""
    entries = entries if entries is not None else {F32: {"quality": {"exact": True}}}
    refused = refused or {}
    variants: dict[str, dict[str, Any]] = {}
    for name in GRAPHS:
        if name in entries:
            files = [GRAPHS[name], f"{GRAPHS[name]}.data"]
            weights = sum((Path(out) / rel).stat().st_size for rel in files)
            variants[name] = {"file": files[0], "files": files, "weights_bytes": weights, **entries[name]}
    measured = INT8 in entries or INT8 in refused
    return {
        "kind": KIND_EMBEDDING,
        "architecture": {"name": "bert", **cfg.to_json()},
        "context_length": cfg.context,
        "variants": variants,
        "default_variant": encoder_quality.NOMINAL,
        "default_variant_reason": encoder_quality.NOMINAL_REASON,
        "quality_floor": {"source": F32, "min_cosine": encoder_quality.FLOOR} if measured else None,
        "refused_variants": refused,
        "tokenizer": TOKENIZER,
        "chat_template": None,
    }


def convert_gguf_install(
    source: Path,
    out: Path,
    *,
    variants: list[str] | None = None,
    progress: Callable[[str, float], None] | None = None,
    disk_plan: Callable[[dict[str, int]], None] | None = None,
    memory_plan: Callable[[dict[str, int]], None] | None = None,
) -> dict[str, Any]:
    """What the store's converter does with a sentence encoder's GGUF: plan, convert, describe it."""
    check_variants(variants)
    disk, memory = encoder_plan(Path(source))
    if disk_plan is not None:
        disk_plan(disk)
    if memory_plan is not None:
        memory_plan(memory)
    if progress:
        progress("convert", 0.0)
    cfg = convert_encoder_gguf(source, out)
    if progress:
        progress("convert", 1.0)
    return encoder_fragment(cfg, out)


def encoder_smoke_test(model_dir: Path, manifest: dict[str, Any]) -> None:
    """A new install must load, embed a sentence, and give a finite (unit, when normalised) vector, with
    each of its variants."""
    for variant in manifest.get("variants") or {}:
        _smoke_one(Path(model_dir), variant)


def _smoke_one(model_dir: Path, variant: str) -> None:
    from models.runtime.embedder import Embedder

    try:
        emb = Embedder(model_dir, variant=variant)
        vec = emb.embed(emb.tokenize(["hello world"]))
    except SimmerError as err:
        raise VerificationFailed(err.message) from err
    except Exception as err:  # onnxruntime's own error types
        raise VerificationFailed(f"the encoder failed to run: {err}") from err
    if vec.shape != (1, emb.dimensions) or not np.isfinite(vec).all():
        raise VerificationFailed(f"the encoder gave a {vec.shape} output with non-finite values")
    if emb.config.normalize and abs(float(np.linalg.norm(vec)) - 1.0) > 1e-3:
        raise VerificationFailed(f"the encoder's output has norm {float(np.linalg.norm(vec))}, not 1")
