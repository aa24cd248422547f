"""The one mapping from domain errors to HTTP: status code + error body.

Every error the server sends, as a JSON response or as a chunk inside a stream, is built here:
`{"error": {"message", "type", "code", "param"}}` (OpenAI's shape), except under Ollama's paths (/api/...),
where Ollama's clients read `{"error": "message"}`: same status, same message, Ollama's shape. Handlers
registered by `install_handlers` make sure nothing leaves as FastAPI's 422 shape; `ErrorMiddleware` makes
sure no exception leaves the app.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from models.errors import ContextLengthExceeded, SimmerError

log = logging.getLogger("simmer.server")

MAX_JSON_DEPTH = 64  # deeper request bodies are refused (invalid_json) before any model validation


class ApiError(SimmerError):
    """An error born at the HTTP edge (auth, host, body size, routing) with an explicit status."""

    def __init__(
        self, status: int, code: str, message: str, *, param: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.status = status
        self.code = code
        self.err_type = err_type


# code -> (HTTP status, OpenAI error type). Codes not listed are server-side failures (500).
STATUS: dict[str, tuple[int, str]] = {
    "invalid_parameter": (400, "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error"),
    "unsupported_content_type": (415, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "model_not_installed": (404, "invalid_request_error"),
    "model_not_chat": (400, "invalid_request_error"),
    "wrong_model_kind": (400, "invalid_request_error"),
    # OpenAI's status and code for a prompt that does not fit: clients (litellm, the openai SDK) recognise
    # a too-long prompt by them (server/http/errors.py words the message as OpenAI does)
    "context_length_exceeded": (400, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "invalid_api_key": (401, "authentication_error"),
    "host_not_allowed": (403, "permission_error"),
    "cors_not_allowed": (403, "permission_error"),
    "server_busy": (503, "server_error"),
    "model_loading": (503, "server_error"),
    "server_shutting_down": (503, "server_error"),
    "insufficient_memory": (503, "server_error"),
    # a model whose files changed after they were verified: unavailable until `simmer pull --force` fixes it
    "verification_failed": (503, "server_error"),
    # 507 Insufficient Storage (RFC 4918): a full disk is not a load spike that a retry after a pause
    # clears (503 + Retry-After would invite one); it needs someone to free space.
    "insufficient_disk": (507, "server_error"),
    "device_overheated": (503, "server_error"),
    "device_paused": (503, "server_error"),
    "cancelled": (499, "server_error"),
    "upstream_not_allowed": (403, "permission_error"),
    "upstream_unavailable": (503, "server_error"),
    "upstream_error": (502, "server_error"),
    "too_many_leases": (429, "invalid_request_error"),
    "too_many_streams": (429, "invalid_request_error"),
    "model_busy": (409, "invalid_request_error"),
    # installing a model (Ollama's /api/pull): the file or the source is the problem, not the server
    "invalid_model_file": (400, "invalid_request_error"),
    "unsupported_model": (400, "invalid_request_error"),
    "unsupported_architecture": (400, "invalid_request_error"),
    "unsupported_quantization": (400, "invalid_request_error"),
    "hash_mismatch": (400, "invalid_request_error"),
    "source_unavailable": (502, "server_error"),
}

# Seconds a client should wait before retrying, for the statuses that invite a retry.
RETRY_AFTER_S: dict[str, int] = {
    "server_busy": 1,
    "model_loading": 2,
    "server_shutting_down": 5,
    "device_paused": 10,
    "device_overheated": 30,
    "upstream_unavailable": 5,
}


OLLAMA_PREFIX = "/api/"


def is_ollama_path(path: str | None) -> bool:
    """Ollama's API answers errors as {"error": "message"} (server/api/ollama/routes.py)."""
    return bool(path) and (path.startswith(OLLAMA_PREFIX) or path == "/api")  # type: ignore[union-attr]


def ollama_error_body(message: str) -> dict:
    return {"error": message}


def error_body(code: str, message: str, *, param: str | None = None, err_type: str | None = None) -> dict:
    kind = err_type or STATUS.get(code, (500, "server_error"))[1]
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def status_for(err: SimmerError) -> int:
    if isinstance(err, ApiError):
        return err.status
    return STATUS.get(err.code, (500, "server_error"))[0]


# The request field that holds the prompt, per generating path: what a context overflow names as `param`.
PROMPT_FIELD: dict[str, str] = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/v1/responses": "input",
    "/api/chat": "messages",
    "/api/generate": "prompt",
    "/v1/embeddings": "input",
    "/api/embed": "input",
    "/api/embeddings": "prompt",
}
# Embeddings have no window to slide: an input over the context can only be shortened.
NO_WINDOW = frozenset({"/v1/embeddings", "/api/embed", "/api/embeddings"})


def context_overflow(err: ContextLengthExceeded, path: str | None) -> ContextLengthExceeded:
    """The refusal worded as OpenAI words it ("This model's maximum context length is N tokens. However,
    your messages resulted in M tokens ..."), naming the field of the API that was called: clients match
    on those words and on the code. An error without its numbers (from an upstream) keeps its message."""
    field = PROMPT_FIELD.get(path or "", err.param or "messages")
    window = 'truncation: "auto"' if field == "input" else "truncate: true"
    if err.context_length is None or err.prompt_tokens is None:
        return ContextLengthExceeded(err.message, param=field)
    n, m = err.context_length, err.prompt_tokens
    message = (
        f"This model's maximum context length is {n} tokens. However, your {field} resulted in {m} tokens. "
        f"Please reduce the length of the {field}, or set {window}."
    )
    if path in NO_WINDOW:
        message = message.removesuffix(f", or set {window}.") + "."
    return ContextLengthExceeded(message, param=field, context_length=n, prompt_tokens=m)


def error_payload(err: BaseException, path: str | None = None) -> tuple[int, dict, dict[str, str]]:
    """(status, body, headers) for any exception; unknown ones become a generic 500. Under Ollama's paths
    the body has Ollama's shape."""
    if isinstance(err, ContextLengthExceeded):
        err = context_overflow(err, path)
    status, body, headers = _payload(err)
    if is_ollama_path(path):
        body = ollama_error_body(body["error"]["message"])
    return status, body, headers


def _payload(err: BaseException) -> tuple[int, dict, dict[str, str]]:
    if isinstance(err, SimmerError):
        err_type = err.err_type if isinstance(err, ApiError) else None
        headers = {}
        if err.code in RETRY_AFTER_S:
            headers["Retry-After"] = str(RETRY_AFTER_S[err.code])
        told = getattr(err, "retry_after_s", None)  # an error that knows better (an open breaker)
        if told:
            headers["Retry-After"] = str(max(1, math.ceil(told)))
        body = error_body(err.code, err.message, param=err.param, err_type=err_type)
        numbers = getattr(err, "numbers", None)  # insufficient_memory: what was needed and what was free
        if numbers:
            body["error"]["memory"] = numbers
        return status_for(err), body, headers
    return 500, error_body("internal_error", "Internal server error"), {}


def error_response(err: BaseException, path: str | None = None) -> JSONResponse:
    status, body, headers = error_payload(err, path)
    return JSONResponse(body, status_code=status, headers=headers)


async def send_error(send: Send, err: BaseException, path: str | None = None) -> None:
    """Answer with the error's JSON body, from pure ASGI code (before any other response message)."""
    status, body, headers = error_payload(err, path)
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


class ErrorMiddleware:
    """Pure ASGI: whatever exception escapes the app becomes an OpenAI-shaped answer here.

    Starlette's own ServerErrorMiddleware answers too, but then re-raises, so uvicorn logs "Exception in
    ASGI application" and drops the keep-alive connection without `Connection: close`; a pooled client's
    next request then fails. Here the exception ends with the answer:
    - response not started: the error's JSON (500 internal_error for anything that is not ours);
    - response started (a stream): the body is ended, so a chunked response finishes cleanly; one with a
      Content-Length left short makes uvicorn close the connection, the only honest ending left.
    The traceback goes to our log either way."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            if not started:
                await send_error(send, exc, scope.get("path"))
            elif not finished:
                with contextlib.suppress(Exception):  # the client may be gone already
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _is_type_tag(part: str) -> bool:
    # pydantic names the member of a union it tried: "str", "list[TextPart]", "function-after[...]".
    return "[" in part or "-" in part or part[:1].isupper() or part in {"str", "int", "float", "bool", "none"}


def param_path(loc: tuple[Any, ...], body: Any) -> str | None:
    """pydantic's error location as the JSON path a client wrote: ("body", "messages", 0, "str") ->
    "messages[0]". Walks the request body alongside, so union-member tags and "[key]" markers (which
    are no part of the body) drop out while real keys, indexes and missing fields stay."""
    out = ""
    node = body
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int) and isinstance(node, list):
            out += f"[{part}]"
            node = node[part] if 0 <= part < len(node) else None
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            out += f".{part}" if out else part
            node = node[part]
        elif isinstance(part, str) and isinstance(node, dict) and not _is_type_tag(part):
            out += f".{part}" if out else part  # a missing field
            node = None
    return out or None


def _json_content_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def validation_error(exc: RequestValidationError, content_type: str | None = "application/json") -> ApiError:
    """The 400 (or 415) for a request FastAPI could not turn into its model."""
    errors = exc.errors()
    if isinstance(exc.body, (bytes, bytearray)) and not _json_content_type(content_type or ""):
        # FastAPI parses the body as JSON only under a JSON Content-Type; anything else stays bytes. OpenAI
        # answers unsupported_content_type; 415 is HTTP's status for it. Requiring it also keeps a web page
        # from posting to the server without a CORS preflight (text/plain is a "simple" request).
        shown = f"'{content_type}'" if content_type else "none"
        return ApiError(
            415,
            "unsupported_content_type",
            f"Content-Type must be application/json (got {shown})",
        )
    if not errors:
        return ApiError(400, "invalid_parameter", "Invalid request")
    first = max(errors, key=lambda e: len(e.get("loc", ())))  # the deepest error is the most specific
    if first.get("type") == "json_invalid":
        return ApiError(400, "invalid_json", "Request body is not valid JSON")
    if first.get("type") == "invalid_json":  # raised by our own validators (server/api/common/fields.py)
        return ApiError(400, "invalid_json", first.get("msg", "Request body is not valid JSON"))
    loc = tuple(first.get("loc", ()))
    if loc == ("body",) and first.get("type") == "missing":
        return ApiError(400, "invalid_json", "Request body is empty: send a JSON object")
    ctx = first.get("ctx") or {}
    # Our own validators raise a custom error, with `param` when it is not where pydantic was; keep their
    # wording (and that of an InvalidParameter raised inside pydantic).
    param = (ctx.get("param") if first.get("type") == "invalid_parameter" else None) or param_path(
        loc, exc.body
    )
    ctx_err = ctx.get("error")
    if isinstance(ctx_err, SimmerError):
        return ApiError(400, "invalid_parameter", ctx_err.message, param=ctx_err.param or param)
    msg = first.get("msg", "Invalid request")
    if param is None and loc == ("body",):
        msg = f"Request body must be a JSON object: {msg}"
    message = msg if first.get("type") == "invalid_parameter" or not param else f"{param}: {msg}"
    return ApiError(400, "invalid_parameter", message, param=param)


# FastAPI answers a body it cannot parse with HTTPException(400) chained to the cause; these causes are
# JSON problems that json.JSONDecodeError does not cover.
_JSON_CAUSES: dict[type[BaseException], str] = {
    UnicodeDecodeError: "Request body is not valid UTF-8",
    RecursionError: f"Request body is nested deeper than {MAX_JSON_DEPTH} levels",
    # after UnicodeDecodeError, its subclass: Python's parser refuses an integer of over 4,300 digits
    ValueError: "Request body is not valid JSON: a number too long to read (over 4,300 digits)",
}


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def http_error(exc: StarletteHTTPException) -> ApiError:
    for cause, message in _JSON_CAUSES.items():
        if exc.status_code == 400 and isinstance(exc.__cause__, cause):
            return ApiError(400, "invalid_json", message)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return ApiError(exc.status_code, code, str(exc.detail), err_type=kind)


def install_handlers(app: FastAPI) -> None:
    async def on_simmer(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc, request.url.path)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc, request.headers.get("content-type"))
        return error_response(err, request.url.path)

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status, body, _headers = error_payload(http_error(exc), request.url.path)
        return JSONResponse(body, status_code=status, headers=exc.headers)

    app.add_exception_handler(SimmerError, on_simmer)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # No handler for Exception: Starlette would give it to ServerErrorMiddleware, which re-raises after
    # answering. Unexpected exceptions end in ErrorMiddleware instead.
