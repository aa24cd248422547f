"""llama.cpp server's tokenizer endpoints on the wire
(https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md):

    POST /tokenize  {"content", "add_special": false, "parse_special": true, "with_pieces": false}
        -> {"tokens": [ids]} or {"tokens": [{"id", "piece"}]}; a piece that is not valid UTF-8 (part of a
        character) is its list of byte values, as llama.cpp sends it. `content` may also mix strings and
        token ids, as llama.cpp's tokenize_mixed takes it.
    POST /detokenize  {"tokens": [ids]} -> {"content": "..."} (the pieces joined, special tokens as text)
    POST /apply-template  {"messages": [...]} -> {"prompt": "..."} (the chat template + generation prompt)

`model` picks the served model when several are served (today one; another id is 404).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from server.api.common.fields import MAX_MESSAGES, MAX_TOKEN_IDS, StrictBody, token_ids
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
