"""Every reply the server sends, from the tiny real model, against the pydantic model that the OpenAPI
document is made from (each dialect's replies.py): it validates strictly, and no field is left undeclared
(the models allow extra fields only for what an upstream relays). The OpenAPI document names the same
models: a reply model missing from it, or documented under another name, fails too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from governor.governor import Governor
from models.runtime.engine import load_engine
from server.api.llamacpp.replies import AppliedTemplate, Detokenized, Tokens
from server.api.ollama.replies import (
    OllamaChat,
    OllamaGenerate,
    OllamaModels,
    OllamaShow,
    OllamaVersion,
)
from server.api.openai.replies import (
    ChatCompletion,
    ChatCompletionChunk,
    Model,
    ModelList,
    TextCompletion,
    TextCompletionChunk,
)
from server.api.responses.replies import Response
from server.api.simmer.replies import Health, ThermalState
from server.http.error_bodies import Error, OllamaError
from server.http.openapi import REPLIES
from server.serving.governor_gate import GovernorGate
from tests.server.api.helpers import ASK, CHATS, RESP_TOOLS
from tests.server.conftest import LiveServer, make_settings, start_server
from tests.server.structured_data import WEATHER


@pytest.fixture(scope="module")
def srv(tiny_long_model_dir: Path, tmp_path_factory) -> Iterator[LiveServer]:
    engine = load_engine(tiny_long_model_dir, threads=1, context_length=4096)
    gate = GovernorGate(Governor(usable_cpus=1, poll_s=0.05), pause_timeout_s=2.0)
    server = start_server(
        make_settings(tmp_path_factory.mktemp("replies"), model=engine.model_id), engine=engine, governor=gate
    )
    yield server
    server.stop()


def undeclared(value: Any, where: str = "") -> list[str]:
    """The fields of a validated reply that its model does not declare (at any depth)."""
    if isinstance(value, BaseModel):
        out = [f"{where}.{key}" for key in value.model_extra or {}]
        for name in type(value).model_fields:
            out += undeclared(getattr(value, name), f"{where}.{name}")
        return out
    if isinstance(value, list):
        return [miss for i, item in enumerate(value) for miss in undeclared(item, f"{where}[{i}]")]
    return []


def conforms(model: type[BaseModel], data: Any) -> None:
    reply = model.model_validate_json(json.dumps(data), strict=True)
    assert not undeclared(reply), f"{model.__name__}: undeclared {undeclared(reply)} in {data}"


def call(srv: LiveServer, method: str, path: str, body: dict | None = None) -> httpx.Response:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        return c.request(method, path, json=body)


def lines(srv: LiveServer, path: str, body: dict) -> list[dict]:
    """A stream's JSON objects: SSE `data:` lines but [DONE], or NDJSON lines."""
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        raw = [line.removeprefix("data: ") for line in r.iter_lines() if line and not line.startswith(":")]
    return [json.loads(line) for line in raw if line.startswith("{")]


USAGE = {"include_usage": True}
CALL_OPTIONS = {"seed": 8, "temperature": 1.0, "num_predict": 300}
# (path, the reply's model, a stream chunk's model, the request): OpenAI's chat and text completions
OPENAI = {
    **{
        f"chat {kind}": ("/v1/chat/completions", ChatCompletion, ChatCompletionChunk, body)
        for kind, body in CHATS.items()
    },
    "completion": (
        "/v1/completions",
        TextCompletion,
        TextCompletionChunk,
        {"prompt": "Once", "max_tokens": 8},
    ),
    "completion logprobs": (
        "/v1/completions",
        TextCompletion,
        TextCompletionChunk,
        {"prompt": "Once", "max_tokens": 8, "logprobs": 3},
    ),
}
RESPONSES = {
    "text": {"input": "Paris?", "max_output_tokens": 8},
    "logprobs": {"input": "Paris?", "max_output_tokens": 8, "top_logprobs": 2},
    "function calls": {"input": "Paris?", "tools": RESP_TOOLS, "tool_choice": "required", "seed": 3},
}
OLLAMA = {
    "chat": ("/api/chat", OllamaChat, {"messages": ASK, "options": {"num_predict": 8}}),
    "chat logprobs": (
        "/api/chat",
        OllamaChat,
        {"messages": ASK, "options": {"num_predict": 8}, "logprobs": True, "top_logprobs": 2},
    ),
    "chat tools": (
        "/api/chat",
        OllamaChat,
        {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "options": CALL_OPTIONS},
    ),
    "generate": ("/api/generate", OllamaGenerate, {"prompt": "Once", "options": {"num_predict": 8}}),
    "generate raw": (
        "/api/generate",
        OllamaGenerate,
        {"prompt": "Once", "raw": True, "options": {"num_predict": 4}},
    ),
    "load": ("/api/generate", OllamaGenerate, {}),
}


@pytest.mark.parametrize("kind", list(OPENAI))
def test_completion_when_answered_or_streamed_then_it_is_the_declared_reply(srv, kind):
    path, reply, chunk_model, fields = OPENAI[kind]
    body = {"model": srv.settings.model, **fields}
    r = call(srv, "POST", path, body)
    assert r.status_code == 200, r.text
    conforms(reply, r.json())
    assert ("tool_calls" in r.json()["choices"][0].get("message", {})) == (kind == "chat tool calls")
    chunks = lines(srv, path, {**body, "stream": True, "stream_options": USAGE})
    assert chunks[-1]["usage"] is not None
    for chunk in chunks:
        conforms(chunk_model, chunk)


@pytest.mark.parametrize("kind", list(RESPONSES))
def test_response_when_answered_or_streamed_then_it_is_the_declared_reply(srv, kind):
    body = {"model": srv.settings.model, **RESPONSES[kind]}
    r = call(srv, "POST", "/v1/responses", body)
    assert r.status_code == 200, r.text
    conforms(Response, r.json())
    assert ("function_call" in {item["type"] for item in r.json()["output"]}) == (kind == "function calls")
    carried = [
        e["response"] for e in lines(srv, "/v1/responses", {**body, "stream": True}) if "response" in e
    ]
    assert len(carried) >= 3  # created, in_progress, and completed or incomplete
    for response in carried:
        conforms(Response, response)


@pytest.mark.parametrize("kind", list(OLLAMA))
def test_ollama_when_answered_or_streamed_then_each_line_is_the_declared_reply(srv, kind):
    path, model, fields = OLLAMA[kind]
    body = {"model": srv.settings.model, **fields}
    r = call(srv, "POST", path, {**body, "stream": False})
    assert r.status_code == 200, r.text
    conforms(model, r.json())
    assert ("tool_calls" in r.json().get("message", {})) == (kind == "chat tools")
    if fields:
        streamed = lines(srv, path, body)
        assert streamed[-1]["done"] is True
        for line in streamed:
            conforms(model, line)


def test_models_and_tokenizer_when_asked_then_each_is_the_declared_reply(srv):
    model = srv.settings.model
    answers: list[tuple[type[BaseModel], httpx.Response]] = [
        (ModelList, call(srv, "GET", "/v1/models")),
        (Model, call(srv, "GET", f"/v1/models/{model}")),
        (OllamaModels, call(srv, "GET", "/api/tags")),
        (OllamaModels, call(srv, "GET", "/api/ps")),
        (OllamaShow, call(srv, "POST", "/api/show", {"model": model})),
        (OllamaVersion, call(srv, "GET", "/api/version")),
        (Tokens, call(srv, "POST", "/tokenize", {"content": "Hello 🙂"})),
        (Tokens, call(srv, "POST", "/tokenize", {"content": ["Hi", 5, "🙂"], "with_pieces": True})),
        (Detokenized, call(srv, "POST", "/detokenize", {"tokens": [5, 6, 7]})),
        (AppliedTemplate, call(srv, "POST", "/apply-template", {"messages": ASK})),
        (Health, call(srv, "GET", "/health")),
        (ThermalState, call(srv, "GET", "/v1/thermal")),
        (ThermalState, call(srv, "POST", "/v1/lifecycle", {"state": "foreground", "client": "replies"})),
    ]
    for model_class, r in answers:
        assert r.status_code == 200, (model_class.__name__, r.text)
        conforms(model_class, r.json())
    assert any(m["loaded"] for m in answers[0][1].json()["data"])  # a loaded model's fields are in too
    assert answers[3][1].json()["models"]  # /api/ps listed the loaded model


@pytest.mark.parametrize(
    ("method", "path", "body", "model"),
    [
        ("POST", "/v1/chat/completions", {"model": "no-such-model", "messages": ASK}, Error),
        ("POST", "/v1/chat/completions", {"messages": ASK, "n": 9}, Error),
        ("GET", "/v1/models/no-such-model", None, Error),
        ("POST", "/tokenize", {"content": [10**9]}, Error),
        ("POST", "/api/chat", {"model": "no-such-model", "messages": ASK}, OllamaError),
        ("POST", "/api/show", {"model": "no-such-model"}, OllamaError),
    ],
)
def test_errors_when_refused_then_they_are_the_declared_error(srv, method, path, body, model):
    r = call(srv, method, path, body)
    assert r.status_code in (400, 404), r.text
    conforms(model, r.json())


def test_document_when_built_then_every_reply_model_is_a_component_under_its_name(srv):
    schemas = call(srv, "GET", "/openapi.json").json()["components"]["schemas"]
    for model in REPLIES:
        own = model.model_json_schema(mode="serialization", ref_template="#/components/schemas/{model}")
        for name, nested in {**own.pop("$defs", {}), model.__name__: own}.items():
            assert schemas[name] == nested, name
