"""Stream shapes clients rely on, as OpenAI streams them:
- chat chunks: the role alone in the first delta (`content` null), never an empty `content` delta (tools or
  not), and an empty delta with the finish_reason last;
- the Responses API: one output item open at a time (each closed before the next opens), parallel function
  calls included, and no empty text delta."""

from __future__ import annotations

import json

import httpx
import pytest

from models.types import FinishEvent, Timings, TokenEvent, ToolCallDelta, Usage
from server.api.responses.render import EventStream, ResponseObject
from server.api.responses.requests import ResponsesRequest
from tests.server.conftest import MODEL
from tests.server.fakes import REPLY
from tests.server.structured_data import TIME, WEATHER, structured_server


def chunks(srv, path: str, body: dict) -> list[dict]:
    with (
        httpx.Client(base_url=srv.url, timeout=60) as c,
        c.stream("POST", path, json={"stream": True, **body}) as r,
    ):
        assert r.status_code == 200, r.read()
        return [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


def check_chat_stream(stream: list[dict]) -> None:
    with_choices = [c for c in stream if c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in with_choices]
    assert deltas[0] == {"role": "assistant", "content": None}
    assert all("role" not in d for d in deltas[1:])
    assert all(d.get("content") != "" for d in deltas), deltas
    assert deltas[-1] == {} and with_choices[-1]["choices"][0]["finish_reason"] is not None
    assert all(c["choices"][0]["finish_reason"] is None for c in with_choices[:-1])


@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_stream_when_text_then_role_first_no_empty_content_and_an_empty_last_delta(live, logprobs):
    srv = live(token_delay_s=0.001)
    stream = chunks(
        srv,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": logprobs},
    )
    check_chat_stream(stream)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in stream if c["choices"])
    assert text == REPLY
    if logprobs:  # every token's logprob went out once, with the text it belongs to
        tokens = [
            t["token"]
            for c in stream
            if c["choices"]
            for t in (c["choices"][0]["logprobs"] or {}).get("content") or ()
        ]
        assert "".join(tokens) == REPLY


@pytest.fixture
def tiny_long_server(live, tiny_long_model_dir):
    return structured_server(live, tiny_long_model_dir)


def test_chat_stream_when_tools_then_no_empty_content_delta(tiny_long_server):
    body = {
        "model": tiny_long_server.engine.model_id,
        "messages": [{"role": "user", "content": "Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "max_tokens": 300,
        "temperature": 1.0,
        "seed": 2,
    }
    stream = chunks(tiny_long_server, "/v1/chat/completions", body)
    check_chat_stream(stream)
    assert any("tool_calls" in c["choices"][0]["delta"] for c in stream if c["choices"])


def open_items_in_turn(events: list[dict]) -> list[int]:
    """The output indexes in the order they opened; fails when an item opens, or an event of another item
    comes, while one is open."""
    order: list[int] = []
    current: int | None = None
    for event in events:
        index = event.get("output_index")
        if event["type"] == "response.output_item.added":
            assert current is None, f"item {index} opened while item {current} is open"
            current = index
            order.append(index)
        elif event["type"] == "response.output_item.done":
            assert index == current
            current = None
        elif index is not None:
            assert index == current, f"{event['type']} for item {index} while item {current} is open"
        if event["type"] == "response.output_text.delta":
            assert event["delta"] != ""
    assert current is None
    return order


def call_tokens(*pieces: tuple[int, str | None, str]) -> list[TokenEvent]:
    """One token per call piece: (call index, name on its first piece else None, arguments text)."""
    return [
        TokenEvent(
            token_id=100 + i,
            text="",
            index=i,
            tool_calls=(ToolCallDelta(call, f"call_{call}" if name else None, name, args),),
        )
        for i, (call, name, args) in enumerate(pieces)
    ]


def test_responses_events_when_parallel_calls_arrive_in_one_batch_then_each_closes_before_the_next():
    """The encoder on its own (pure): two calls whose pieces share one coalesced batch, as a fast engine
    sends them."""
    request = ResponsesRequest.model_validate(
        {"input": "Paris?", "tools": [{"type": "function", "name": "get_weather"}], "stream": True}
    )
    stream = EventStream(ResponseObject("resp_1", "m", request))
    events = stream.opening()
    events += stream.delta("", call_tokens((0, "get_weather", '{"city": '), (0, None, '"Paris"}')))
    events += stream.delta("", call_tokens((1, "get_weather", '{"city": "Rome"'), (1, None, "}")))
    usage = Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=0)
    events += stream.closing(FinishEvent("tool_calls", usage, Timings()))
    final = events[-1]["response"]
    assert open_items_in_turn(events) == [0, 1]
    assert [item["arguments"] for item in final["output"]] == ['{"city": "Paris"}', '{"city": "Rome"}']
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"] and all(item["status"] == "completed" for item in done)


def test_responses_stream_when_forced_calls_then_items_in_turn_and_as_the_final_output(tiny_long_server):
    tools = [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
        for t in (WEATHER, TIME)
    ]
    body = {
        "model": tiny_long_server.engine.model_id,
        "input": "Paris?",
        "tools": tools,
        "tool_choice": "required",
        "max_output_tokens": 400,
        "temperature": 1.0,
        "seed": 3,
    }
    events = chunks(tiny_long_server, "/v1/responses", body)
    final = events[-1]["response"]
    assert open_items_in_turn(events) == list(range(len(final["output"])))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]


def test_responses_stream_when_text_then_one_message_and_no_empty_delta(live):
    srv = live(token_delay_s=0.001)
    events = chunks(srv, "/v1/responses", {"model": MODEL, "input": "hi"})
    assert open_items_in_turn(events) == [0]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == REPLY
