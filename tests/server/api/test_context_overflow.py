"""A prompt that does not fit the context is refused as OpenAI refuses it, in every dialect: 400, code
`context_length_exceeded`, "This model's maximum context length is N tokens. However, your <field>
resulted in M tokens ...", `param` the field holding the prompt; Ollama's paths in Ollama's shape."""

from __future__ import annotations

import re

import pytest

from tests.server.conftest import MODEL

CONTEXT = 64
LONG = "word " * 40  # 200 characters: one token each on the scripted engine

CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/responses", {"input": LONG}, "input"),
]
OLLAMA = [
    ("/api/chat", {"messages": [{"role": "user", "content": LONG}], "truncate": False}, "messages"),
    ("/api/generate", {"prompt": LONG, "truncate": False}, "prompt"),
]
WORDS = re.compile(
    r"This model's maximum context length is 64 tokens\. However, your (\w+) resulted in (\d+) tokens\."
)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body", "field"), CASES, ids=[c[0] for c in CASES])
def test_openai_dialects_when_the_prompt_overflows_then_400_in_openais_words(live, path, body, field, stream):
    srv = live(context_length=CONTEXT)
    with srv.client() as c:
        r = c.post(path, json={"model": MODEL, "stream": stream, **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "context_length_exceeded",
        "invalid_request_error",
        field,
    )
    said = WORDS.match(error["message"])
    assert said is not None, error["message"]
    assert said.group(1) == field and int(said.group(2)) > CONTEXT


@pytest.mark.parametrize(("path", "body", "field"), OLLAMA, ids=[c[0] for c in OLLAMA])
def test_ollama_when_the_prompt_overflows_then_400_in_ollamas_shape_with_the_same_words(
    live, path, body, field
):
    srv = live(context_length=CONTEXT)
    with srv.client() as c:
        r = c.post(path, json={"model": MODEL, "stream": False, **body})
    assert r.status_code == 400
    said = WORDS.match(r.json()["error"])
    assert said is not None and said.group(1) == field, r.json()
