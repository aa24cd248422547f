"""Ollama's /api/embed and its legacy /api/embeddings: the body (requests.py's EmbedRequest) into the
worker's inputs, once, and the answers, built from the reply models below. Kept apart from render.py and
replies.py: nothing of the generating routes is shared.

An empty input answers no vectors without any work, as Ollama does (its clients send one to load a model).
/api/embed's `truncate` (default true, as in Ollama) cuts an input over the context to fit, keeping its
first tokens and its closing [SEP]; `truncate: false` refuses it with context_length_exceeded. The legacy
/api/embeddings has no `truncate`: such a prompt is refused.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from pydantic import NonNegativeInt

from server.api.common.reply import Reply, absent
from server.serving.embedding import Embedded


class OllamaEmbed(Reply):
    model: str
    embeddings: list[list[float]]
    total_duration: NonNegativeInt = absent("nanoseconds from the request's arrival to its answer")
    prompt_eval_count: NonNegativeInt = absent("tokens in every input")


class OllamaEmbedding(Reply):
    """The legacy /api/embeddings: one prompt, one vector."""

    embedding: list[float]


def inputs_of(value: str | list[str] | None) -> list[str]:
    """/api/embed's input as strings; empty ones (nothing to embed) dropped only when all are empty."""
    if value is None or value == "":
        return []
    return [value] if isinstance(value, str) else list(value)


def _floats(rows: np.ndarray) -> list[list[float]]:
    return [[float(x) for x in row] for row in rows]


def embed_body(model: str, got: Embedded | None, total_ns: int) -> bytes:
    body: dict[str, Any] = {"model": model, "embeddings": _floats(got.vectors) if got else []}
    if got is not None:
        body |= {"total_duration": total_ns, "prompt_eval_count": got.prompt_tokens}
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def embedding_body(got: Embedded | None) -> bytes:
    return json.dumps({"embedding": _floats(got.vectors)[0] if got else []}, separators=(",", ":")).encode()
