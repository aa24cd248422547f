"""An embeddings request, for every dialect: the model it names must be an embedding model (else a 400
naming its kind), the job goes to the worker's embedding queue (server/serving/embedding.py), and the
answer (or the refusal the worker raised: an input over the context, an id outside the vocabulary) comes
back. Embeddings are served here only: the upstream router does not relay them. A reply's JSON is built off
the event loop, a vector at a time (`rows_json`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import Request
from pydantic_core import PydanticCustomError

from models.errors import InvalidParameter, ModelNotFound, SimmerError, WrongModelKind
from models.types import KIND_EMBEDDING
from server.api.common.fields import MAX_TOKEN_ID, MAX_TOKEN_IDS, checked_ids, invalid
from server.api.common.flow import DISCONNECT_POLL_S
from server.logs import EmbeddingRecord, log_embedding
from server.serving.catalog import CatalogEntry
from server.serving.contracts import loop_sink
from server.serving.embedding import MAX_EMBED_INPUTS, Embedded, EmbedJob
from server.serving.events import Failed

if TYPE_CHECKING:
    from server.api.context import Runtime


_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"

_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
# The shapes parse_inputs takes, as its documents publish them (every dialect's `input`; llama.cpp's
# `content` too). The model's own vocabulary and context bound the ids further, per model.
INPUT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "maxItems": MAX_EMBED_INPUTS,
        },
        {"type": "array", "items": _ID, "minItems": 1, "maxItems": MAX_TOKEN_IDS},
        {
            "type": "array",
            "items": {"type": "array", "items": _ID, "minItems": 1, "maxItems": MAX_TOKEN_IDS},
            "minItems": 1,
            "maxItems": MAX_EMBED_INPUTS,
        },
    ]
}


def parse_inputs(value: Any, field: str = "input") -> list[str] | list[list[int]]:
    """A request's `input` as the worker takes it: strings, or rows of token ids (one list of ids is one
    row). One clear InvalidParameter for the first thing wrong: empty, too many, or none of the shapes."""
    try:
        if isinstance(value, str):
            value = [value]
        elif isinstance(value, list) and value and all(type(x) in (int, float) for x in value):
            value = [checked_ids(value, field)]
        if not isinstance(value, list):
            raise InvalidParameter(f"{field} must be {_SHAPES}", param=field)
        if not value:
            raise InvalidParameter(f"{field} must not be empty", param=field)
        if len(value) > MAX_EMBED_INPUTS:
            raise InvalidParameter(
                f"{field} has {len(value)} items; at most {MAX_EMBED_INPUTS} per request", param=field
            )
        if all(isinstance(x, str) for x in value):
            for i, text in enumerate(value):
                if not text:
                    raise InvalidParameter(f"{field}[{i}] is an empty string", param=field)
            return list(value)
        if all(isinstance(x, list) for x in value):
            return [checked_ids(row, f"{field}[{i}]") for i, row in enumerate(value)]
    except PydanticCustomError as err:  # checked_ids's refusal, worded for a validator
        raise InvalidParameter(err.message(), param=str((err.context or {}).get("param") or field)) from None
    raise InvalidParameter(f"{field} must be {_SHAPES}", param=field)


def rows_json(vectors: np.ndarray) -> list[str]:
    """Each vector as a JSON array of floats, a short encode each: one json.dumps of a whole reply holds the
    GIL throughout (0.8 s for 5,000 vectors of 384), and with it the worker's next token."""
    return [json.dumps(row.tolist(), separators=(",", ":")) for row in vectors]


def embedding_inputs(value: Any, field: str = "input") -> list[str] | list[list[int]]:
    """parse_inputs as a pydantic validator (its refusal a 400 naming the field, as every body's)."""
    try:
        return parse_inputs(value, field)
    except InvalidParameter as err:
        raise invalid(err.message, err.param) from None


def embedding_model(rt: Runtime, model: str | None) -> CatalogEntry:
    entry = rt.served.resolve(model)
    if entry is None:
        raise ModelNotFound(f"The model '{model}' does not exist", param="model")
    if entry.kind != KIND_EMBEDDING:
        raise WrongModelKind.for_model(entry.id, entry.kind)
    return entry


def dimensions_of(entry: CatalogEntry) -> int | None:
    value = entry.architecture.get("hidden")
    return int(value) if isinstance(value, int) else None


def check_dimensions(entry: CatalogEntry, asked: int | None, param: str = "dimensions") -> None:
    """The model's own width only: a model not trained to be cut (Matryoshka) loses quality when cut."""
    width = dimensions_of(entry)
    if asked is not None and asked != width:
        raise InvalidParameter(
            f"'{entry.id}' gives {width}-dimensional embeddings and cannot be shortened; "
            f"omit {param} or pass {width}",
            param=param,
        )


async def embed(
    request: Request,
    entry: CatalogEntry,
    inputs: list[str] | list[list[int]],
    field: str = "input",
    fit: bool = False,
    keep_alive_s: float | None = None,
) -> Embedded | None:
    """The vectors of `inputs` in order; None when the client left first (the job stops at its next batch).
    With `fit` a text over the model's context is cut to fit (Embedder.tokenize) rather than refused."""
    rt: Runtime = request.app.state.runtime
    assert entry.path is not None
    events: asyncio.Queue = asyncio.Queue()
    job = EmbedJob(
        id=f"embd-{uuid.uuid4().hex[:24]}",
        model_id=entry.id,
        path=entry.path,
        inputs=inputs,
        param=field,
        fit=fit,
        keep_alive_s=keep_alive_s,
        sink=loop_sink(asyncio.get_running_loop(), events),
    )
    started, outcome, tokens = time.monotonic(), "client_gone", 0
    try:
        rt.worker.submit_embedding(job)  # busy / loading / closing raise here, before any work
        got = asyncio.ensure_future(events.get())
        try:
            while True:
                done, _ = await asyncio.wait({got}, timeout=DISCONNECT_POLL_S * 4)
                if done:
                    break
                if await request.is_disconnected():
                    job.cancel.cancel()
                    return None
        finally:
            got.cancel()
        item = got.result()
        if isinstance(item, Failed):
            raise item.error
        assert isinstance(item, Embedded)
        outcome, tokens = "ok", item.prompt_tokens
        rt.metrics.count_embedded(entry.id, len(item.vectors), item.prompt_tokens)
        return item
    except SimmerError as err:
        outcome = err.code
        raise
    except Exception:
        outcome = "internal_error"
        raise
    finally:
        log_embedding(
            EmbeddingRecord(
                job.id,
                request.url.path,
                entry.id,
                len(inputs),
                tokens,
                outcome,
                (time.monotonic() - started) * 1000,
            )
        )
