"""What llama.cpp's tokenizer endpoints answer (server/api/common/reply.py says what these models are for)."""

from __future__ import annotations

from pydantic import Field

from server.api.common.reply import Reply


class TokenPiece(Reply):
    id: int
    piece: str | list[int] = Field(description="the text, or its bytes when they are not valid UTF-8")


class Tokens(Reply):
    tokens: list[int | TokenPiece]


class Detokenized(Reply):
    content: str


class AppliedTemplate(Reply):
    prompt: str
