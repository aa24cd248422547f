"""llama.cpp server's tokenizer endpoints on the wire
(https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md):

    POST /tokenize  {"content", "add_special": false, "parse_special": true, "with_pieces": false}
        -> {"tokens": [ids]} or {"tokens": [{"id", "piece"}]}; a piece that is not valid UTF-8 (part of a
        character) is its list of byte values, as llama.cpp sends it. `content` may also mix strings and
        token ids, as llama.cpp's tokenize_mixed takes it.
    POST /detokenize  {"tokens": [ids]} -> {"content": "..."} (the pieces joined, special tokens as text)
    POST /apply-template  {"messages": [...]} -> {"prompt": "..."} (the chat template + generation prompt)
    POST /embedding, /embeddings  {"content" or "input", "embd_normalize": 2}
        -> [{"index": i, "embedding": [[floats]]}] (one pooled vector per input, in a list of one, as
        llama.cpp's non-OpenAI reply has it); server/api/llamacpp/embeddings.py

`model` picks the served model when several are served (today one; another id is 404).
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from server.api.common.embeddings import INPUT_SCHEMA, embedding_inputs
from server.api.common.fields import (
    MAX_MESSAGES,
    MAX_TOKEN_IDS,
    STRICT,
    Normalize,
    RouteMode,
    StrictBody,
    invalid,
    token_ids,
)
from server.api.common.messages import ChatMessage


class TokenizeRequest(StrictBody):
    COUNTS: ClassVar[dict[str, int]] = {"content": MAX_TOKEN_IDS}

    model: str | None = None
    content: token_ids("content", text=True) = ""
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(StrictBody):
    COUNTS: ClassVar[dict[str, int]] = {"tokens": MAX_TOKEN_IDS}

    model: str | None = None
    tokens: token_ids("tokens") = Field(default_factory=list)


class ApplyTemplateRequest(StrictBody):
    COUNTS: ClassVar[dict[str, int]] = {"messages": MAX_MESSAGES}

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)

    def message_dicts(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]


_EMBEDDING_SCHEMA = WithJsonSchema(INPUT_SCHEMA)
# `content` / `input` of /embedding: a string, a list of ids, or a list of strings or of id lists
# (server/api/common/embeddings.py parse_inputs; its refusal a 400 naming the field)
EmbeddingContent = Annotated[
    list[str] | list[list[int]],
    BeforeValidator(partial(embedding_inputs, field="content")),
    _EMBEDDING_SCHEMA,
]
EmbeddingInput = Annotated[
    list[str] | list[list[int]], BeforeValidator(partial(embedding_inputs, field="input")), _EMBEDDING_SCHEMA
]


class LlamaEmbeddingRequest(StrictBody):
    """POST /embedding (and /embeddings): `content` (llama.cpp's own) or `input` (taken first when both
    are sent, as llama.cpp does), and `embd_normalize` (2, Euclidean, by default)."""

    # the document says what _has_input checks: one of the two is there and not null
    model_config = ConfigDict(
        **STRICT,
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": INPUT_SCHEMA}},
                {"required": ["input"], "properties": {"input": INPUT_SCHEMA}},
            ]
        },
    )

    # a list of ids may be long (the context bounds it later); a list of inputs is bounded by parse_inputs
    COUNTS: ClassVar[dict[str, int]] = {"content": MAX_TOKEN_IDS, "input": MAX_TOKEN_IDS}

    model: str | None = None
    content: EmbeddingContent | None = None
    input: EmbeddingInput | None = None
    # -1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean, > 2 p-norm; see embeddings.py
    embd_normalize: Normalize = 2
    encoding_format: Literal["float", "base64"] = "float"  # read and checked by llama.cpp, used by /v1 only
    route: RouteMode | None = None  # simmer's: where to serve it (or the X-Simmer-Route header)

    @model_validator(mode="after")
    def _has_input(self) -> LlamaEmbeddingRequest:
        if self.input is None and self.content is None:
            raise invalid('"input" or "content" must be provided', "content")
        return self

    def inputs(self) -> tuple[list[str] | list[list[int]], str]:
        """The inputs, and the field they came in (which a refusal names)."""
        if self.input is not None:
            return self.input, "input"
        assert self.content is not None
        return self.content, "content"
