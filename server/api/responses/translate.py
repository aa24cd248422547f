"""The Responses API's body as the server's one internal request: the validated body becomes a `Draft` once
(server/serving/request.py parses it). max_output_tokens -> max_tokens; truncation "auto" -> truncate;
include "message.output_text.logprobs" or top_logprobs -> logprobs; repeat_penalty -> repetition_penalty;
text.format -> the constraint (errors name `text.format`); function tools (unless tool_choice "none") ->
the tools (errors name `tools[i].parameters`)."""

from __future__ import annotations

from typing import Any

from models.types import Tool
from server.api.common.tools import parallel_calls
from server.api.responses.requests import FunctionChoice, ResponsesRequest
from server.serving.request import Asked, ConstraintAsk, Draft, Show, ToolsAsk

# what an OpenAI upstream may be sent, under the same names, when the client set it
_SAME = ("temperature", "top_p", "seed", "top_k", "min_p", "repeat_penalty")


def _constraint(body: ResponsesRequest) -> ConstraintAsk | None:
    fmt = body.format
    if fmt.type == "json_object":
        return ConstraintAsk("json_schema", None, "text.format")
    if fmt.type == "json_schema":
        return ConstraintAsk("json_schema", {} if fmt.schema_ is None else fmt.schema_, "text.format")
    return None


def _tools(body: ResponsesRequest) -> ToolsAsk | None:
    if not body.tools or body.tool_choice == "none":
        return None
    choice = body.tool_choice
    name = choice.name if isinstance(choice, FunctionChoice) else (choice or "auto")
    tools = tuple(Tool(t.name, t.description, t.parameters) for t in body.tools)
    parallel = parallel_calls(body.parallel_tool_calls, name)
    return ToolsAsk(tools, name, parallel, tuple(f"tools[{i}].parameters" for i in range(len(tools))))


def draft(body: ResponsesRequest) -> Draft:
    """/v1/responses."""
    logprobs = (body.top_logprobs or 0) if body.wants_logprobs else None
    asked = Asked(
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repeat_penalty,
        seed=body.seed,
        logprobs=logprobs,
        truncate=body.truncation == "auto",
        constraint=_constraint(body),
        tools=_tools(body),
    )
    upstream: dict[str, Any] = {name: getattr(body, name) for name in _SAME}
    upstream["max_tokens"] = body.max_output_tokens
    if body.wants_logprobs:
        upstream |= {"logprobs": True, "top_logprobs": logprobs}
    return Draft(
        kind="chat",
        endpoint="responses",
        model=body.model,
        messages=body.chat_messages,
        asked=asked,
        route=body.route,
        cache_salt=body.cache_salt,
        wait_for_model=body.wait_for_model,
        show=Show(stream=body.stream, governor_events=body.governor_events),
        upstream=tuple((k, v) for k, v in upstream.items() if v is not None),
    )
