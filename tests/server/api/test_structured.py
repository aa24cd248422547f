"""Structured output and tool calls over HTTP with the openai SDK, on a tiny real model (random weights:
what parses below parses because of the grammar). The tiny model here (tiny_long_model_dir, in conftest) has
a 4,096-token context, room for a tools description."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.helpers import sdk
from tests.server.structured_data import ASK, CITY, TIME, WEATHER, Country, structured_server


@pytest.fixture
def srv(live, tiny_long_model_dir):
    return structured_server(live, tiny_long_model_dir)


# ---- response_format --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_response_format_json_schema_when_sdk_then_valid_json(srv, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    reply = sdk(srv).chat.completions.create(
        model=srv.engine.model_id,
        messages=ASK,
        response_format=fmt,
        seed=seed,
        temperature=1.0,
        max_tokens=300,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)


def test_response_format_when_sdk_parse_with_pydantic_model_then_parsed(srv):
    """The SDK's own structured-output helper: strict schema from a pydantic model, parsed back."""
    reply = sdk(srv).chat.completions.parse(
        model=srv.engine.model_id, messages=ASK, response_format=Country, seed=3, max_tokens=400
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Country) and 1 <= len(parsed.rivers) <= 2


def test_response_format_json_object_when_streamed_then_chunks_join_to_json(srv):
    stream = sdk(srv).chat.completions.create(
        model=srv.engine.model_id,
        messages=ASK,
        response_format={"type": "json_object"},
        seed=4,
        max_tokens=300,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:  # a random model can write one long string; cut off, it is incomplete
        assert finish == ["length"] and text.startswith("{")


def test_completions_when_response_format_then_valid_json(srv):
    reply = sdk(srv).completions.create(
        model=srv.engine.model_id,
        prompt="A city:",
        max_tokens=300,
        seed=5,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), CITY)


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ({"grammar": 'root ::= ("yes" | "no") "!"'}, "/v1/completions"),
        ({"json_schema": {"enum": ["red", "green"]}}, "/v1/chat/completions"),
        ({"response_format": {"type": "json_object", "schema": {"enum": [1, 2]}}}, "/v1/chat/completions"),
    ],
)
def test_llama_cpp_extras_when_grammar_or_json_schema_then_followed(srv, extra, path):
    body = {"max_tokens": 50, "seed": 6, **extra}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": ASK})
    with srv.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    assert text in ("yes!", "no!", '"red"', '"green"', "1", "2")


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "uniqueItems",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
        ({"json_schema": {"$ref": "#/nowhere"}}, "json_schema", "nowhere"),
        ({"grammar": "root ::= ("}, "grammar", ""),
        ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar", "cannot be combined"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "tool calls"),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
            "object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
            "uniqueItems",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", ""),
    ],
)
def test_constraint_when_unsupported_or_invalid_then_400_naming_it_and_no_job(srv, extra, param, says):
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_parameter" and err["param"] == param and says in err["message"]
    assert srv.engine.generations == []  # refused before the queue


# ---- tool calls -------------------------------------------------------------------------------------


def test_tool_choice_named_when_sdk_then_call_parses_and_validates(srv):
    reply = sdk(srv).chat.completions.create(
        model=srv.engine.model_id,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        seed=7,
        max_tokens=200,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("seed", [8, 9, 10])
def test_tool_choice_required_when_sdk_then_calls_validate(srv, seed):
    reply = sdk(srv).chat.completions.create(
        model=srv.engine.model_id,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        seed=seed,
        max_tokens=200,
    )
    (call,) = reply.choices[0].message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_call_when_streamed_then_sdk_stream_helper_reassembles_the_same_call(srv):
    kwargs = dict(
        model=srv.engine.model_id,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        seed=11,
        temperature=1.0,
        max_tokens=300,
    )
    client = sdk(srv)
    full = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        streamed = stream.get_final_completion()
    assert len(deltas) > 1  # the arguments came in pieces
    want = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    got = [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls]
    assert got == want and streamed.choices[0].finish_reason == full.choices[0].finish_reason


def test_tool_call_when_streamed_raw_then_first_delta_has_id_and_name(srv):
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "seed": 12, "max_tokens": 200}
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    entries = [tc for chunk in lines for tc in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert entries[0]["id"].startswith("call_") and entries[0]["function"]["name"] == "get_weather"
    assert all("id" not in e and set(e["function"]) == {"arguments"} for e in entries[1:])
    assert lines[-1]["choices"][0]["finish_reason"] in ("tool_calls", "length")


def test_tool_message_when_multi_turn_then_answer(srv):
    client = sdk(srv)
    first = client.chat.completions.create(
        model=srv.engine.model_id,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        seed=13,
        max_tokens=200,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    second = client.chat.completions.create(
        model=srv.engine.model_id,
        messages=messages,
        tools=[WEATHER],
        tool_choice="none",
        seed=14,
        max_tokens=8,
    )
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    prompt = srv.engine.generations[-1].prompt.ids
    text = srv.engine.inner.tokenizer.decode(prompt, skip_special_tokens=False)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text and '"name": "get_weather"' in text


def test_tool_choice_none_when_many_seeds_then_never_calls(srv):
    for seed in range(3):
        reply = sdk(srv).chat.completions.create(
            model=srv.engine.model_id,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="none",
            seed=seed,
            max_tokens=20,
        )
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].finish_reason in ("stop", "length")
    assert all(g.params.tools is None for g in srv.engine.generations)


def test_tool_choice_auto_when_sdk_then_text_or_valid_call(srv):
    kinds = set()
    for seed in range(4):
        reply = sdk(srv).chat.completions.create(
            model=srv.engine.model_id, messages=ASK, tools=[WEATHER], seed=seed, max_tokens=60
        )
        message = reply.choices[0].message
        if message.tool_calls:
            kinds.add("call")
            if reply.choices[0].finish_reason == "tool_calls":
                jsonschema.validate(
                    json.loads(message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"]
                )
        else:
            kinds.add("text")
            assert not message.content.startswith("<tool_call>")
    assert kinds


def test_openapi_when_served_then_documents_the_new_fields(srv):
    doc = httpx.get(srv.url + "/openapi.json").json()
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "json_schema",
        "grammar",
    } <= set(chat)


def test_openapi_when_tool_call_reply_then_it_matches_the_documented_reply(srv):
    """content null, tool_calls and finish_reason "tool_calls" are in the document the campaign checks."""
    doc = httpx.get(srv.url + "/openapi.json").json()
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    body.update(seed=15, max_tokens=200)
    reply = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    root = {"$ref": "#/components/schemas/ChatCompletion", "components": doc["components"]}
    jsonschema.validate(reply, root)
