"""The schema suite on the real SmolLM2 (slow): every reply, greedy and sampled with several seeds, parses
and validates with jsonschema; forced tool calls too."""

from __future__ import annotations

import json

import jsonschema
import pytest

from models.runtime.constraint import json_schema_grammar
from models.runtime.engine import DecoderEngine, load_engine
from models.types import FinishEvent, GenerationParams, SamplingParams, Tool, ToolUse

pytestmark = pytest.mark.slow

SCHEMAS = {
    "object": (
        "Describe a person.",
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    "nested": (
        "Give an address book entry.",
        {
            "type": "object",
            "properties": {
                "person": {
                    "type": "object",
                    "properties": {
                        "first": {"type": "string", "minLength": 1, "maxLength": 20},
                        "last": {"type": "string", "minLength": 1, "maxLength": 20},
                    },
                    "required": ["first", "last"],
                    "additionalProperties": False,
                },
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 30},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["person", "address"],
            "additionalProperties": False,
        },
    ),
    "enums": (
        "What is the weather like in London?",
        {
            "type": "object",
            "properties": {
                "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                "wind": {"type": "string", "enum": ["calm", "breezy", "stormy"]},
                "ok": {"type": "boolean"},
            },
            "required": ["sky", "wind", "ok"],
            "additionalProperties": False,
        },
    ),
    "array_bounds": (
        "List some colors.",
        {
            "type": "object",
            "properties": {
                "colors": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 15},
                    "minItems": 2,
                    "maxItems": 4,
                }
            },
            "required": ["colors"],
            "additionalProperties": False,
        },
    ),
    "number_ranges": (
        "Give a rating and a temperature.",
        {
            "type": "object",
            "properties": {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "celsius": {"type": "number", "minimum": -40, "maximum": 50},
                "share": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            },
            "required": ["stars", "celsius", "share"],
            "additionalProperties": False,
        },
    ),
    "optional_fields": (
        "Describe a book.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 50},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                "subtitle": {"type": "string", "maxLength": 50},
                "pages": {"type": "integer", "minimum": 1},
            },
            "required": ["title", "year"],
            "additionalProperties": False,
        },
    ),
    "string_patterns": (
        "Make up a product.",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
                "code": {"type": "string", "minLength": 4, "maxLength": 4},
            },
            "required": ["sku", "email", "code"],
            "additionalProperties": False,
        },
    ),
    "array_of_objects": (
        "List two cities and their countries.",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "country": {"type": "string", "maxLength": 30},
                },
                "required": ["city", "country"],
                "additionalProperties": False,
            },
            "minItems": 2,
            "maxItems": 2,
        },
    ),
}
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "seed1": SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    "seed2": SamplingParams(temperature=1.0, top_k=40, seed=2),
    "seed3": SamplingParams(temperature=1.2, min_p=0.05, seed=3),
}


@pytest.fixture(scope="module")
def smollm2(smollm2_model_dir) -> DecoderEngine:
    return load_engine(smollm2_model_dir, threads=2, context_length=2048)


def reply(
    engine: DecoderEngine, messages: list[dict], params: GenerationParams, tools: ToolUse | None = None
):
    events = list(engine.generate(engine.chat_prompt(messages, tools=tools), params))
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    return events[:-1], finish


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_suite_when_real_model_then_every_reply_parses_and_validates(smollm2, name, sampling):
    ask, schema = SCHEMAS[name]
    params = GenerationParams(SAMPLINGS[sampling], max_tokens=300, grammar=json_schema_grammar(schema))
    tokens, finish = reply(smollm2, [{"role": "user", "content": ask}], params)
    text = "".join(t.text for t in tokens) + finish.text
    assert finish.finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


WEATHER = Tool(
    "get_weather",
    "Get the current weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
FLIGHT = Tool(
    "book_flight",
    "Book a flight",
    {
        "type": "object",
        "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["origin", "destination", "passengers"],
        "additionalProperties": False,
    },
)


@pytest.mark.parametrize("choice", ["required", "get_weather", "book_flight"])
@pytest.mark.parametrize("sampling", ["greedy", "seed1", "seed2"])
def test_forced_tool_call_when_real_model_then_parses_and_validates(smollm2, choice, sampling):
    use = ToolUse((WEATHER, FLIGHT), choice=choice, parallel=False)
    params = GenerationParams(SAMPLINGS[sampling], max_tokens=200, tools=use)
    ask = [{"role": "user", "content": "What's the weather in Paris? And book me a flight from CDG to JFK."}]
    tokens, finish = reply(smollm2, ask, params, use)
    assert finish.finish_reason == "tool_calls"
    deltas = [d for t in tokens for d in t.tool_calls] + list(finish.tool_calls)
    (name,) = [d.name for d in deltas if d.name]
    assert choice == "required" or name == choice
    arguments = json.loads("".join(d.arguments for d in deltas))
    jsonschema.validate(arguments, {"get_weather": WEATHER, "book_flight": FLIGHT}[name].parameters)
