"""OpenAI's Responses API on the wire (POST /v1/responses), stateless as Ollama has it.

`input` is a string or a list of message items ({"role", "content"} with "type": "message" optional;
content a string or input_text / output_text parts), `instructions` becomes a system message in front.
The request converts itself to the OpenAI chat request the shared flow takes (`to_openai`):
max_output_tokens -> max_tokens, truncation "auto" -> simmer's sliding window, top_logprobs (with
include "message.output_text.logprobs") -> logprobs, temperature/top_p and simmer's extras as they are.

Nothing is stored: `previous_response_id`, `conversation`, a stored `prompt` and `background` (all need
server-side state) are a 400 saying so; `store` is accepted and the response says `"store": false`, which
is what happened. `text.format` other than "text" and `tools` arrive with structured output and tool
calls (issue 15): a 400 until then; they map onto the chat request's response_format and tools.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, model_validator

from models.runtime.sampling import (
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
)
from models.types import FinishEvent, TokenEvent, Usage
from server.schemas import ChatCompletionRequest, _invalid, _Request, chat_logprobs, integer

STATELESS = "simmer's Responses API is stateless: no response is stored"
LATER = "arrives with structured output and tool calls (issue 15)"
LOGPROBS = "message.output_text.logprobs"
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")

_INPUT = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "type": {"type": "string", "enum": ["message"]},
                    "role": {"type": "string", "enum": list(ROLES)},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["type", "text"],
                                    "properties": {
                                        "type": {"type": "string", "enum": list(TEXT_PARTS)},
                                        "text": {"type": "string"},
                                    },
                                },
                            },
                        ]
                    },
                },
            },
        },
    ]
}


def _message(item: Any, where: str) -> dict[str, str]:
    """One input item as a chat message; anything else is a 400 naming where it is."""
    if not isinstance(item, dict):
        raise _invalid(f"{where} must be a message object {{'role', 'content'}}", where)
    kind = item.get("type", "message")
    if kind != "message":
        if kind in ("function_call", "function_call_output"):
            raise _invalid(f"{where}: {kind} items {LATER}", f"{where}.type")
        if kind == "item_reference":
            raise _invalid(f"{where}: item references need stored items; {STATELESS}", f"{where}.type")
        raise _invalid(f"{where}.type must be 'message', got {kind!r}", f"{where}.type")
    role = item.get("role")
    if role not in ROLES:
        raise _invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise _invalid(f"{at} must be a content part object", at)
            if part.get("type") not in TEXT_PARTS:
                raise _invalid(
                    f"{at}.type must be input_text or output_text (the served model reads text only), "
                    f"got {part.get('type')!r}",
                    f"{at}.type",
                )
            if not isinstance(part.get("text"), str):
                raise _invalid(f"{at}.text must be a string", f"{at}.text")
            texts.append(part["text"])
        text = "".join(texts)
    else:
        raise _invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


class ResponsesRequest(_Request):
    model: str | None = None
    input: Annotated[str | list[Any], WithJsonSchema(_INPUT)]
    instructions: str | None = None
    max_output_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    include: Annotated[
        list[str] | None,
        WithJsonSchema({"type": ["array", "null"], "items": {"enum": ["message.output_text.logprobs"]}}),
    ] = None
    stream: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # Refused with a reason (see the module docstring); typed loosely so the reason, not a type error, shows.
    previous_response_id: Annotated[
        str | None, WithJsonSchema({"type": "null", "description": STATELESS})
    ] = None
    conversation: Annotated[Any, WithJsonSchema({"type": "null", "description": STATELESS})] = None
    prompt: Annotated[Any, WithJsonSchema({"type": "null", "description": STATELESS})] = None
    background: Annotated[
        bool | None, WithJsonSchema({"type": ["boolean", "null"], "enum": [False, None]})
    ] = None
    text: Annotated[
        dict[str, Any] | None,
        WithJsonSchema(
            {
                "type": ["object", "null"],
                "properties": {
                    "format": {
                        "type": ["object", "null"],
                        "properties": {"type": {"type": "string", "enum": ["text"]}},
                    }
                },
            }
        ),
    ] = None
    tools: Annotated[list[Any] | None, WithJsonSchema({"type": ["array", "null"], "maxItems": 0})] = None
    tool_choice: Annotated[Any, WithJsonSchema({"enum": ["none", "auto", None]})] = None
    reasoning: Annotated[
        dict[str, Any] | None,
        WithJsonSchema({"type": ["object", "null"], "properties": {"effort": {"enum": [None, "none"]}}}),
    ] = None
    # simmer's (llama.cpp's) extras
    seed: integer(ge=SEED_MIN, lt=SEED_MAX + 1) | None = None
    top_k: integer(ge=0) | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    route: Literal["local", "auto", "upstream"] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise _invalid(
                f"previous_response_id cannot be resolved: {STATELESS}; send the earlier turns in `input`",
                "previous_response_id",
            )
        if self.conversation is not None:
            raise _invalid(
                f"conversation cannot be used: {STATELESS}; send the turns in `input`", "conversation"
            )
        if self.prompt is not None:
            raise _invalid(
                f"stored prompts cannot be used: {STATELESS}; send `instructions` and `input`", "prompt"
            )
        if self.background:
            raise _invalid(f"background responses need storage: {STATELESS}", "background")
        fmt = (self.text or {}).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
            raise _invalid(f"text.format other than 'text' {LATER}", "text.format")
        if self.tools:
            raise _invalid(f"tools {LATER}", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise _invalid(f"tool_choice needs tools, which {LATER}", "tool_choice")
        if self.reasoning and self.reasoning.get("effort") not in (None, "none"):
            raise _invalid("reasoning: the served model does not reason", "reasoning.effort")
        for i, name in enumerate(self.include or ()):
            if name != LOGPROBS:
                raise _invalid(
                    f"include[{i}]: only {LOGPROBS!r} can be included, got {name!r}", f"include[{i}]"
                )
        self.messages()  # every input item is checked before any work
        return self

    def messages(self) -> list[dict[str, str]]:
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not items:
            raise _invalid("input must not be empty", "input")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return system + [_message(item, f"input[{i}]") for i, item in enumerate(items)]

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ()) or self.top_logprobs is not None

    def to_openai(self) -> ChatCompletionRequest:
        fields: dict[str, Any] = {"messages": self.messages(), "stream": self.stream}
        names = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "repeat_penalty", "route")
        fields.update({n: getattr(self, n) for n in names if getattr(self, n) is not None})
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        fields["truncate"] = self.truncation == "auto"
        if self.wants_logprobs:
            fields["logprobs"] = True
            fields["top_logprobs"] = self.top_logprobs or 0
        return ChatCompletionRequest.model_validate(fields)


# ---- the response object and its stream events ---------------------------------------------------------


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def text_part(text: str, tokens: list[TokenEvent] | None = None) -> dict[str, Any]:
    logprobs = chat_logprobs(tokens or [])
    return {
        "type": "output_text",
        "text": text,
        "annotations": [],
        "logprobs": logprobs["content"] if logprobs else [],
    }


def message_item(item_id: str, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": parts}


def finish_status(finish: FinishEvent) -> tuple[str, dict[str, str] | None]:
    """completed, or incomplete (the reply hit max_output_tokens or the context)."""
    if finish.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class ResponseObject:
    """Builds the `response` object of one request, the same in the reply and in every stream event."""

    def __init__(self, rid: str, model: str, request: ResponsesRequest) -> None:
        self.rid = rid
        self.item_id = "msg_" + rid.removeprefix("resp_")
        self.model = model
        self.request = request
        self.created_at = int(time.time())

    def build(
        self,
        status: str,
        output: list[dict[str, Any]],
        *,
        usage: Usage | None = None,
        incomplete: dict[str, str] | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        r = self.request
        fmt = (r.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "instructions": r.instructions,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": None,
            "tool_choice": r.tool_choice or "auto",
            "tools": [],
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_logprobs": r.top_logprobs,
            "max_output_tokens": r.max_output_tokens,
            "truncation": r.truncation or "disabled",
            "text": {"format": fmt},
            "reasoning": None,
            "store": False,  # nothing was stored, whatever `store` asked (see the module docstring)
            "background": False,
            "metadata": r.metadata or {},
            "service_tier": r.service_tier or "default",
            "user": r.user,
            "safety_identifier": r.safety_identifier,
            "prompt_cache_key": r.prompt_cache_key,
            "usage": usage_object(usage) if usage is not None else None,
        }

    def final(self, text: str, tokens: list[TokenEvent], finish: FinishEvent) -> dict[str, Any]:
        status, incomplete = finish_status(finish)
        item = message_item(self.item_id, status, [text_part(text, tokens)])
        return self.build(status, [item], usage=finish.usage, incomplete=incomplete)


class EventStream:
    """The `response.*` events of one streamed response, numbered in order (sequence_number)."""

    def __init__(self, response: ResponseObject) -> None:
        self.r = response
        self.seq = 0
        self.text = ""
        self.tokens: list[TokenEvent] = []

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return out

    def opening(self) -> list[dict[str, Any]]:
        r = self.r
        return [
            self.event("response.created", response=r.build("in_progress", [])),
            self.event("response.in_progress", response=r.build("in_progress", [])),
            self.event(
                "response.output_item.added", output_index=0, item=message_item(r.item_id, "in_progress", [])
            ),
            self.event(
                "response.content_part.added",
                item_id=r.item_id,
                output_index=0,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def delta(self, text: str, tokens: list[TokenEvent]) -> dict[str, Any]:
        self.text += text
        self.tokens += tokens
        part = text_part(text, tokens)
        return self.event(
            "response.output_text.delta",
            item_id=self.r.item_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=part["logprobs"],
        )

    def closing(self, finish: FinishEvent) -> list[dict[str, Any]]:
        r = self.r
        part = text_part(self.text, self.tokens)
        status, _ = finish_status(finish)
        final = r.final(self.text, self.tokens, finish)
        return [
            self.event(
                "response.output_text.done",
                item_id=r.item_id,
                output_index=0,
                content_index=0,
                text=self.text,
                logprobs=part["logprobs"],
            ),
            self.event(
                "response.content_part.done", item_id=r.item_id, output_index=0, content_index=0, part=part
            ),
            self.event(
                "response.output_item.done", output_index=0, item=message_item(r.item_id, status, [part])
            ),
            self.event(
                "response.completed" if status == "completed" else "response.incomplete", response=final
            ),
        ]

    def failure(self, code: str, message: str, param: str | None) -> list[dict[str, Any]]:
        r = self.r
        partial = [message_item(r.item_id, "incomplete", [text_part(self.text, self.tokens)])]
        failed = r.build("failed", partial, error={"code": code, "message": message})
        return [
            self.event("error", code=code, message=message, param=param),
            self.event("response.failed", response=failed),
        ]
