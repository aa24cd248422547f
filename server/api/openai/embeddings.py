"""OpenAI's /v1/embeddings: its body (validated here), its translation into the worker's inputs (once), and
its answer (built from the reply models below). Kept apart from requests.py, render.py and replies.py:
nothing of the generating routes is shared."""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BeforeValidator, Field, NonNegativeInt, WithJsonSchema

from server.api.common.embeddings import embedding_inputs
from server.api.common.fields import NonEmpty, StrictBody
from server.api.common.reply import Reply
from server.serving.embedding import MAX_EMBED_INPUTS, Embedded

MAX_DIMENSIONS = 65_536

_INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "maxItems": MAX_EMBED_INPUTS,
        },
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            "minItems": 1,
            "maxItems": MAX_EMBED_INPUTS,
        },
    ]
}

EmbeddingInput = Annotated[
    list[str] | list[list[int]], BeforeValidator(embedding_inputs), WithJsonSchema(_INPUT_SCHEMA)
]


class EmbeddingRequest(StrictBody):
    model: NonEmpty
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    # only the model's own width: see server/api/common/embeddings.py check_dimensions. The bound (wider
    # than any embedding model) refuses a huge value with the body, before a model is looked up.
    dimensions: Annotated[int, Field(ge=1, le=MAX_DIMENSIONS)] | None = None
    user: str | None = None


class EmbeddingData(Reply):
    object: Literal["embedding"]
    index: NonNegativeInt
    embedding: list[float] | str = Field(
        description="floats, or with encoding_format base64 little-endian float32"
    )


class EmbeddingUsage(Reply):
    prompt_tokens: NonNegativeInt
    total_tokens: NonNegativeInt


class EmbeddingList(Reply):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _vector(row: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in row]


def embedding_body(model: str, got: Embedded, encoding: str) -> bytes:
    """The JSON reply (a thread's work: a few hundred thousand floats are milliseconds of encoding)."""
    body: dict[str, Any] = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _vector(row, encoding)}
            for i, row in enumerate(got.vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": got.prompt_tokens, "total_tokens": got.prompt_tokens},
    }
    return json.dumps(body, separators=(",", ":")).encode("utf-8")
