"""The sampling bounds are declared once (server/api/common/fields.py) and every dialect types its fields with
them: at each bound's edge every dialect takes the value, just past it every dialect refuses it with the same
words, naming the field as the dialect spells it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from server.api.common import fields
from server.api.ollama.requests import OllamaChatRequest, OllamaOptions, OllamaTurn
from server.api.openai.requests import ChatCompletionRequest, CompletionRequest
from server.api.responses.requests import ResponsesRequest

# (model, field) -> the shared type it must be declared with
DECLARED: list[tuple[type[BaseModel], str, Any]] = [
    *((ChatCompletionRequest, n, t) for n, t in [
        ("temperature", fields.Temperature), ("top_p", fields.TopP), ("min_p", fields.MinP),
        ("top_k", fields.TopK), ("seed", fields.Seed), ("presence_penalty", fields.Penalty),
        ("frequency_penalty", fields.Penalty), ("repeat_penalty", fields.RepetitionPenalty),
        ("repetition_penalty", fields.RepetitionPenalty), ("max_tokens", fields.MaxTokens),
        ("max_completion_tokens", fields.MaxTokens), ("top_logprobs", fields.TopLogprobs),
        ("route", fields.RouteMode),
    ]),
    (CompletionRequest, "logprobs", fields.TopLogprobs),
    *((OllamaOptions, n, t) for n, t in [
        ("temperature", fields.Temperature), ("top_p", fields.TopP), ("min_p", fields.MinP),
        ("top_k", fields.TopK), ("seed", fields.Seed), ("presence_penalty", fields.Penalty),
        ("frequency_penalty", fields.Penalty), ("repeat_penalty", fields.RepetitionPenalty),
        ("num_ctx", fields.ContextLength),
    ]),
    (OllamaTurn, "top_logprobs", fields.TopLogprobs),
    (OllamaTurn, "route", fields.RouteMode),
    *((ResponsesRequest, n, t) for n, t in [
        ("temperature", fields.Temperature), ("top_p", fields.TopP), ("min_p", fields.MinP),
        ("top_k", fields.TopK), ("seed", fields.Seed), ("repeat_penalty", fields.RepetitionPenalty),
        ("max_output_tokens", fields.MaxTokens), ("top_logprobs", fields.TopLogprobs),
        ("route", fields.RouteMode),
    ]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "name", "declared"), DECLARED, ids=[f"{m.__name__}.{n}" for m, n, _ in DECLARED]
)
def test_bounds_when_a_dialect_declares_a_sampling_field_then_with_the_shared_type(model, name, declared):
    assert model.model_fields[name].annotation == declared | None


HI = [{"role": "user", "content": "hi"}]
DIALECTS = {
    "openai": lambda name, value: (ChatCompletionRequest, {"messages": HI, name: value}, name),
    "ollama": lambda name, value: (
        OllamaChatRequest,
        {"model": "m", "messages": HI, "options": {name: value}},
        f"options.{name}",
    ),
    "responses": lambda name, value: (ResponsesRequest, {"input": "hi", name: value}, name),
}
# (field, the values at the edges, the values just past them) for the fields all three dialects have
EDGES = [
    ("temperature", [0, 2.0], [-0.001, 2.001]),
    ("top_p", [0, 1], [-0.001, 1.001]),
    ("min_p", [0, 1], [-0.001, 1.001]),
    ("top_k", [0, 10**30], [-1]),
    ("seed", [-(2**63), 2**63 - 1], [-(2**63) - 1, 2**63]),
    ("repeat_penalty", [0.01, 100], [0.0099, 100.01]),
]


def _refusal(model: type[BaseModel], body: dict) -> tuple[tuple[Any, ...], str] | None:
    try:
        model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        return tuple(first["loc"]), first["msg"]
    return None


@pytest.mark.parametrize(("name", "edges", "past"), EDGES, ids=[e[0] for e in EDGES])
def test_bounds_when_at_and_past_the_edge_then_every_dialect_agrees(name, edges, past):
    for value in edges:
        for dialect, build in DIALECTS.items():
            model, body, _ = build(name, value)
            assert _refusal(model, body) is None, (dialect, value)
    for value in past:
        refusals = {}
        for dialect, build in DIALECTS.items():
            model, body, path = build(name, value)
            got = _refusal(model, body)
            assert got is not None, (dialect, value)
            loc, message = got
            assert ".".join(str(p) for p in loc) == path, (dialect, loc)
            refusals[dialect] = message
        assert len(set(refusals.values())) == 1, refusals
