"""OpenAI's chat and text completion bodies as the server's one internal request: each validated body
becomes a `Draft` once (server/serving/request.py parses it).

max_completion_tokens (or max_tokens) -> max_tokens; logprobs + top_logprobs -> logprobs (chat),
logprobs (completions); repeat_penalty (llama.cpp) or repetition_penalty (vLLM) -> repetition_penalty;
stop "" -> none; response_format / json_schema / grammar -> the constraint; tools (unless tool_choice
"none") -> the tools. The fields the client set explicitly (`model_fields_set`) are what an upstream may
be sent.
"""

from __future__ import annotations

from typing import Any

from models.types import Tool
from server.api.common.tools import NamedToolChoice, parallel_calls
from server.api.openai.requests import ChatCompletionRequest, CompletionRequest, GenerationBody
from server.serving.keep_alive import parse_keep_alive
from server.serving.request import Asked, ConstraintAsk, Draft, Show, ToolsAsk


def _stop(body: GenerationBody) -> tuple[str, ...]:
    if body.stop is None or body.stop == "":
        return ()
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)


def _constraint(body: GenerationBody) -> ConstraintAsk | None:
    """The grammar asked for (at most one of response_format's JSON types, json_schema and grammar: the
    validator saw to it)."""
    asked = body.constraint_fields()
    rf = body.response_format
    if not asked:
        return None
    if asked[0] == "response_format" and rf is not None and rf.type == "json_object":
        return ConstraintAsk("json_schema", rf.schema_, "response_format")
    if asked[0] == "response_format" and rf is not None and rf.json_schema is not None:
        schema = rf.json_schema.schema_
        return ConstraintAsk("json_schema", {} if schema is None else schema, "response_format")
    if asked[0] == "json_schema":
        return ConstraintAsk("json_schema", body.json_schema, "json_schema")
    return ConstraintAsk("gbnf", body.grammar or "", "grammar")


def _tools(body: ChatCompletionRequest) -> ToolsAsk | None:
    """The tools for the engine (None without tools or with tool_choice "none": plain chat)."""
    if not body.tools or body.tool_choice == "none":
        return None
    choice = body.tool_choice
    name = choice.function.name if isinstance(choice, NamedToolChoice) else (choice or "auto")
    tools = tuple(Tool(t.function.name, t.function.description, t.function.parameters) for t in body.tools)
    parallel = parallel_calls(body.parallel_tool_calls, name)
    params = tuple(f"tools[{i}].function.parameters" for i in range(len(tools)))
    return ToolsAsk(tools, name, parallel, params)


def _plain(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) or (
        isinstance(value, list) and all(isinstance(v, str) for v in value)
    )


# Set explicitly, yet no generation field: the client's identity and secret, simmer's own extensions, and
# what the relay always sets itself.
_NOT_FORWARDED = {
    "user",
    "cache_salt",
    "keep_alive",
    "route",
    "governor_events",
    "wait_for_model",
    "truncate",
    "model",
    "stream",
}


def _upstream(body: GenerationBody) -> tuple[tuple[str, Any], ...]:
    """The generation fields the client set, as it set them (the upstream relay picks what it forwards)."""
    explicit = sorted(body.model_fields_set - _NOT_FORWARDED)
    return tuple((n, getattr(body, n)) for n in explicit if _plain(getattr(body, n, None)))


def _draft(
    body: GenerationBody,
    *,
    kind: Any,
    endpoint: str,
    max_tokens: int | None,
    logprobs: int | None,
    tools: ToolsAsk | None,
    messages: tuple[dict[str, Any], ...] | None = None,
    prompt: str | None = None,
) -> Draft:
    asked = Asked(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repeat_penalty or body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=_stop(body),
        logprobs=logprobs,
        logit_bias=tuple((int(k), v) for k, v in (body.logit_bias or {}).items()),
        ignore_eos=body.ignore_eos,
        truncate=body.truncate,
        constraint=_constraint(body),
        tools=tools,
    )
    show = Show(
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        governor_events=body.governor_events,
    )
    return Draft(
        kind=kind,
        endpoint=endpoint,
        model=body.model,
        messages=messages,
        prompt=prompt,
        asked=asked,
        route=body.route,
        keep_alive_s=parse_keep_alive(body.keep_alive),
        cache_salt=body.cache_salt,
        wait_for_model=body.wait_for_model,
        show=show,
        upstream=_upstream(body),
    )


def chat_draft(body: ChatCompletionRequest) -> Draft:
    """/v1/chat/completions."""
    return _draft(
        body,
        kind="chat",
        endpoint="chat",
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        tools=_tools(body),
        messages=tuple(m.as_dict() for m in body.messages),
    )


def completion_draft(body: CompletionRequest) -> Draft:
    """/v1/completions."""
    return _draft(
        body,
        kind="text",
        endpoint="completions",
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        tools=None,
        prompt=body.prompt_value(),
    )
