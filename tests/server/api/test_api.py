"""OpenAI-compatible endpoints against a live server, with the real openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests import aio
from tests.helpers import sdk
from tests.server.conftest import MODEL

MSG = [{"role": "user", "content": "Say something"}]


def sse_data(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_chat_when_openai_sdk_sync_then_completion_with_usage_and_timings(live) -> None:
    srv = live()
    resp = sdk(srv).chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 4
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 4
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0
    extra = resp.model_extra
    assert extra["timings"]["predicted_n"] == 4
    assert extra["truncated"] is False


def test_chat_when_openai_sdk_streaming_then_text_matches_non_streaming(live) -> None:
    srv = live()
    client = sdk(srv)
    full = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0, seed=1)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=12,
        temperature=0,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_when_openai_sdk_async_then_concurrent_requests_complete(live) -> None:
    srv = live(token_delay_s=0.002)

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            resps = await asyncio.gather(
                *(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3) for _ in range(3))
            )
            return [r.choices[0].message.content or "" for r in resps]

    texts = aio.run(main())
    assert len(texts) == 3 and all(texts)


def test_completions_when_sdk_with_logprobs_then_text_and_logprobs(live) -> None:
    srv = live()
    resp = sdk(srv).completions.create(model=MODEL, prompt="Once upon", max_tokens=3, logprobs=2)
    choice = resp.choices[0]
    assert choice.text
    assert len(choice.logprobs.tokens) == 3
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    assert resp.object == "text_completion"


def test_completions_when_streaming_then_chunks_then_done(live) -> None:
    srv = live()
    with (
        srv.client() as c,
        c.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "stream": True}) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        data = sse_data(r.iter_lines())
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(ch["choices"][0]["text"] for ch in chunks)


def test_chat_when_logprobs_requested_then_content_logprobs(live) -> None:
    srv = live()
    resp = sdk(srv).chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 3
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    assert all(len(c.top_logprobs) <= 2 and c.bytes for c in content)


def test_chat_when_stop_string_then_text_ends_before_it(live) -> None:
    srv = live()
    first = sdk(srv).chat.completions.create(model=MODEL, messages=MSG, max_tokens=6)
    words = first.choices[0].message.content.split()
    resp = sdk(srv).chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, stop=[words[2]])
    assert resp.choices[0].finish_reason == "stop"
    assert words[2] not in resp.choices[0].message.content
    assert resp.choices[0].message.content.split() == words[:2]


def test_models_when_listed_then_served_model(live) -> None:
    srv = live()
    models = sdk(srv).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_when_model_empty_then_served_model_answers(live) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "", "messages": MSG, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_chat_when_unknown_model_then_404_model_not_found(live) -> None:
    srv = live()
    with pytest.raises(openai.NotFoundError) as info:
        sdk(srv).chat.completions.create(model="gpt-4o", messages=MSG)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"


@pytest.mark.parametrize("n", [0, 9])
def test_chat_when_n_is_out_of_range_then_400_naming_n(live, n: int) -> None:
    srv = live()
    with pytest.raises(openai.BadRequestError) as info:
        sdk(srv).chat.completions.create(model=MODEL, messages=MSG, n=n)
    assert info.value.body["param"] == "n"
    assert "from 1 to 8" in info.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_when_prompt_too_long_then_400_context_length_exceeded(live, stream: bool) -> None:
    srv = live(context_length=64)
    long = [{"role": "user", "content": "word " * 100}]
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": long, "stream": stream})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert set(err) == {"message", "type", "code", "param"}


def test_chat_when_truncate_then_answers_and_reports_truncated(live) -> None:
    srv = live(context_length=64)
    long = [{"role": "system", "content": "Be brief."}] + [{"role": "user", "content": "word " * 30}] * 2
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": long, "truncate": True, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["truncated"] is True
    assert body["usage"]["prompt_tokens"] <= 64


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": "not a list"}, "messages"),
        ({"messages": MSG, "max_tokens": "many"}, "max_tokens"),
        ({"messages": MSG, "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({}, "messages"),
    ],
)
def test_chat_when_wrong_types_then_400_openai_shape_naming_param(live, payload: dict, param: str) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=payload)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_parameter"


def test_chat_when_malformed_json_then_400_invalid_json(live) -> None:
    srv = live()
    with srv.client() as c:
        r = c.post(
            "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


def test_unknown_route_when_requested_then_404_openai_shape(live) -> None:
    srv = live()
    with srv.client() as c:
        r = c.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


def test_chat_when_same_prompt_twice_then_cached_tokens_reported(live) -> None:
    srv = live()
    client = sdk(srv)
    client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
    again = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
