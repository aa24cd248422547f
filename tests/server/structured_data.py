"""What the structured-output tests of every dialect share: the schemas, the tools and the server, on the
tiny real model with a 4,096-token context (tiny_long_model_dir, in conftest: room for a tools description).
Its weights are random, so what parses in those tests parses because of the grammar."""

from __future__ import annotations

from pydantic import BaseModel, Field

from models.runtime.engine import load_engine
from tests.server.fakes import RecordingEngine

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
        "rivers": {"type": "array", "items": {"enum": ["Seine", "Loire"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["city", "population", "rivers"],
    "additionalProperties": False,
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "Paris?"}]


class River(BaseModel):
    name: str = Field(max_length=12)
    length_km: int = Field(ge=1, le=7000)


class Country(BaseModel):
    name: str = Field(max_length=12)
    rivers: list[River] = Field(min_length=1, max_length=2)


def structured_server(live, tiny_long_model_dir):
    """A live server whose engine records each generation (the rendered prompt is checked through it)."""
    engine = RecordingEngine(load_engine(tiny_long_model_dir, threads=1, context_length=4096))
    return live(engine=engine, model=engine.model_id)
