"""OpenAI's chat message (also what llama.cpp's /apply-template takes), as the internal request has it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from server.api.common.fields import MAX_CONTENT_PARTS, STRICT


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = STRICT

    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def as_dict(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        # "developer" is the newer OpenAI name for the system role; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out
