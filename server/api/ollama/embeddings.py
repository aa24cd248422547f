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

from pydantic import NonNegativeInt

from server.api.common.embeddings import rows_json
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


def embed_body(model: str, got: Embedded | None, total_ns: int) -> bytes:
    """The JSON reply, a vector at a time (rows_json)."""
    rows = ",".join(rows_json(got.vectors)) if got is not None else ""
    counts = (
        f',"total_duration":{total_ns},"prompt_eval_count":{got.prompt_tokens}' if got is not None else ""
    )
    return f'{{"model":{json.dumps(model)},"embeddings":[{rows}]{counts}}}'.encode()


def embedding_body(got: Embedded | None) -> bytes:
    return f'{{"embedding":{rows_json(got.vectors[:1])[0] if got else "[]"}}}'.encode()
