"""The one mapping from domain errors to HTTP: status code + OpenAI-shaped body.

Every error the server sends, as a JSON response or as a chunk inside a stream, is built here:
`{"error": {"message", "type", "code", "param"}}`. Handlers registered by `install_handlers` make
sure nothing leaves as a bare 500 or as FastAPI's 422 shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from models.errors import SimmerError

log = logging.getLogger("simmer.server")


class ServerBusy(SimmerError):
    """The worker queue is full."""

    code = "server_busy"


class ModelLoading(SimmerError):
    """The engine is still loading (or failed to load)."""

    code = "model_loading"


class ShuttingDown(SimmerError):
    code = "server_shutting_down"


class DevicePaused(SimmerError):
    """The governor paused work (device too hot, app in the background) longer than pause_timeout_s."""

    code = "device_paused"


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
_STATUS: dict[str, tuple[int, str]] = {
    "invalid_parameter": (400, "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "model_not_installed": (404, "invalid_request_error"),
    # a GGUF whose tensor types cannot be converted exactly: the file is understood, and refused
    "unsupported_quantization": (422, "invalid_request_error"),
    "context_length_exceeded": (413, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "invalid_api_key": (401, "authentication_error"),
    "host_not_allowed": (403, "permission_error"),
    "server_busy": (503, "server_error"),
    "model_loading": (503, "server_error"),
    "server_shutting_down": (503, "server_error"),
    "insufficient_memory": (503, "server_error"),
    "device_overheated": (503, "server_error"),
    "device_paused": (503, "server_error"),
    "cancelled": (499, "server_error"),
}

# Seconds a client should wait before retrying, for the statuses that invite a retry.
RETRY_AFTER_S: dict[str, int] = {
    "server_busy": 1,
    "model_loading": 2,
    "server_shutting_down": 5,
    "device_paused": 10,
    "device_overheated": 30,
}


def error_body(code: str, message: str, *, param: str | None = None, err_type: str | None = None) -> dict:
    kind = err_type or _STATUS.get(code, (500, "server_error"))[1]
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def status_for(err: SimmerError) -> int:
    if isinstance(err, ApiError):
        return err.status
    return _STATUS.get(err.code, (500, "server_error"))[0]


def error_payload(err: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(status, body, headers) for any exception; unknown ones become a generic 500."""
    if isinstance(err, SimmerError):
        err_type = err.err_type if isinstance(err, ApiError) else None
        headers = {}
        if err.code in RETRY_AFTER_S:
            headers["Retry-After"] = str(RETRY_AFTER_S[err.code])
        return status_for(err), error_body(err.code, err.message, param=err.param, err_type=err_type), headers
    return 500, error_body("internal_error", "Internal server error"), {}


def error_response(err: BaseException) -> JSONResponse:
    status, body, headers = error_payload(err)
    return JSONResponse(body, status_code=status, headers=headers)


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    # loc looks like ("body", "messages", 0, "role"); drop the "body" root, join the rest.
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, "invalid_json", "Request body is not valid JSON")
    param = _param_from_loc(tuple(first.get("loc", ())))
    msg = first.get("msg", "Invalid request")
    # Our own validators raise InvalidParameter inside pydantic; keep their wording.
    ctx_err = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_err, SimmerError):
        return ApiError(400, "invalid_parameter", ctx_err.message, param=ctx_err.param or param)
    message = f"{param}: {msg}" if param else msg
    return ApiError(400, "invalid_parameter", message, param=param)


def install_handlers(app: FastAPI) -> None:
    async def on_simmer(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code, "http_error"
        )
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(code, str(exc.detail), err_type=kind)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def on_any(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(exc)

    app.add_exception_handler(SimmerError, on_simmer)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_any)
