"""The OpenAPI document, made to tell the truth (schemathesis checks it against the live server).

FastAPI's generated document promises a 422 `HTTPValidationError` on every route and JSON everywhere.
The server answers bad input with 400 and OpenAI's error object, refuses with 401/403/413/415, sends
Prometheus text from /metrics and Server-Sent Events from the streams. `install_openapi` rewrites the
generated document once, on first request, from the same tables the server uses (server/errors.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.errors import _STATUS
from server.security import is_open_path

ERROR_CODES = sorted({*_STATUS, "internal_error", "http_error"})

_REF = "#/components/schemas/"

SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object",
        "description": "OpenAI's error object; `code` is one of the codes in docs/server.md",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code", "param"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {
                        "type": "string",
                        "enum": [
                            "invalid_request_error",
                            "authentication_error",
                            "permission_error",
                            "server_error",
                        ],
                    },
                    "code": {"type": "string", "enum": ERROR_CODES},
                    "param": {"type": ["string", "null"]},
                },
            }
        },
    },
    "Usage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "completion_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 0},
            "prompt_tokens_details": {
                "type": "object",
                "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
            },
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["chat.completion"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {"type": ["string", "null"]},
            "choices": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "required": ["index", "message", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer"},
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {
                                "role": {"type": "string", "enum": ["assistant"]},
                                "content": {"type": "string"},
                            },
                        },
                        "logprobs": {"type": ["object", "null"]},
                        "finish_reason": {"type": "string", "enum": ["stop", "length"]},
                    },
                },
            },
            "usage": {"$ref": _REF + "Usage"},
            "timings": {"type": "object"},
            "truncated": {"type": "boolean"},
        },
    },
    "TextCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["text_completion"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {"type": ["string", "null"]},
            "choices": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "required": ["index", "text", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer"},
                        "text": {"type": "string"},
                        "logprobs": {"type": ["object", "null"]},
                        "finish_reason": {"type": "string", "enum": ["stop", "length"]},
                    },
                },
            },
            "usage": {"$ref": _REF + "Usage"},
            "timings": {"type": "object"},
            "truncated": {"type": "boolean"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "created", "owned_by"],
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"type": "string", "enum": ["model"]},
                        "created": {"type": "integer"},
                        "owned_by": {"type": "string"},
                        "variants": {"type": "array", "items": {"type": "string"}},
                        "variant": {"type": ["string", "null"]},
                        "context_length": {"type": ["integer", "null"]},
                    },
                },
            },
        },
    },
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string", "enum": ["ok", "loading", "error", "shutting_down"]}},
    },
    "ThermalState": {"type": "object", "description": "The governor's snapshot (docs/governor.md)"},
}

# OpenAPI 3.1 reads an event stream's `schema` as the schema of one event (3.2 calls it itemSchema).
_SSE_EVENT = {
    "type": "object",
    "description": "One Server-Sent Event: `data` is a JSON chunk, an error object or the final `[DONE]`",
    "required": ["data"],
    "properties": {
        "event": {"type": "string", "description": "absent (message), or `governor` when asked for"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}


def _json(schema: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF + schema}}}


_RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}
}

# What each status means, for the error responses every operation may list.
_ERRORS: dict[int, str] = {
    400: "Invalid request: a bad field (`param` names it) or a body that is not JSON",
    401: "Missing or wrong Bearer key (SIMMER_API_KEY is set)",
    403: "The Host header is not a loopback name or in SIMMER_ALLOWED_HOSTS",
    404: "Not found: another model name, or no governor on this server",
    413: "The body is over SIMMER_MAX_BODY_BYTES, or the prompt does not fit the context",
    415: "The Content-Type is not application/json",
    500: "A bug (the traceback is logged)",
    503: "Busy, loading, shutting down or paused by the governor (see Retry-After)",
}

# The 200 answer of each operation, and the error statuses beyond the common ones.
_OK: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {**_json("ChatCompletion"), **_SSE},
    "/v1/completions": {**_json("TextCompletion"), **_SSE},
    "/v1/models": _json("ModelList"),
    "/health": _json("Health"),
    "/metrics": {"text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}},
    "/v1/thermal": _json("ThermalState"),
    "/v1/thermal/events": _SSE,
    "/v1/lifecycle": _json("ThermalState"),
}
_EXTRA: dict[str, set[int]] = {
    "/v1/chat/completions": {404, 503},
    "/v1/completions": {404, 503},
    "/v1/thermal": {404},
    "/v1/thermal/events": {404},
    "/v1/lifecycle": {404},
}


def _statuses(path: str, op: dict[str, Any], api_key: bool) -> set[int]:
    statuses = {403, 500} | _EXTRA.get(path, set())
    if "requestBody" in op:
        statuses |= {400, 413, 415}
    if api_key and not is_open_path(path):
        statuses.add(401)
    return statuses


def patch(doc: dict[str, Any], *, api_key: bool) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas.update(SCHEMAS)
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc.get("paths", {}).items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path in _OK:
                responses.setdefault("200", {"description": "OK"})["content"] = _OK[path]
            for status in sorted(_statuses(path, op, api_key)):
                response: dict[str, Any] = {"description": _ERRORS[status], "content": _json("Error")}
                if status == 503:
                    response["headers"] = _RETRY_AFTER
                responses[str(status)] = response
            if path == "/health":  # not an error object: the loading state, llama.cpp-style
                responses["503"] = {
                    "description": "Loading, failed or shutting down",
                    "content": _json("Health"),
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
