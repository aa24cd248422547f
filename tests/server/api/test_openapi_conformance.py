"""simmer's real responses against OpenAI's published OpenAPI document: the chat completion, its stream
chunks, the completion, the model list and a model, the error body, the Responses API's response and every
event its stream sends. A field the spec requires that is missing, or one of the wrong type, fails.

The component schemas are a fixture (tests/fixtures/openai_openapi_components.json, written by
tests/fixtures/make_openapi_fixture.py from the document at the commit it names): CI has no network. The
spec allows extra fields, so simmer's own (`timings`, `route`, ...) pass; its required ones do not bend.
The replies come from the tiny real model (tool calls and logprobs as the engine makes them) and, for a
failure midway, from the scripted engine."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.server.api.helpers import ASK, CHATS, RESP_TOOLS
from tests.server.conftest import MODEL
from tests.server.structured_data import structured_server

FIXTURE = Path(__file__).parents[2] / "fixtures" / "openai_openapi_components.json"
SPEC = json.loads(FIXTURE.read_text())
COMPONENTS = SPEC["components"]


@cache
def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = {"$ref": f"#/components/schemas/{name}", "components": COMPONENTS}
    return jsonschema.Draft202012Validator(schema)


def conforms(name: str, instance: Any) -> None:
    errors = sorted(validator(name).iter_errors(instance), key=lambda e: list(e.absolute_path))
    assert not errors, f"{name}: " + "; ".join(
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:200]}" for e in errors[:5]
    )


def event_schemas() -> dict[str, str]:
    """Each streamed Responses event type -> the component that describes it (ResponseStreamEvent's
    members, by their `type` enum)."""
    out = {}
    for member in COMPONENTS["schemas"]["ResponseStreamEvent"]["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[-1]
        for kind in COMPONENTS["schemas"][name]["properties"]["type"].get("enum", ()):
            out[kind] = name
    return out


EVENTS = event_schemas()


def sse(response: httpx.Response) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in response.iter_lines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


@pytest.fixture
def srv(live, tiny_long_model_dir):
    return structured_server(live, tiny_long_model_dir)


def post(srv, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        return c.post(path, json={"model": srv.engine.model_id, **body})


def streamed(srv, path: str, body: dict) -> list[dict]:
    with (
        httpx.Client(base_url=srv.url, timeout=60) as c,
        c.stream("POST", path, json={"model": srv.engine.model_id, "stream": True, **body}) as r,
    ):
        assert r.status_code == 200, r.read()
        return sse(r)


@pytest.mark.parametrize("kind", list(CHATS))
def test_chat_completion_when_answered_then_it_conforms(srv, kind):
    r = post(srv, "/v1/chat/completions", CHATS[kind])
    assert r.status_code == 200, r.text
    conforms("CreateChatCompletionResponse", r.json())


@pytest.mark.parametrize("kind", list(CHATS))
def test_chat_chunks_when_streamed_with_usage_then_each_conforms(srv, kind):
    chunks = streamed(srv, "/v1/chat/completions", {**CHATS[kind], "stream_options": {"include_usage": True}})
    assert len(chunks) >= 3 and chunks[-1]["usage"] is not None
    for chunk in chunks:
        conforms("CreateChatCompletionStreamResponse", chunk)


@pytest.mark.parametrize("logprobs", [None, 3])
def test_completion_when_answered_then_it_conforms(srv, logprobs):
    r = post(srv, "/v1/completions", {"prompt": "Once", "max_tokens": 8, "logprobs": logprobs})
    assert r.status_code == 200, r.text
    conforms("CreateCompletionResponse", r.json())


def test_models_when_listed_or_retrieved_then_they_conform(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        listed = c.get("/v1/models").json()
        one = c.get(f"/v1/models/{srv.engine.model_id}").json()
    conforms("ListModelsResponse", listed)
    conforms("Model", one)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "no-such-model", "messages": ASK}),
        ("/v1/chat/completions", {"messages": ASK, "n": 9}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 5000}]}),
        ("/v1/completions", {"prompt": 5}),
        ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}),
        ("/v1/models/no-such-model", None),
    ],
)
def test_errors_when_refused_then_they_conform(srv, path, body):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.get(path) if body is None else c.post(path, json={"model": srv.engine.model_id, **body})
    assert r.status_code in (400, 404), r.text
    conforms("ErrorResponse", r.json())


RESPONSES = {
    "text": {"input": "Paris?", "max_output_tokens": 8},
    "logprobs": {"input": "Paris?", "max_output_tokens": 8, "top_logprobs": 2},
    "instructions": {
        "instructions": "Be brief.",
        "input": "Paris?",
        "max_output_tokens": 300,
        "temperature": 0,
    },
    "function calls": {
        "input": "Paris?",
        "tools": RESP_TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 300,
        "temperature": 1.0,
        "seed": 3,
    },
    "json": {"input": "Paris?", "text": {"format": {"type": "json_object"}}, "max_output_tokens": 60},
}


@pytest.mark.parametrize("kind", list(RESPONSES))
def test_response_when_answered_then_it_conforms(srv, kind):
    r = post(srv, "/v1/responses", RESPONSES[kind])
    assert r.status_code == 200, r.text
    conforms("Response", r.json())


@pytest.mark.parametrize("kind", list(RESPONSES))
def test_responses_stream_when_streamed_then_every_event_conforms(srv, kind):
    events = streamed(srv, "/v1/responses", RESPONSES[kind])
    for event in events:
        assert event["type"] in EVENTS, event["type"]
        conforms(EVENTS[event["type"]], event)


def test_responses_stream_when_the_engine_fails_midway_then_the_error_events_conform(live):
    srv = live(fail_after_tokens=2, token_delay_s=0.01)
    with (
        httpx.Client(base_url=srv.url, timeout=30) as c,
        c.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}) as r,
    ):
        events = sse(r)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    for event in events:
        conforms(EVENTS[event["type"]], event)


def test_fixture_when_read_then_it_names_the_spec_it_was_taken_from():
    source = SPEC["source"]
    assert source["repository"] == "openai/openai-openapi" and len(source["commit"]) == 40
    assert set(source["roots"]) <= set(COMPONENTS["schemas"])
