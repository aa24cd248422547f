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


class EmbeddingItem(Reply):
    """One input's answer from /embedding; the reply is a JSON array of these (embeddings.py builds it)."""

    index: int
    embedding: list[list[float]] = Field(description="the input's pooled vector, in a list of one")
