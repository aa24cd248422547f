"""Ollama's /api/chat and /api/generate bodies as the server's one internal request: each validated body
becomes a `Draft` once (server/serving/request.py parses it), in simmer's names:

    options.temperature/top_k/top_p/min_p/seed/stop/presence_penalty/frequency_penalty -> the same names;
        seed -1 -> a fresh draw (Ollama's "random"), any other int64 is a seed
    options.repeat_penalty -> repetition_penalty
    options.num_predict  > 0 -> max_tokens;  <= 0 (-1 "until a stop", -2 "fill the context") -> no cap
    truncate (default true, as Ollama) -> simmer's sliding window over the conversation
    logprobs (+ top_logprobs) -> logprobs
    format "json" -> any JSON object;  format {schema} -> that schema (errors name `format`)
    tools (unless tool_choice "none") -> the tools
    keep_alive -> seconds

What an OpenAI upstream may be sent is recorded in OpenAI's names (`num_predict` -> `max_tokens`;
`repeat_penalty` stays, llama.cpp's server knows that spelling).
"""

from __future__ import annotations

from typing import Any

from models.types import Tool
from server.api.common.tools import NamedToolChoice, parallel_calls
from server.api.ollama.requests import OllamaChatRequest, OllamaGenerateRequest, OllamaOptions, OllamaTurn
from server.serving.request import Asked, ConstraintAsk, Draft, Kind, Show, ToolsAsk

# options applied as they are named (the rest is repetition_penalty, seed, stop and num_predict)
_SAME = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty")


def _constraint(body: OllamaTurn) -> ConstraintAsk | None:
    if body.format in (None, ""):
        return None
    if body.format == "json":
        return ConstraintAsk("json_schema", None, "format")
    return ConstraintAsk("json_schema", body.format, "format")


def _tools(body: OllamaChatRequest) -> ToolsAsk | None:
    if not body.tools or body.tool_choice == "none":
        return None
    choice = body.tool_choice
    name = choice.function.name if isinstance(choice, NamedToolChoice) else (choice or "auto")
    tools = tuple(Tool(t.function.name, t.function.description, t.function.parameters) for t in body.tools)
    params = tuple(f"tools[{i}].function.parameters" for i in range(len(tools)))
    return ToolsAsk(tools, name, parallel_calls(None, name), params)


def _draft(
    body: OllamaTurn,
    *,
    kind: Kind,
    endpoint: str,
    messages: tuple[dict[str, Any], ...] | None = None,
    prompt: str | None = None,
    tools: ToolsAsk | None = None,
) -> Draft:
    options = body.options or OllamaOptions()
    options.log_unapplied()
    same = {name: getattr(options, name) for name in _SAME}
    seed = None if options.seed == -1 else options.seed  # -1 is Ollama's (and llama.cpp's) "random"
    stop = (
        () if not options.stop else (options.stop,) if isinstance(options.stop, str) else tuple(options.stop)
    )
    max_tokens = options.num_predict if options.num_predict is not None and options.num_predict > 0 else None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    truncate = body.truncate is not False  # Ollama truncates unless told not to
    asked = Asked(
        max_tokens=max_tokens,
        repetition_penalty=options.repeat_penalty,
        seed=seed,
        stop=stop,
        logprobs=logprobs,
        truncate=truncate,
        constraint=_constraint(body),
        tools=tools,
        **same,
    )
    upstream: dict[str, Any] = {**same, "repeat_penalty": options.repeat_penalty, "seed": seed}
    upstream |= {"stop": list(stop) or None, "max_tokens": max_tokens}
    if body.logprobs and kind == "text":
        upstream["logprobs"] = logprobs
    elif body.logprobs:
        upstream |= {"logprobs": True, "top_logprobs": body.top_logprobs}
    return Draft(
        kind=kind,
        endpoint=endpoint,
        model=body.model_id,
        messages=messages,
        prompt=prompt,
        asked=asked,
        route=body.route,
        keep_alive_s=body.keep_alive_s(),
        show=Show(stream=body.stream),
        upstream=tuple((k, v) for k, v in upstream.items() if v is not None),
    )


def chat_draft(body: OllamaChatRequest) -> Draft:
    """/api/chat."""
    messages = tuple(m.as_dict() for m in body.messages)
    return _draft(body, kind="chat", endpoint="api/chat", messages=messages, tools=_tools(body))


def generate_draft(body: OllamaGenerateRequest, *, as_chat: bool) -> Draft:
    """/api/generate: the prompt as a user turn (system first) for a model that chats; as written (raw),
    or continued as text by a base model (no chat template), system first, as `ollama run` does."""
    if as_chat:
        return _draft(body, kind="chat", endpoint="api/generate", messages=tuple(body.chat_messages()))
    prompt = body.prompt if body.raw else body.plain_text()
    return _draft(body, kind="text", endpoint="api/generate", prompt=prompt)
