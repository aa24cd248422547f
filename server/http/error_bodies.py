"""The error bodies on the wire: OpenAI's error object, and Ollama's `{"error": "message"}` under its paths
(server/api/common/reply.py says what these models are for; server/http/errors.py builds the bodies)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from server.api.common.reply import Reply
from server.http.errors import STATUS

ERROR_CODES = sorted({*STATUS, "internal_error", "http_error"})


class ErrorDetail(Reply):
    message: str
    type: Literal["invalid_request_error", "authentication_error", "permission_error", "server_error"]
    code: str = Field(json_schema_extra=lambda schema: schema.update(enum=list(ERROR_CODES)))
    param: str | None


class Error(Reply):
    """OpenAI's error object; `code` is one of the codes in docs/server.md."""

    error: ErrorDetail


class OllamaError(Reply):
    """Ollama's error object: the message alone."""

    error: str
