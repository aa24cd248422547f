"""OpenAI's Responses API on the wire (POST /v1/responses), stateless as Ollama has it.

`input` is a string or a list of message items ({"role", "content"} with "type": "message" optional;
content a string or input_text / output_text parts), `instructions` becomes a system message in front.
The input items are read once, by the validator (`chat_messages`); translate.py turns the body into the
internal request: max_output_tokens -> max_tokens, truncation "auto" -> simmer's sliding window,
top_logprobs (with include "message.output_text.logprobs") -> logprobs, temperature/top_p and simmer's
extras as they are.

Structured output and tool calls: `text.format` (json_object, or json_schema with its `schema` flat in the
format object) is the reply's grammar; function `tools` ({"type": "function", "name", "parameters"}),
`tool_choice` ("none", "auto", "required", {"type": "function", "name"}) and `parallel_tool_calls` as chat
has them. Input items of type function_call become the assistant turn's tool_calls (consecutive calls one
turn), function_call_output items `tool` messages. Chat's rules apply, and their errors name the Responses
API's field (`text.format`, `tools[0].parameters`). Calls come back as output items of type function_call
(call_id, name, arguments as JSON text).

Nothing is stored: `previous_response_id`, `conversation`, a stored `prompt` and `background` (all need
server-side state) are a 400 saying so; `store` is accepted and the response says `"store": false`, which
is what happened.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from models.types import FinishEvent, TokenEvent, ToolCallDelta, Usage
from server.api.common.fields import (
    MAX_INPUTS,
    MAX_TOOLS,
    PARAMETERS,
    SCHEMA_OBJECT,
    STRICT,
    FunctionName,
    MaxTokens,
    MinP,
    RepetitionPenalty,
    RouteMode,
    Seed,
    StrictBody,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    invalid,
)
from server.api.common.logprobs import chat_logprobs
from server.api.common.tools import assemble_calls, call_deltas, check_tools

STATELESS = "simmer's Responses API is stateless: no response is stored"
HOSTED = "only function tools are served (OpenAI's hosted tools run on OpenAI's servers)"
LOGPROBS = "message.output_text.logprobs"
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"  # a function's name, and a json_schema format's (as chat's)
FUNCTION_NAME = re.compile(NAME_PATTERN)

_CONTENT = {
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
}
_INPUT = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "type": {"type": "string", "enum": ["message"]},
                            "role": {"type": "string", "enum": list(ROLES)},
                            "content": _CONTENT,
                        },
                    },
                    {
                        "type": "object",
                        "required": ["type", "call_id", "name", "arguments"],
                        "properties": {
                            "type": {"const": "function_call"},
                            "call_id": {"type": "string"},
                            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                            "arguments": {"type": "string"},
                        },
                    },
                    {
                        "type": "object",
                        "required": ["type", "call_id", "output"],
                        "properties": {
                            "type": {"const": "function_call_output"},
                            "call_id": {"type": "string"},
                            "output": _CONTENT,
                        },
                    },
                ]
            },
        },
    ]
}


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined; anything else is a 400 naming where it is."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise invalid(f"{at} must be a content part object", at)
        if part.get("type") not in TEXT_PARTS:
            raise invalid(
                f"{at}.type must be input_text or output_text (the served model reads text only), "
                f"got {part.get('type')!r}",
                f"{at}.type",
            )
        if not isinstance(part.get("text"), str):
            raise invalid(f"{at}.text must be a string", f"{at}.text")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _message(item: Any, where: str) -> dict[str, Any]:
    """One input item as a chat message (a function_call item: an assistant turn with that call); anything
    else is a 400 naming where it is."""
    if not isinstance(item, dict):
        raise invalid(f"{where} must be a message object {{'role', 'content'}}", where)
    kind = item.get("type", "message")
    if kind == "function_call":
        name = _string(item, "name", where)
        if not FUNCTION_NAME.fullmatch(name):
            raise invalid(f"{where}.name must be 1-64 letters, digits, '_' or '-'", f"{where}.name")
        call = {
            "id": _string(item, "call_id", where),
            "type": "function",
            "function": {"name": name, "arguments": _string(item, "arguments", where)},
        }
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    if kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        return {
            "role": "tool",
            "tool_call_id": call_id,
            "content": _text(item.get("output"), f"{where}.output"),
        }
    if kind != "message":
        if kind == "item_reference":
            raise invalid(f"{where}: item references need stored items; {STATELESS}", f"{where}.type")
        raise invalid(
            f"{where}.type must be message, function_call or function_call_output, got {kind!r}",
            f"{where}.type",
        )
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    text = _text(item.get("content"), f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _joined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive function_call items (and the assistant text before them) as one assistant turn, as a
    chat request has them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        prev = out[-1] if out else None
        if m.get("tool_calls") and prev is not None and prev["role"] == "assistant":
            out[-1] = {**prev, "tool_calls": [*prev.get("tool_calls", ()), *m["tool_calls"]]}
        else:
            out.append(m)
    return out


class TextFormat(BaseModel):
    """text.format: the chat request's response_format with the json_schema fields flat in it."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None  # OpenAI requires it; simmer does not need it
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, WithJsonSchema(SCHEMA_OBJECT)] = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class ResponseText(BaseModel):
    model_config = STRICT

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a small model is brief anyway


class FunctionTool(BaseModel):
    model_config = STRICT

    type: Annotated[str, WithJsonSchema({"const": "function"})]
    name: FunctionName
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, WithJsonSchema(PARAMETERS)] = None
    strict: bool | None = None  # calls always follow the schema (simmer constrains them)

    def echo(self) -> dict[str, Any]:
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": True if self.strict is None else self.strict,
        }


class FunctionChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    name: FunctionName


_WITH_TOOLS = {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}


class ResponsesRequest(StrictBody):
    # a tool_choice that calls needs tools; text.format other than text with tools is refused
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {
                        "properties": {"tool_choice": {"not": {"enum": ["none", "auto", None]}}},
                        "required": ["tool_choice"],
                    },
                    "then": _WITH_TOOLS,
                },
                {
                    "if": _WITH_TOOLS,
                    "then": {
                        "properties": {
                            "text": {
                                "anyOf": [
                                    {"type": "null"},
                                    {
                                        "type": "object",
                                        "properties": {
                                            "format": {
                                                "anyOf": [
                                                    {"type": "null"},
                                                    {
                                                        "type": "object",
                                                        "properties": {"type": {"const": "text"}},
                                                    },
                                                ]
                                            }
                                        },
                                    },
                                ]
                            }
                        }
                    },
                },
            ]
        }
    )

    COUNTS: ClassVar[dict[str, int]] = {"input": MAX_INPUTS, "tools": MAX_TOOLS, "include": MAX_INPUTS}

    model: str | None = None
    input: Annotated[str | list[Any], WithJsonSchema(_INPUT)]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
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
    text: ResponseText | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    reasoning: Annotated[
        dict[str, Any] | None,
        WithJsonSchema({"type": ["object", "null"], "properties": {"effort": {"enum": [None, "none"]}}}),
    ] = None
    # simmer's (llama.cpp's) extras
    seed: Seed | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repeat_penalty: RepetitionPenalty | None = None
    route: RouteMode | None = None
    governor_events: bool = False  # opt in to chat's `event: governor` SSE events (SDKs would choke on them)
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256
    )  # as chat's (server/serving/cache_scope.py)
    _messages: tuple[dict[str, Any], ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise invalid(
                f"previous_response_id cannot be resolved: {STATELESS}; send the earlier turns in `input`",
                "previous_response_id",
            )
        if self.conversation is not None:
            raise invalid(
                f"conversation cannot be used: {STATELESS}; send the turns in `input`", "conversation"
            )
        if self.prompt is not None:
            raise invalid(
                f"stored prompts cannot be used: {STATELESS}; send `instructions` and `input`", "prompt"
            )
        if self.background:
            raise invalid(f"background responses need storage: {STATELESS}", "background")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise invalid("tool_choice needs tools", "tool_choice")
        if self.reasoning and self.reasoning.get("effort") not in (None, "none"):
            raise invalid("reasoning: the served model does not reason", "reasoning.effort")
        for i, name in enumerate(self.include or ()):
            if name != LOGPROBS:
                raise invalid(
                    f"include[{i}]: only {LOGPROBS!r} can be included, got {name!r}", f"include[{i}]"
                )
        self._messages = self._read_input()  # every input item is checked (and read) once, before any work
        name = self.format.name if self.format.type == "json_schema" else None
        if name is not None and not FUNCTION_NAME.fullmatch(name):  # as chat's json_schema name
            raise invalid(
                f"text.format.name: String should match pattern {NAME_PATTERN!r}", "text.format.name"
            )
        if self.tools:
            check_tools(
                [t.name for t in self.tools],
                [t.parameters for t in self.tools],
                choice_given=self.tool_choice is not None,
                chosen=self.tool_choice.name if isinstance(self.tool_choice, FunctionChoice) else None,
                params_path=lambda i: f"tools[{i}].parameters",
            )
            if self.tool_choice != "none" and self.format.type != "text":
                raise invalid(
                    "text.format cannot be combined with tool calls (use tool_choice 'none')", "text.format"
                )
        return self

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise invalid(f"tools[{i}].type {kind!r}: {HOSTED}", f"tools[{i}].type")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise invalid(
                f"tool_choice {choice.get('type')!r}: choose 'none', 'auto', 'required' or "
                f"{{'type': 'function', 'name': ...}}; {HOSTED}",
                "tool_choice",
            )
        return choice

    def _read_input(self) -> tuple[dict[str, Any], ...]:
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not items:
            raise invalid("input must not be empty", "input")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return tuple(_joined(system + [_message(item, f"input[{i}]") for i, item in enumerate(items)]))

    @property
    def chat_messages(self) -> tuple[dict[str, Any], ...]:
        """The input items (and instructions) as chat messages, read once by the validator."""
        return self._messages

    @property
    def format(self) -> TextFormat:
        return (self.text.format if self.text else None) or TextFormat()

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ()) or self.top_logprobs is not None


# ---- the response object and its stream events ---------------------------------------------------------


def usage_object(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_tokens": usage.prompt_tokens,
        # cache_write_tokens: the prompt tokens prefilled this time, which the prefix cache then keeps
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": max(0, usage.prompt_tokens - usage.cached_tokens),
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }
    if usage.by_model:  # simmer: output tokens per model, as chat's usage.models (the governor moves replies)
        body["models"] = dict(usage.by_model)
    return body


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


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """A function_call output item from an assembled chat call (assemble_calls in api/common/tools.py)."""
    function = call["function"]
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
    }


def _complete(arguments: str) -> bool:
    """A call's arguments are a whole JSON object (one cut by max_output_tokens is not)."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def finish_status(finish: FinishEvent) -> tuple[str, dict[str, str] | None]:
    """completed, or incomplete (the reply hit max_output_tokens or the context)."""
    if finish.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class ResponseObject:
    """Builds the `response` object of one request, the same in the reply and in every stream event.
    `model` is the model producing the reply now: the governor may place it on another model, or move it to
    another mid-way; the finished response names the model that finished it."""

    def __init__(self, rid: str, model: str, request: ResponsesRequest) -> None:
        self.rid = rid
        self.item_id = "msg_" + rid.removeprefix("resp_")
        self.model = model
        self.request = request
        self.created_at = int(time.time())

    def call_id(self, index: int) -> str:
        """The output item id of call `index` (its call_id is the engine's call_...)."""
        return f"fc_{self.rid.removeprefix('resp_')}_{index}"

    def build(
        self,
        status: str,
        output: list[dict[str, Any]],
        *,
        usage: Usage | None = None,
        incomplete: dict[str, str] | None = None,
        error: dict[str, str] | None = None,
        finish: FinishEvent | None = None,
    ) -> dict[str, Any]:
        """`finish` (the reply's end) adds simmer's window flags, as the OpenAI bodies have them."""
        r = self.request
        choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, BaseModel) else r.tool_choice
        window = {"truncated": finish.truncated, "summarized": finish.summarized} if finish else {}
        body: dict[str, Any] = {
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
            "tool_choice": choice or "auto",
            "tools": [t.echo() for t in r.tools or ()],
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_logprobs": r.top_logprobs,
            "max_output_tokens": r.max_output_tokens,
            "truncation": r.truncation or "disabled",
            "text": {"format": r.format.echo()},
            "reasoning": None,
            "store": False,  # nothing was stored, whatever `store` asked (see the module docstring)
            "background": False,
            "metadata": r.metadata or {},
            "service_tier": r.service_tier or "default",
            "safety_identifier": r.safety_identifier,
            "prompt_cache_key": r.prompt_cache_key,
            **window,
        }
        # Optional in OpenAI's spec and never null there: left out until known (`user` unless sent).
        if r.user is not None:
            body["user"] = r.user
        if usage is not None:
            body["usage"] = usage_object(usage)
        return body

    def output(self, text: str, tokens: list[TokenEvent], calls: list[dict[str, Any]], status: str) -> list:
        """The output items: the message (when there is text, or nothing else), then one per call."""
        items = []
        if text or not calls:
            items.append(message_item(self.item_id, status, [text_part(text, tokens)]))
        for i, call in enumerate(calls):
            done = "completed" if _complete(call["function"]["arguments"]) else "incomplete"
            items.append(call_item(self.call_id(i), call, done))
        return items

    def final(self, text: str, tokens: list[TokenEvent], finish: FinishEvent) -> dict[str, Any]:
        self.model = finish.model_id or self.model
        status, incomplete = finish_status(finish)
        calls = assemble_calls(call_deltas(tokens, finish))
        output = self.output(text, tokens, calls, status)
        return self.build(status, output, usage=finish.usage, incomplete=incomplete, finish=finish)


class EventStream:
    """The `response.*` events of one streamed response, numbered in order (sequence_number).

    Output items open as they come, one at a time: each is closed (its `.done` events, then
    response.output_item.done) before the next opens, as OpenAI's stream does. Without tools the message
    opens at once (an empty reply is an empty message); with tools the message opens at its first text and
    each call at its first delta (its arguments then stream as response.function_call_arguments.delta), so a
    reply that is only calls has no message, as in the reply that is not streamed. No text delta is empty:
    the logprobs of tokens that showed nothing yet go with the next one."""

    def __init__(self, response: ResponseObject) -> None:
        self.r = response
        self.seq = 0
        self.text = ""
        self.tokens: list[TokenEvent] = []  # the message's tokens sent so far (its logprobs)
        self.pending: list[TokenEvent] = []  # text tokens whose text has not gone out yet
        self.message_at: int | None = None  # the message's output_index, once open
        self.calls: dict[int, int] = {}  # call index -> output_index
        self.deltas: list[ToolCallDelta] = []
        self.opened = 0  # output items so far
        self.current: int | None = None  # the output_index of the item open now
        self.closed: dict[int, dict[str, Any]] = {}  # output_index -> the item as its output_item.done said

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return out

    def opening(self) -> list[dict[str, Any]]:
        r = self.r
        events = [
            self.event("response.created", response=r.build("in_progress", [])),
            self.event("response.in_progress", response=r.build("in_progress", [])),
        ]
        if not r.request.tools:
            events += self._open_message()
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        r = self.r
        self.message_at, self.opened = self.opened, self.opened + 1
        self.current = self.message_at
        return [
            self.event(
                "response.output_item.added",
                output_index=self.message_at,
                item=message_item(r.item_id, "in_progress", []),
            ),
            self.event(
                "response.content_part.added",
                item_id=r.item_id,
                output_index=self.message_at,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def delta(self, text: str, tokens: list[TokenEvent], finish: FinishEvent | None = None) -> list[dict]:
        """The events of one batch of tokens: text deltas, then call deltas."""
        events: list[dict[str, Any]] = []
        deltas = call_deltas(tokens, finish)
        self.pending += [ev for ev in tokens if not ev.tool_calls]
        if text:
            if self.message_at is None:
                events += self._close_current("completed")
                events += self._open_message()
            self.text += text
            sent, self.pending = self.pending, []
            self.tokens += sent
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self.r.item_id,
                    output_index=self.message_at,
                    content_index=0,
                    delta=text,
                    logprobs=text_part(text, sent)["logprobs"],
                )
            )
        for d in deltas:
            self.deltas.append(d)
            if d.index not in self.calls:
                events += self._close_current("completed")
                self.calls[d.index], self.opened = self.opened, self.opened + 1
                self.current = self.calls[d.index]
                call = {"id": d.id, "function": {"name": d.name, "arguments": ""}}
                item = call_item(self.r.call_id(d.index), call, "in_progress")
                events.append(
                    self.event("response.output_item.added", output_index=self.calls[d.index], item=item)
                )
            if d.arguments:
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self.r.call_id(d.index),
                        output_index=self.calls[d.index],
                        delta=d.arguments,
                    )
                )
        return events

    def _item(self, index: int, status: str) -> dict[str, Any]:
        """The item at output_index `index` as it stands (a message: `status`; a call: completed when its
        arguments are a whole object)."""
        if index == self.message_at:
            return message_item(self.r.item_id, status, [self._part()])
        call_index = next(i for i, at in self.calls.items() if at == index)
        call = assemble_calls([d for d in self.deltas if d.index == call_index])[0]
        done = "completed" if _complete(call["function"]["arguments"]) else "incomplete"
        return call_item(self.r.call_id(call_index), call, done)

    def _close_current(self, status: str) -> list[dict[str, Any]]:
        """The `.done` events of the item open now (none when none is)."""
        index, self.current = self.current, None
        if index is None:
            return []
        if index == self.message_at:
            self.tokens += self.pending
            self.pending = []
        item = self._item(index, status)
        self.closed[index] = item
        r = self.r
        if item["type"] == "message":
            part = self._part()
            events = [
                self.event(
                    "response.output_text.done",
                    item_id=r.item_id,
                    output_index=index,
                    content_index=0,
                    text=self.text,
                    logprobs=part["logprobs"],
                ),
                self.event(
                    "response.content_part.done",
                    item_id=r.item_id,
                    output_index=index,
                    content_index=0,
                    part=part,
                ),
            ]
        else:
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        return [*events, self.event("response.output_item.done", output_index=index, item=item)]

    def moved(self, model: str | None, switch: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The reply runs on `model` from now on (the worker started it on another model than the one
        asked for, or the governor moved it mid-way): a response.in_progress naming it, with the output as
        it stands (and simmer's `switch`: old, new, reason, tokens_before). Nothing when it is the same."""
        if not model or model == self.r.model:
            return []
        self.r.model = model
        extra = {"switch": switch} if switch else {}
        output = self._output("in_progress")
        return [self.event("response.in_progress", response=self.r.build("in_progress", output), **extra)]

    def _output(self, status: str) -> list[dict[str, Any]]:
        """Every item opened so far, in output order: the closed ones as they were closed, the open one with
        `status`."""
        items = dict(self.closed)
        if self.current is not None:
            items[self.current] = self._item(self.current, status)
        return [items[i] for i in sorted(items)]

    def _part(self) -> dict[str, Any]:
        return text_part(self.text, self.tokens)

    def closing(self, finish: FinishEvent) -> list[dict[str, Any]]:
        r = self.r
        events: list[dict[str, Any]] = []
        if self.message_at is None and not self.calls:  # nothing came: an empty message, as not streamed
            events += self._open_message()
        status, incomplete = finish_status(finish)
        events += self._close_current(status)
        r.model = finish.model_id or r.model
        final = r.build(
            status, self._output(status), usage=finish.usage, incomplete=incomplete, finish=finish
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=final)]

    def failure(self, code: str, message: str, param: str | None, kind: str) -> list[dict[str, Any]]:
        """The `error` event names simmer's code; the failed response's `error.code` is one of the codes
        OpenAI's spec lists for it: `invalid_prompt` for a request the server refused, else `server_error`."""
        listed = "invalid_prompt" if kind == "invalid_request_error" else "server_error"
        error = {"code": listed, "message": message}
        failed = self.r.build("failed", self._output("incomplete"), error=error)
        return [
            self.event("error", code=code, message=message, param=param),
            self.event("response.failed", response=failed),
        ]
