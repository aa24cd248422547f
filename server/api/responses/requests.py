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

import re
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
from server.api.common.tools import check_tools

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
    wait_for_model: bool = False  # while the model loads, no smaller model of the ladder starts the reply
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
