"""An embeddings request, for every dialect: the model it names, when installed here, must be an embedding
model (else a 400 naming its kind); the router decides where it is served (`embedding_target`, the same
policy as a generation: server/routing/decision.py); locally the job goes to the worker's embedding queue
(server/serving/embedding.py), upstream it is one POST (server/routing/embeddings.py). Either way the
answer is the worker's `Embedded` (or a refusal: an input over the context, an id outside the vocabulary,
the upstream's), which each dialect renders; the header X-Simmer-Route says where it was served.

An upstream that fails before its answer hands the request to the local encoder when the decision allows
(upstream_failed); a local refusal before the answer (busy, paused, overheated) may send it upstream.
A reply's JSON is built off the event loop, a vector at a time (`rows_json`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from fastapi import Request
from pydantic_core import PydanticCustomError

from models.errors import InvalidParameter, ModelNotFound, SimmerError, WrongModelKind
from models.types import KIND_EMBEDDING
from server.api.common.fields import MAX_TOKEN_ID, MAX_TOKEN_IDS, checked_ids, invalid
from server.api.common.flow import DISCONNECT_POLL_S, ClientGone
from server.logs import EmbeddingRecord, log_embedding
from server.routing.router import HEADER as ROUTE_HEADER
from server.routing.router import Route
from server.serving.catalog import CatalogEntry
from server.serving.contracts import loop_sink
from server.serving.embedding import MAX_EMBED_INPUTS, Embedded, EmbedJob
from server.serving.events import Failed
from server.serving.request import Mode

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


@dataclass(frozen=True)
class EmbedTarget:
    """Where an embeddings request is served: its route (a fallback moves it), and the installed encoder
    (None for a model served only upstream)."""

    route: Route
    entry: CatalogEntry | None

    @property
    def model(self) -> str:
        """The id the answer names: the encoder's, else the one the client asked for."""
        return self.entry.id if self.entry is not None else self.route.model

    def headers(self) -> dict[str, str]:
        """Where it was served and why (read after the answer: a fallback may have moved it)."""
        return {ROUTE_HEADER: self.route.header()}


def embedding_target(request: Request, model: str | None, route: Mode | None) -> EmbedTarget:
    """The request's model and route: a model installed here that makes no embeddings is a 400 naming its
    kind wherever it would be served; then the router decides (an unknown model, a forbidden or
    unavailable upstream refuse here, before any work)."""
    rt: Runtime = request.app.state.runtime
    assert rt.router is not None
    entry = rt.served.resolve(model)
    if entry is not None and entry.kind != KIND_EMBEDDING:
        raise WrongModelKind.for_model(entry.id, entry.kind)
    planned = rt.router.plan_embeddings(model, route, request.headers.get(ROUTE_HEADER))
    return EmbedTarget(planned, entry)


def dimensions_of(entry: CatalogEntry) -> int | None:
    value = entry.architecture.get("hidden")
    return int(value) if isinstance(value, int) else None


def check_dimensions(entry: CatalogEntry | None, asked: int | None, param: str = "dimensions") -> None:
    """The model's own width only: a model not trained to be cut (Matryoshka) loses quality when cut. An
    upstream-only model (None) is the upstream's to check; its answer is then held to `asked`."""
    if entry is None:
        return
    width = dimensions_of(entry)
    if asked is not None and asked != width:
        raise InvalidParameter(
            f"'{entry.id}' gives {width}-dimensional embeddings and cannot be shortened; "
            f"omit {param} or pass {width}",
            param=param,
        )


async def embed(
    request: Request,
    target: EmbedTarget,
    inputs: list[str] | list[list[int]],
    field: str = "input",
    fit: bool = False,
    keep_alive_s: float | None = None,
    dimensions: int | None = None,
) -> Embedded | None:
    """The vectors of `inputs` in order; None when the client left first (a local job stops at its next
    batch, an upstream request is closed). With `fit` a text over the model's context is cut to fit
    (Embedder.tokenize) rather than refused (locally: an upstream gets the inputs as they are)."""
    rt: Runtime = request.app.state.runtime
    rid = f"embd-{uuid.uuid4().hex[:24]}"
    route = target.route
    started, outcome, tokens = time.monotonic(), "client_gone", 0
    try:
        got = await _served(request, rid, target, inputs, field, fit, keep_alive_s, dimensions)
        outcome, tokens = "ok", got.prompt_tokens
        rt.metrics.count_embedded(target.model, len(got.vectors), got.prompt_tokens)
        return got
    except ClientGone:
        return None
    except SimmerError as err:
        outcome = err.code
        raise
    except Exception:
        outcome = "internal_error"
        raise
    finally:
        log_embedding(
            EmbeddingRecord(
                rid,
                request.url.path,
                target.model,
                len(inputs),
                tokens,
                outcome,
                (time.monotonic() - started) * 1000,
                route=f"{route.side}/{route.reason}",
            )
        )


async def _served(
    request: Request,
    rid: str,
    target: EmbedTarget,
    inputs: list[str] | list[list[int]],
    field: str,
    fit: bool,
    keep_alive_s: float | None,
    dimensions: int | None,
) -> Embedded:
    """The answer from the side the route names, moving once if that side refuses before answering."""
    rt: Runtime = request.app.state.runtime
    assert rt.router is not None
    route = target.route
    if route.side == "local":
        try:
            return await _local(request, rid, target, inputs, field, fit, keep_alive_s)
        except SimmerError as err:
            if not rt.router.reroute_embeddings(route, err):
                raise
    width = dimensions_of(target.entry) if target.entry is not None else dimensions
    relayed = rt.router.embeddings(rid, route, inputs, dimensions=dimensions, width=width)
    got = await _answered(request, relayed, lambda: None)
    if got is not None:
        return got
    return await _local(request, rid, target, inputs, field, fit, keep_alive_s)  # the upstream failed


async def _local(
    request: Request,
    rid: str,
    target: EmbedTarget,
    inputs: list[str] | list[list[int]],
    field: str,
    fit: bool,
    keep_alive_s: float | None,
) -> Embedded:
    rt: Runtime = request.app.state.runtime
    assert rt.router is not None
    entry = target.entry
    if entry is None or entry.path is None:  # known to the router a moment ago, removed from the store since
        raise ModelNotFound(f"The model '{target.model}' is not installed", param="model")
    events: asyncio.Queue = asyncio.Queue()
    job = EmbedJob(
        id=rid,
        model_id=entry.id,
        path=entry.path,
        inputs=inputs,
        param=field,
        fit=fit,
        keep_alive_s=keep_alive_s,
        sink=loop_sink(asyncio.get_running_loop(), events),
    )
    rt.worker.submit_embedding(job)  # busy / loading / closing raise here, before any work
    rt.router.count(target.route)
    item = await _answered(request, events.get(), job.cancel.cancel)
    if isinstance(item, Failed):
        raise item.error
    assert isinstance(item, Embedded)
    return item


T = TypeVar("T")


async def _answered(request: Request, work: Awaitable[T], on_gone: Callable[[], None]) -> T:
    """`work`'s result, or ClientGone (after `on_gone`) when the client leaves first; `work` is cancelled
    unless it finished."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S * 4)
            if done:
                return task.result()
            if await request.is_disconnected():
                on_gone()
                raise ClientGone
    finally:
        task.cancel()
