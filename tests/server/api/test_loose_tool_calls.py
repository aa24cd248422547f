"""A call the model wrote its own way under `tool_choice: "auto"` (a fenced JSON block, a bare object) reaches
clients as `tool_calls`, streamed and not, in the OpenAI and Ollama dialects; text stays text. The engine is
the real one on the tiny model, its forward pass scripted (tests/scripted_session.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import sdk
from tests.scripted_session import scripted_engine
from tests.server.structured_data import ASK, TIME, WEATHER

FENCED = (
    "```json\n"
    + json.dumps({"name": "get_weather", "arguments": {"unit": "C", "city": "Paris"}}, indent=2)
    + "\n```"
)
BARE = '{"name": "get_time", "arguments": {"zone": "CET"}}'


MODEL = "tiny-long"


def serve(live, folder, reply: str):
    engine = scripted_engine(folder, reply, context_length=4096)
    assert engine.model_id == MODEL
    return live(engine=engine, model=MODEL)


def ask(srv, **extra):
    return dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=120, **extra)


@pytest.mark.parametrize(
    "reply, call",
    [(FENCED, ("get_weather", '{"city": "Paris", "unit": "C"}')), (BARE, ("get_time", '{"zone": "CET"}'))],
)
def test_auto_when_the_model_writes_its_call_as_json_then_sdk_gets_tool_calls(
    live, tiny_long_model_dir, reply, call
):
    srv = serve(live, tiny_long_model_dir, reply)
    client = sdk(srv)
    full = client.chat.completions.create(**ask(srv))
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (got,) = choice.message.tool_calls
    assert got.id.startswith("call_") and (got.function.name, got.function.arguments) == call

    with client.chat.completions.stream(**ask(srv)) as stream:
        contents = [e for e in stream if e.type == "content.delta"]
        streamed = stream.get_final_completion()
    assert contents == []  # nothing of the JSON was shown as text
    (got,) = streamed.choices[0].message.tool_calls
    assert (got.function.name, got.function.arguments) == call
    assert streamed.choices[0].finish_reason == "tool_calls"


def test_auto_when_streamed_raw_then_first_delta_names_the_call_and_the_next_has_its_arguments(
    live, tiny_long_model_dir
):
    srv = serve(live, tiny_long_model_dir, BARE)
    body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 120, "stream": True}
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert not any(d.get("content") for d in deltas)
    entries = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert entries[0]["id"].startswith("call_") and entries[0]["function"]["name"] == "get_time"
    assert "".join(e["function"].get("arguments", "") for e in entries) == '{"zone": "CET"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "reply",
    [
        '{"name": "Paris", "country": "France"}',  # JSON, not a declared function
        BARE + "\nShall I look it up?",  # a call and prose: text
        '{"name": "get_time", "arguments": {"zone": "Paris"}}',  # fails the pattern ^[A-Z]{3}$
    ],
)
def test_auto_when_the_reply_is_not_exactly_a_valid_call_then_it_is_the_content(
    live, tiny_long_model_dir, reply
):
    srv = serve(live, tiny_long_model_dir, reply)
    full = sdk(srv).chat.completions.create(**ask(srv))
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == reply


def test_auto_when_ollama_chat_then_message_tool_calls(live, tiny_long_model_dir):
    srv = serve(live, tiny_long_model_dir, FENCED)
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "stream": False}
    reply = httpx.post(srv.url + "/api/chat", json=body, timeout=60).json()
    (call,) = reply["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == {"city": "Paris", "unit": "C"}
    assert reply["message"]["content"] == ""


@pytest.mark.parametrize("stream", [False, True])
def test_auto_when_responses_api_then_a_function_call_item(live, tiny_long_model_dir, stream):
    srv = serve(live, tiny_long_model_dir, BARE)
    tools = [{"type": "function", **TIME["function"]}]
    client = sdk(srv)
    if stream:
        with client.responses.stream(model=MODEL, input="time?", tools=tools, max_output_tokens=120) as s:
            reply = s.get_final_response()
    else:
        reply = client.responses.create(model=MODEL, input="time?", tools=tools, max_output_tokens=120)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "CET"}')]
    assert reply.output_text == ""
