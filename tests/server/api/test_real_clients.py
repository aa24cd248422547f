"""Clients nobody here wrote, end to end against a live server: litellm (its `openai/`, `ollama/` and
`ollama_chat/` providers), langchain-openai (`invoke`, `stream`, `with_structured_output`, `bind_tools`)
and the openai SDK's `models.retrieve`. The plain calls run on the scripted engine (the reply is known);
structured output and tools on the tiny real model, whose random weights mean that what parses parses
because of the grammar. (The SDK's `chat.completions.parse` and `responses.*` have their own files:
tests/server/api/test_structured.py, test_dialect_structured.py, test_responses.py.)"""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

# litellm fetches its model price map from the network at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
from langchain_openai import ChatOpenAI

from tests.helpers import sdk
from tests.server.conftest import MODEL
from tests.server.fakes import REPLY
from tests.server.structured_data import WEATHER_PARAMS, structured_server

# litellm's own models warn as pydantic builds them (its code, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:Item.*ReadOnly:UserWarning")

ASK = [{"role": "user", "content": "Say something."}]
WORDS = REPLY.split()


@pytest.fixture
def scripted(live):
    return live(reply_tokens=6)


@pytest.fixture
def tiny_long_server(live, tiny_long_model_dir):
    return structured_server(live, tiny_long_model_dir)


def first_words(n: int) -> str:
    return " ".join(WORDS[:n])


# ---- litellm ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "ollama", "ollama_chat"])
def test_litellm_when_each_provider_completes_then_the_reply(scripted, provider: str) -> None:
    """ollama/ posts to /api/generate and ollama_chat/ to /api/chat, both with no Content-Type header."""
    base = scripted.url + "/v1" if provider == "openai" else scripted.url
    reply = litellm.completion(
        model=f"{provider}/{MODEL}", api_base=base, api_key="unused", messages=ASK, max_tokens=4
    )
    assert reply.choices[0].message.content.strip() == first_words(4)
    assert reply.usage.completion_tokens == 4


@pytest.mark.parametrize("provider", ["openai", "ollama", "ollama_chat"])
def test_litellm_when_each_provider_streams_then_the_pieces_join_to_the_reply(
    scripted, provider: str
) -> None:
    base = scripted.url + "/v1" if provider == "openai" else scripted.url
    stream = litellm.completion(
        model=f"{provider}/{MODEL}",
        api_base=base,
        api_key="unused",
        messages=ASK,
        max_tokens=5,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.strip() == first_words(5)


def test_litellm_when_the_prompt_overflows_then_context_window_exceeded(live) -> None:
    srv = live(context_length=64)
    long = [{"role": "user", "content": "word " * 40}]
    with pytest.raises(litellm.ContextWindowExceededError) as info:
        litellm.completion(model=f"openai/{MODEL}", api_base=srv.url + "/v1", api_key="unused", messages=long)
    assert "maximum context length is 64 tokens" in str(info.value)


@pytest.mark.parametrize("provider", ["ollama", "ollama_chat"])
def test_litellm_ollama_when_the_prompt_overflows_then_a_400_in_openais_words(live, provider: str) -> None:
    """litellm maps no Ollama error to ContextWindowExceededError (it reads status codes only for Ollama);
    the 400 carries OpenAI's wording, so a caller can still tell."""
    srv = live(context_length=64)
    long = [{"role": "user", "content": "word " * 40}]
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(
            model=f"{provider}/{MODEL}",
            api_base=srv.url,
            messages=long,
            extra_body={"truncate": False},  # Ollama's own default is a sliding window
        )
    assert "maximum context length is 64 tokens" in str(info.value)


# ---- langchain-openai ------------------------------------------------------------------------------


def chat_model(srv, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=srv.url + "/v1", api_key="unused", model=srv.app.state.runtime.model, max_retries=0, **kwargs
    )


def test_langchain_when_invoked_then_the_reply_and_its_usage(scripted) -> None:
    message = chat_model(scripted, max_tokens=3).invoke("Say something.")
    assert message.content.strip() == first_words(3)
    assert message.usage_metadata["output_tokens"] == 3
    assert message.response_metadata["finish_reason"] == "length"


def test_langchain_when_streamed_then_the_pieces_join_to_the_invoked_reply(scripted) -> None:
    model = chat_model(scripted, max_tokens=5, stream_usage=True)
    pieces = list(model.stream("Say something."))
    joined = pieces[0]
    for piece in pieces[1:]:
        joined = joined + piece
    assert joined.content == model.invoke("Say something.").content
    assert joined.usage_metadata["output_tokens"] == 5


class City(BaseModel):
    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=10**8)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output_when_invoked_then_a_parsed_object(
    tiny_long_server, method: str
) -> None:
    model = chat_model(tiny_long_server, max_tokens=300, temperature=1.0, seed=5)
    if method == "json_mode":  # json_mode asks for an object; the schema is only in the prompt
        reply = model.with_structured_output(City, method=method, include_raw=True).invoke("A city, as JSON.")
        assert isinstance(json.loads(reply["raw"].content), dict)
        return
    city = model.with_structured_output(City, method=method).invoke("A city?")
    assert isinstance(city, City)


def test_langchain_bind_tools_when_a_call_is_forced_then_tool_calls_that_follow_the_schema(
    tiny_long_server,
) -> None:
    weather = {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER_PARAMS},
    }
    model = chat_model(tiny_long_server, max_tokens=300, temperature=1.0, seed=6).bind_tools(
        [weather], tool_choice="get_weather", parallel_tool_calls=False
    )
    message = model.invoke("Weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER_PARAMS)
    streamed = None
    for piece in model.stream("Weather in Paris?"):
        streamed = piece if streamed is None else streamed + piece
    assert streamed is not None and [c["name"] for c in streamed.tool_calls] == ["get_weather"]
    jsonschema.validate(streamed.tool_calls[0]["args"], WEATHER_PARAMS)


# ---- the openai SDK: models.retrieve ------------------------------------------------------------------


def test_models_retrieve_when_listed_id_or_its_ollama_name_then_the_listed_model(scripted) -> None:
    client = sdk(scripted)
    listed = client.models.list().data[0]
    for name in (MODEL, MODEL + ":latest"):
        got = client.models.retrieve(name)
        assert got.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(MODEL + ":q8")  # another tag is another model
