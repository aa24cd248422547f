"""Bodies the conformance tests send: a question, a forced tool call, the Responses tools, and one chat
body per reply kind."""

from __future__ import annotations

from tests.server.structured_data import TIME, WEATHER

ASK = [{"role": "user", "content": "Paris?"}]

FORCED = {"tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 1.0, "seed": 3}

RESP_TOOLS = [
    {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
    for t in (WEATHER, TIME)
]

CHATS = {
    "text": {"messages": ASK, "max_tokens": 8},
    "logprobs": {"messages": ASK, "max_tokens": 8, "logprobs": True, "top_logprobs": 3},
    "tool calls": {"messages": ASK, "max_tokens": 300, **FORCED},
    "json": {"messages": ASK, "max_tokens": 60, "response_format": {"type": "json_object"}},
}
