"""OpenAI's /v1/embeddings: its body (validated here), its translation into the worker's inputs (once), and
its answer (built from the reply models below). Kept apart from requests.py, render.py and replies.py:
nothing of the generating routes is shared."""

from __future__ import annotations

import base64
import json
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import BeforeValidator, Field, NonNegativeInt, WithJsonSchema

from server.api.common.embeddings import INPUT_SCHEMA, embedding_inputs, rows_json
from server.api.common.fields import MAX_TOKEN_IDS, Dimensions, NonEmpty, RouteMode, StrictBody
from server.api.common.reply import Reply
from server.serving.embedding import Embedded

EmbeddingInput = Annotated[
    list[str] | list[list[int]], BeforeValidator(embedding_inputs), WithJsonSchema(INPUT_SCHEMA)
]


class EmbeddingRequest(StrictBody):
    COUNTS: ClassVar[dict[str, int]] = {"input": MAX_TOKEN_IDS}  # parse_inputs bounds a list of inputs

    model: NonEmpty
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None  # only the model's own width (common/embeddings.py)
    user: str | None = None  # never forwarded to an upstream
    route: RouteMode | None = None  # simmer's: where to serve it (or the X-Simmer-Route header)


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


def embedding_body(model: str, got: Embedded, encoding: str) -> bytes:
    """The JSON reply (a thread's work: a few hundred thousand floats are milliseconds of encoding), a
    vector at a time (rows_json)."""
    if encoding == "base64":
        rows = [
            '"' + base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode("ascii") + '"'
            for row in got.vectors
        ]
    else:
        rows = rows_json(got.vectors)
    data = ",".join(f'{{"object":"embedding","index":{i},"embedding":{row}}}' for i, row in enumerate(rows))
    usage = json.dumps({"prompt_tokens": got.prompt_tokens, "total_tokens": got.prompt_tokens})
    return f'{{"object":"list","data":[{data}],"model":{json.dumps(model)},"usage":{usage}}}'.encode()
