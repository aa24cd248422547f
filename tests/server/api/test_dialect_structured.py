"""Structured output and tool calls in the other dialects: Ollama's `format` and `tools` with Ollama's own
client, the Responses API's `text.format` and function tools with the openai SDK's client.responses. On the
tiny real model (random weights, tiny_long_model_dir in conftest): what parses parses because of the
grammar. The engine is the one /v1/chat/completions uses (tests/server/api/test_structured.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from models.runtime.engine import load_engine
from tests.helpers import sdk
from tests.server.fakes import RecordingEngine
from tests.server.structured_data import ASK, CITY, TIME, WEATHER, WEATHER_PARAMS, Country, structured_server


@pytest.fixture
def srv(live, tiny_long_model_dir):
    return structured_server(live, tiny_long_model_dir)


def ollama_client(srv) -> ollama.Client:
    return ollama.Client(host=srv.url, timeout=60)


def ndjson(response: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line]


def prompt_text(srv) -> str:
    ids = srv.engine.generations[-1].prompt.ids
    return srv.engine.inner.tokenizer.decode(ids, skip_special_tokens=False)


# ---- Ollama: format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_ollama_format_schema_when_client_chats_then_valid_json(srv, seed):
    r = ollama_client(srv).chat(
        model=srv.engine.model_id,
        messages=ASK,
        format=CITY,
        options={"seed": seed, "temperature": 1.0, "num_predict": 300},
        stream=False,
    )
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), CITY)
    grammar = srv.engine.generations[-1].params.grammar
    assert grammar is not None and '"maxLength": 10' in grammar  # the schema went to the sampler


def test_ollama_format_when_pydantic_schema_as_ollama_documents_then_it_validates(srv):
    """Ollama's documented pattern: format=Model.model_json_schema(), then Model.model_validate_json."""
    r = ollama_client(srv).chat(
        model=srv.engine.model_id,
        messages=ASK,
        format=Country.model_json_schema(),
        options={"seed": 3, "num_predict": 400},
    )
    country = Country.model_validate_json(r.message.content)
    assert 1 <= len(country.rivers) <= 2


def test_ollama_format_json_when_client_streams_then_parts_join_to_a_json_object(srv):
    parts = list(
        ollama_client(srv).chat(
            model=srv.engine.model_id,
            messages=ASK,
            format="json",
            options={"seed": 4, "temperature": 1.0, "num_predict": 200},
            stream=True,
        )
    )
    assert len(parts) > 2 and parts[-1].done
    if parts[-1].done_reason == "stop":
        assert isinstance(json.loads("".join(p.message.content for p in parts)), dict)
    else:  # cut by num_predict: still the start of one object
        assert "".join(p.message.content for p in parts).startswith("{")


def test_ollama_generate_format_when_client_then_valid_json(srv):
    r = ollama_client(srv).generate(
        model=srv.engine.model_id, prompt="A city:", format=CITY, options={"seed": 5, "num_predict": 300}
    )
    jsonschema.validate(json.loads(r.response), CITY)


def test_ollama_format_when_unsupported_schema_then_ollama_error_naming_format_and_no_job(srv):
    with pytest.raises(ollama.ResponseError) as err:
        ollama_client(srv).chat(
            model=srv.engine.model_id, messages=ASK, format={"type": "array", "uniqueItems": True}
        )
    assert err.value.status_code == 400
    assert err.value.error.startswith("format: unsupported or invalid") and "uniqueItems" in err.value.error
    assert srv.engine.generations == []


# ---- Ollama: tools ----------------------------------------------------------------------------------


def forced(srv, stream: bool, seed: int, **extra: Any) -> dict:
    body = {
        "model": srv.engine.model_id,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",  # simmer's extra: a random-weight model calls nothing by itself
        "options": {"seed": seed, "temperature": 1.0, "num_predict": 300},
        "stream": stream,
        **extra,
    }
    return body


def test_ollama_forced_call_when_not_streamed_then_ollamas_tool_calls_with_object_arguments(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        raw = c.post(
            "/api/chat",
            json=forced(
                srv, False, seed=8, tool_choice={"type": "function", "function": {"name": "get_weather"}}
            ),
        ).json()
    reply = ollama.ChatResponse.model_validate(raw)  # what Ollama's client makes of the body
    assert reply.done and reply.done_reason == "stop" and reply.message.content == ""
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), WEATHER_PARAMS)
    wire_call = raw["message"]["tool_calls"][0]
    assert wire_call["id"].startswith("call_") and wire_call["function"]["index"] == 0
    assert isinstance(wire_call["function"]["arguments"], dict)  # an object, not JSON text as in OpenAI's


def test_ollama_forced_calls_when_streamed_then_whole_calls_equal_to_the_unstreamed_reply(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        whole = c.post("/api/chat", json=forced(srv, False, seed=9)).json()
        with c.stream("POST", "/api/chat", json=forced(srv, True, seed=9)) as r:
            lines = ndjson(r)
    parts = [ollama.ChatResponse.model_validate(line) for line in lines]
    streamed = [call for p in parts for call in p.message.tool_calls or ()]
    want = whole["message"]["tool_calls"]
    assert want and [c.model_dump(exclude_none=True) for c in streamed] == [
        {"function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}} for c in want
    ]
    assert [
        line["message"]["tool_calls"][0]["function"]["index"]
        for line in lines
        if "tool_calls" in line["message"]
    ] == list(range(len(want)))
    schemas = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
    for call in streamed:
        jsonschema.validate(dict(call.function.arguments), schemas[call.function.name])
    assert parts[-1].done and parts[-1].done_reason == whole["done_reason"]


def get_weather(city: str, unit: str) -> str:
    """The weather in a city.

    Args:
      city: The city
      unit: C or F
    """
    return "18 C, sunny"


def test_ollama_tool_turns_when_client_sends_a_call_and_its_result_then_both_in_the_prompt(srv):
    """The round trip as Ollama's client does it: a Python function as the tool, the reply's call sent back,
    then the tool's answer as a `tool` message."""
    client = ollama_client(srv)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        body = forced(srv, False, seed=10, tools=[WEATHER], tool_choice="required")
        first = ollama.ChatResponse.model_validate(c.post("/api/chat", json=body).json())
    call = first.message.tool_calls[0]
    second = client.chat(
        model=srv.engine.model_id,
        messages=[
            *ASK,
            first.message,
            {"role": "tool", "content": get_weather(**call.function.arguments), "tool_name": "get_weather"},
        ],
        tools=[get_weather],
        options={"seed": 11, "num_predict": 8},
    )
    assert second.done
    prompt = prompt_text(srv)
    arguments = json.dumps(dict(call.function.arguments))
    assert f'{{"name": "get_weather", "arguments": {arguments}}}' in prompt  # the call, as the model wrote it
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt.split("<tools>\n")[1]  # the tools described, from the function
    assert srv.engine.generations[-1].params.tools.choice == "auto"  # Ollama's (no tool_choice given)


def test_ollama_show_when_the_model_has_a_chat_template_then_it_lists_tools(srv):
    shown = ollama_client(srv).show(srv.engine.model_id)
    assert shown.capabilities == ["completion", "tools"]


def test_call_collector_when_deltas_arrive_then_each_call_once_whole_and_a_cut_call_never():
    from models.types import ToolCallDelta
    from server.api.ollama.render import CallCollector, ollama_calls

    first = [ToolCallDelta(0, "call_a", "f", ""), ToolCallDelta(0, None, None, '{"x": [1, ')]
    rest = [ToolCallDelta(0, None, None, "2]}"), ToolCallDelta(1, "call_b", "g", '{"y": "}')]
    collector = CallCollector()
    assert collector.add(first) == []  # the arguments object is not complete yet
    done = {"id": "call_a", "function": {"index": 0, "name": "f", "arguments": {"x": [1, 2]}}}
    assert [call.model_dump() for call in collector.add(rest)] == [done]
    assert collector.add([]) == [] and collector.add([ToolCallDelta(1, None, None, "")]) == []
    # the call cut short (num_predict) is left out
    assert [call.model_dump() for call in ollama_calls(first + rest)] == [done]


# ---- the Responses API: text.format and function tools ------------------------------------------------


RESP_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather",
    "parameters": WEATHER_PARAMS,
}
RESP_TIME = {"type": "function", "name": "get_time", "parameters": TIME["function"]["parameters"]}


@pytest.mark.parametrize("seed", [1, 2])
def test_responses_text_format_json_schema_when_sdk_then_valid_json(srv, seed):
    r = sdk(srv).responses.create(
        model=srv.engine.model_id,
        input="Paris?",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        temperature=1.0,
        max_output_tokens=300,
        extra_body={"seed": seed},
    )
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), CITY)


def test_responses_parse_when_pydantic_text_format_then_parsed(srv):
    """The SDK's own structured-output helper: a strict schema from a pydantic model, parsed back."""
    r = sdk(srv).responses.parse(
        model=srv.engine.model_id,
        input="Paris?",
        text_format=Country,
        max_output_tokens=400,
        extra_body={"seed": 3},
    )
    assert isinstance(r.output_parsed, Country) and 1 <= len(r.output_parsed.rivers) <= 2


def test_responses_json_object_when_streamed_then_deltas_join_to_a_json_object(srv):
    events = list(
        sdk(srv).responses.create(
            model=srv.engine.model_id,
            input="Paris?",
            text={"format": {"type": "json_object"}},
            max_output_tokens=200,
            stream=True,
            extra_body={"seed": 4},
        )
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.completed" and events[-1].response.output_text == text
    assert isinstance(json.loads(text), dict)


def test_responses_forced_function_call_when_sdk_then_a_function_call_item_that_validates(srv):
    r = sdk(srv).responses.create(
        model=srv.engine.model_id,
        input="Paris?",
        tools=[RESP_WEATHER, RESP_TIME],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=300,
        extra_body={"seed": 8},
    )
    assert r.status == "completed" and r.output_text == ""
    (call,) = r.output  # only the call: no message item
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert [t.name for t in r.tools] == ["get_weather", "get_time"] and r.tool_choice.name == "get_weather"


def test_responses_calls_when_streamed_then_argument_deltas_and_the_same_calls_as_unstreamed(srv):
    kwargs = dict(
        model=srv.engine.model_id,
        input="Paris?",
        tools=[RESP_WEATHER, RESP_TIME],
        tool_choice="required",
        temperature=1.0,
        max_output_tokens=300,
        extra_body={"seed": 9},
    )
    client = sdk(srv)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.output_text.delta" not in types and "response.content_part.added" not in types
    assert types.count("response.function_call_arguments.delta") > len(whole.output)  # arguments in pieces
    assert (
        types.count("response.function_call_arguments.done")
        == len(whole.output)
        == types.count("response.output_item.done")
    )
    want = [(c.type, c.call_id, c.name, c.arguments) for c in whole.output]
    got = [(c.type, c.name, c.arguments) for c in streamed.output]
    assert got == [(t, n, a) for t, _, n, a in want] and all(t == "function_call" for t, *_ in want)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in streamed.output]
    schemas = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
    for call in streamed.output:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_responses_function_call_output_when_sent_back_then_the_call_and_its_result_in_the_prompt(srv):
    client = sdk(srv)
    first = client.responses.create(
        model=srv.engine.model_id,
        input="Paris?",
        tools=[RESP_WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        extra_body={"seed": 10},
    )
    (call,) = first.output
    second = client.responses.create(
        model=srv.engine.model_id,
        input=[
            {"role": "user", "content": "Paris?"},
            call.model_dump(exclude_none=True),  # the output item, sent back as the SDK's docs show
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
        ],
        tools=[RESP_WEATHER],
        max_output_tokens=8,
        extra_body={"seed": 11},
    )
    assert second.status in ("completed", "incomplete")
    prompt = prompt_text(srv)
    assert f'{{"name": "get_weather", "arguments": {call.arguments}}}' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


# ---- the real SmolLM2 -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_model_dir):
    return load_engine(smollm2_model_dir, threads=2, context_length=2048)


@pytest.mark.slow
def test_smollm2_when_ollama_format_and_responses_forced_call_then_both_validate(live, smollm2_engine):
    engine = RecordingEngine(smollm2_engine)
    srv = live(engine=engine, model=engine.model_id)
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Rome", "Oslo"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    for options in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}):
        r = ollama_client(srv).chat(
            model=engine.model_id,
            messages=[{"role": "user", "content": "Invent a person who lives in Paris."}],
            format=person,
            options={**options, "num_predict": 80},
        )
        assert r.done_reason == "stop"
        jsonschema.validate(json.loads(r.message.content), person)
    call = sdk(srv).responses.create(
        model=engine.model_id,
        input="What is the weather in Paris, in celsius?",
        tools=[RESP_WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=60,
    )
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), WEATHER_PARAMS)


# ---- a named tool_choice: one call --------------------------------------------------------------------

NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("path", "body", "parallel"),
    [
        ("/v1/chat/completions", {"messages": ASK, "tool_choice": NAMED}, False),
        ("/v1/chat/completions", {"messages": ASK, "tool_choice": NAMED, "parallel_tool_calls": True}, True),
        ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required"}, True),
        ("/v1/chat/completions", {"messages": ASK, "tool_choice": "auto"}, True),
        (
            "/v1/responses",
            {"input": "weather?", "tool_choice": {"type": "function", "name": "get_weather"}},
            False,
        ),
        ("/api/chat", {"messages": ASK, "tool_choice": NAMED, "stream": False}, False),
    ],
    ids=[
        "chat named",
        "chat named parallel",
        "chat required",
        "chat auto",
        "responses named",
        "ollama named",
    ],
)
def test_tool_choice_when_a_function_is_named_then_one_call_unless_parallel_is_asked(
    srv, path, body, parallel
):
    """OpenAI's forced function is one call: the reply's grammar allows exactly one unless the request sets
    parallel_tool_calls itself (a small model called it up to three times, identically)."""
    tools = [WEATHER, TIME]
    if path == "/v1/responses":
        tools = [{"type": "function", **t["function"]} for t in tools]
    limit = {"/api/chat": {"options": {"num_predict": 120}}, "/v1/responses": {"max_output_tokens": 120}}
    r = httpx.post(
        srv.url + path,
        json={"model": srv.engine.model_id, "tools": tools, **limit.get(path, {"max_tokens": 120}), **body},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    use = srv.engine.generations[-1].params.tools
    assert use is not None and use.parallel is parallel
