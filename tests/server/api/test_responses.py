"""OpenAI's Responses API (stateless) with the openai SDK's client.responses, against a live server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers import sdk
from tests.server.conftest import MODEL, responses_events
from tests.server.fakes import REPLY, FakeGovernor

WORDS = REPLY.split(" ")
FN = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def test_create_when_not_streamed_then_a_completed_response_with_usage(live) -> None:
    srv = live()
    r = sdk(srv).responses.create(model=MODEL, input="hi", instructions="be brief", temperature=0.2)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == REPLY and r.model == MODEL
    assert len(r.output) == 1 and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens == len(WORDS)
    assert r.usage.input_tokens == len("<system>be brief\n<user>hi\n<assistant>")
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "be brief" and r.temperature == 0.2 and r.store is False
    prompt = "".join(chr(i) for i in srv.engine.generations[-1].prompt.ids)
    assert prompt == "<system>be brief\n<user>hi\n<assistant>"


def test_create_when_message_items_then_the_conversation_in_order(live) -> None:
    srv = live()
    items = [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "input_text", "text": "q1"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a1"}]},
        {"role": "user", "content": "q2"},
    ]
    sdk(srv).responses.create(model=MODEL, input=items)
    prompt = "".join(chr(i) for i in srv.engine.generations[-1].prompt.ids)
    assert prompt == "<system>sys\n<user>q1\n<assistant>a1\n<user>q2\n<assistant>"


def test_create_when_max_output_tokens_then_incomplete_for_that_reason(live) -> None:
    srv = live()
    r = sdk(srv).responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == " ".join(WORDS[:3]) and r.usage.output_tokens == 3
    assert srv.engine.generations[-1].params.max_tokens == 3


def test_create_when_streamed_then_the_event_sequence_and_the_final_response(live) -> None:
    srv = live(token_delay_s=0.005)
    events = list(sdk(srv).responses.create(model=MODEL, input="hi", stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and set(types[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in deltas) == REPLY
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.status == "completed" and final.output_text == REPLY
    assert final.usage.output_tokens == len(WORDS) and final.id == events[0].response.id
    assert events[-4].text == REPLY and events[-2].item.status == "completed"
    assert {e.item_id for e in deltas} == {final.output[0].id}


def test_stream_helper_when_used_then_it_accumulates_the_same_response(live) -> None:
    srv = live()
    with sdk(srv).responses.stream(model=MODEL, input="hi") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == REPLY == final.output_text and final.status == "completed"


def test_stream_when_the_engine_fails_midway_then_error_and_response_failed(live) -> None:
    srv = live(fail_after_tokens=2, token_delay_s=0.01)
    with (
        httpx.Client(base_url=srv.url, timeout=30) as c,
        c.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1]["response"]
    assert events[-2]["code"] == "internal_error"  # simmer's code; the response's is one the spec lists
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == " ".join(WORDS[:2])
    assert not any(e["type"] == "response.completed" for e in events)


def sse_events(srv, body: dict) -> list[tuple[str | None, dict]]:
    return responses_events(srv, {"model": MODEL, **body})


def test_stream_when_governor_events_then_chat_s_governor_event_beside_the_numbered_ones(live) -> None:
    gov = FakeGovernor()  # publishes at the third step
    srv = live(governor=gov, token_delay_s=0.002)
    events = sse_events(srv, {"input": "hi", "max_output_tokens": 10, "governor_events": True})
    governor = [data for name, data in events if name == "governor"]
    assert governor == [{"level": "moderate", "reason": "test"}]  # what chat's `event: governor` carries
    at = next(i for i, (name, _) in enumerate(events) if name == "governor")
    before = [data["type"] for _, data in events[:at]]
    assert "response.output_text.delta" in before  # forwarded mid-reply, as it happened
    numbered = [data for name, data in events if name != "governor"]
    assert all(name == data["type"] for name, data in events if name != "governor")
    assert [e["sequence_number"] for e in numbered] == list(range(len(numbered)))
    assert (
        numbered[-1]["type"] == "response.incomplete"
        and numbered[-1]["response"]["usage"]["output_tokens"] == 10
    )


@pytest.mark.parametrize("opt", [{}, {"governor_events": False}])
def test_stream_when_governor_events_not_asked_then_no_governor_event(live, opt) -> None:
    gov = FakeGovernor()
    srv = live(governor=gov, token_delay_s=0.002)
    events = sse_events(srv, {"input": "hi", "max_output_tokens": 10, **opt})
    assert gov.steps >= 3  # the governor did publish
    assert all(name == data["type"] for name, data in events)  # every event a response.* (or error) one
    assert events[-1][1]["type"] == "response.incomplete"


def test_logprobs_when_included_then_on_the_output_text(live) -> None:
    srv = live()
    r = sdk(srv).responses.create(
        model=MODEL, input="hi", top_logprobs=2, include=["message.output_text.logprobs"]
    )
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == len(WORDS) and logprobs[0].token == WORDS[0]
    assert len(logprobs[0].top_logprobs) == 2


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"conversation": "conv_1"}, "conversation", "stateless"),
        ({"background": True}, "background", "stateless"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"uniqueItems": True}}}},
            "text.format",
            "text.format: unsupported or invalid",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", ""),
        (
            {"text": {"format": {"type": "json_object"}}, "tools": [FN]},
            "text.format",
            "text.format cannot be combined with tool calls",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", ""),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
            "tools[0].parameters",
            "tools[0].parameters must describe an object",
        ),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "not": {}}}]},
            "tools[0].parameters",
            "tools[0].parameters: unsupported or invalid",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [FN], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "not among"),
        ({"tools": [FN], "tool_choice": {"type": "file_search"}}, "tool_choice", "only function tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "does not reason"),
        ({"include": ["file_search_call.results"]}, "include[0]", "only"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
            "text only",
        ),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id", "string"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "input[0].arguments",
            "string",
        ),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type", "function_call_output"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "role"),
        ({"input": []}, "input", "empty"),
        ({"max_output_tokens": 0}, "max_output_tokens", ""),
        ({"temperature": 3}, "temperature", ""),
        ({"governor_events": "yes"}, "governor_events", ""),
        ({"governor_events": 1}, "governor_events", ""),
    ],
)
def test_create_when_unsupported_or_bad_then_400_naming_the_field(live, fields, param, words) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post("/v1/responses", json={"model": MODEL, "input": "hi", **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["code"] == "invalid_parameter"
    assert srv.engine.generations == []


def test_previous_response_id_when_sdk_sends_it_then_bad_request(live) -> None:
    srv = live()
    with pytest.raises(openai.BadRequestError) as err:
        sdk(srv).responses.create(model=MODEL, input="hi", previous_response_id="resp_abc")
    assert "stateless" in str(err.value)


def test_store_when_true_then_accepted_and_reported_not_stored(live) -> None:
    srv = live()
    r = sdk(srv).responses.create(model=MODEL, input="hi", store=True, metadata={"k": "v"})
    assert r.status == "completed" and r.store is False and r.metadata == {"k": "v"}


def test_unknown_model_when_create_then_404(live) -> None:
    srv = live()
    with pytest.raises(openai.NotFoundError):
        sdk(srv).responses.create(model="nope", input="hi")
