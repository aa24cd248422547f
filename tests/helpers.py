"""Helpers several test files share: an OpenAI client on a live server, the tiny engine, a GGUF's shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai

from models.convert.model import GGUFModel
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.session import ModelShape


def sdk(srv: Any, **kwargs: Any) -> openai.OpenAI:
    """OpenAI's own client on a live test server (no retries: a refusal must show, not be retried)."""
    options: dict[str, Any] = {"api_key": "unused", "max_retries": 0, "timeout": 60, **kwargs}
    return openai.OpenAI(base_url=srv.url + "/v1", **options)


def tiny_engine(model_dir: Path, **overrides: Any) -> DecoderEngine:
    """The tiny real model, exact variant, one thread: small enough that a test loads its own."""
    options: dict[str, Any] = {"variant": "q4", "threads": 1, "context_length": 256, "prefill_chunk": 256}
    return load_engine(model_dir, **{**options, **overrides})


def shape_of(gguf: Path | GGUFModel) -> ModelShape:
    """The KV shape of a GGUF (a path, or one already read)."""
    model = gguf if isinstance(gguf, GGUFModel) else GGUFModel(gguf)
    return ModelShape.from_architecture(model.config.to_dict())
