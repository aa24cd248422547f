"""Function tools as OpenAI has them (Ollama takes the same shape; the Responses API flattens it), the rules
every dialect's tools follow, compile-free (what only compiling finds is the parse's): one function per
name, a named tool_choice among the tools, parameters that describe an object; each dialect passes its own
field paths, so the error names the field as the client wrote it. And a reply's calls, assembled from the
engine's call deltas."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, WithJsonSchema

from models.types import FinishEvent, TokenEvent, ToolCallDelta
from server.api.common.fields import PARAMETERS, STRICT, FunctionName, invalid


def check_tools(
    names: Sequence[str],
    parameters: Sequence[dict[str, Any] | None],
    *,
    choice_given: bool,
    chosen: str | None,
    params_path: Callable[[int], str],
) -> None:
    """`chosen`: the function a named tool_choice names (None: not a named choice)."""
    if len(set(names)) != len(names):
        raise invalid("tools: function names must be unique", "tools")
    if choice_given and not names:
        raise invalid("tool_choice is only allowed when tools are given", "tool_choice")
    if chosen is not None and chosen not in names:
        raise invalid(f"tool_choice names {chosen!r}, which is not among the tools", "tool_choice")
    for i, schema in enumerate(parameters):
        kind = (schema or {}).get("type", "object")
        if kind != "object":
            path = params_path(i)
            raise invalid(f"{path} must describe an object (type 'object'), not {kind!r}", path)


class FunctionSpec(BaseModel):
    model_config = STRICT

    name: FunctionName
    description: str | None = None
    # A JSON schema of the arguments object (absent: any object). Unsupported keywords: 400.
    parameters: Annotated[dict[str, Any] | None, WithJsonSchema(PARAMETERS)] = None
    strict: bool | None = None  # calls always follow the schema (simmer constrains them)


class ToolSpec(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(BaseModel):
    model_config = STRICT

    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: ChosenFunction


def check_openai_tools(
    tools: list[ToolSpec] | None, choice: Literal["none", "auto", "required"] | NamedToolChoice | None
) -> None:
    """OpenAI's tools (and Ollama's, which are OpenAI's): the shared rules, named in OpenAI's paths."""
    check_tools(
        [t.function.name for t in tools or ()],
        [t.function.parameters for t in tools or ()],
        choice_given=choice is not None,
        chosen=choice.function.name if isinstance(choice, NamedToolChoice) else None,
        params_path=lambda i: f"tools[{i}].function.parameters",
    )


def call_deltas(tokens: list[TokenEvent], finish: FinishEvent | None = None) -> list[ToolCallDelta]:
    return [d for ev in tokens for d in ev.tool_calls] + list(finish.tool_calls if finish else ())


def assemble_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """OpenAI message.tool_calls from the engine's call deltas (arguments: JSON text; incomplete when
    max_tokens cut the call short, finish_reason "length")."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(
            d.index, {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        )
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def parallel_calls(asked: bool | None, choice: str) -> bool:
    """Whether a reply may make more than one call. OpenAI's forced function is one call: a named
    `tool_choice` gives exactly one unless the request sets `parallel_tool_calls: true` itself ("required"
    and "auto" keep one or more by default). Left open, a small model called the named function up to three
    times, identically, and an instructor-style client that reads one call broke."""
    if asked is not None:
        return asked
    return choice in ("auto", "required")
