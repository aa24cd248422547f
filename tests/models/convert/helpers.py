"""Converter tests' helpers: a GGUF whose logits stay small (so quantization error is comparable across
formats), and the logits of a converted graph at every position."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader

from models.runtime.session import DecoderSession, KVCache, ModelShape

LOGIT_SCALE = 0.125


def small_logits(path: Path) -> Path:
    """Scale the final norm's gain down: logits of a few units. At |logit| ~ 40 (hidden 256) fp32 alone
    leaves 1-2e-4 between two correct forward passes (the numpy reference in fp32 against float64), which
    would drown the 1e-4 tolerance; a wrong mapping errs by far more than either."""
    r = GGUFReader(path, "r+")
    (t,) = [t for t in r.tensors if t.name == "output_norm.weight"]
    t.data[:] *= np.float32(LOGIT_SCALE)
    r.data.flush()
    del r
    return path


def logits_per_position(onnx_file: Path, shape: ModelShape, ids: list[int]) -> np.ndarray:
    """Token by token (the KV path), then the same ids in one prefill: both must match the reference."""
    sess = DecoderSession(onnx_file, shape, 1)
    kv = KVCache(shape, 64)
    steps = np.stack([sess.run(np.array([t]), kv, pos).copy() for pos, t in enumerate(ids)])
    full = sess.run(np.array(ids), KVCache(shape, 64), 0).copy()
    return np.concatenate([steps, full[None]])
