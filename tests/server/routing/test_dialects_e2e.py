"""Ollama's /api/chat and /api/generate and the Responses API route like the OpenAI endpoints: the upstream
speaks OpenAI, its reply becomes the worker's events, and each dialect renders them. Under SIMMER_ROUTE=local
nothing leaves the device (the proxy counts connections)."""

from __future__ import annotations

import json

import httpx
import openai

from tests.server.routing.conftest import MODEL

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "the cat sat"}],
    "options": {"temperature": 0, "num_predict": 12},
}


def ndjson(srv, path: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response, list[dict]]:
    with (
        httpx.Client(base_url=srv.url, timeout=30) as c,
        c.stream("POST", path, json=body, headers=headers) as r,
    ):
        lines = [json.loads(line) for line in r.iter_lines() if line]
    return r, lines


def test_ollama_chat_when_routed_upstream_then_same_text_as_local_in_ndjson(local, proxy) -> None:
    srv = local()
    _, here = ndjson(srv, "/api/chat", {**CHAT, "route": "local"})
    assert proxy.connections == 0
    r, there = ndjson(srv, "/api/chat", CHAT, headers={"X-Simmer-Route": "upstream"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    assert r.headers["x-simmer-route"] == "upstream; reason=request" and proxy.connections == 1
    text = "".join(line["message"]["content"] for line in there)
    assert text == "".join(line["message"]["content"] for line in here) != ""
    assert there[-1]["done"] and there[-1]["eval_count"] == here[-1]["eval_count"] > 0
    assert {line["model"] for line in there} == {MODEL}


def test_ollama_generate_when_raw_and_upstream_then_text_completion_upstream(local, proxy) -> None:
    srv = local()
    body = {
        "model": MODEL,
        "prompt": "once upon a time",
        "raw": True,
        "stream": False,
        "options": CHAT["options"],
    }
    with srv.client() as c:
        here = c.post("/api/generate", json={**body, "route": "local"}).json()
        there = c.post("/api/generate", json={**body, "route": "upstream"})
    assert there.headers["x-simmer-route"] == "upstream; reason=request"
    assert (
        there.json()["response"] == here["response"] != ""
        and there.json()["done_reason"] == here["done_reason"]
    )


def test_responses_when_routed_upstream_then_the_same_response(local, proxy) -> None:
    srv = local()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    args = {"model": MODEL, "input": "the cat sat", "temperature": 0, "max_output_tokens": 12}
    here = client.responses.create(**args, extra_body={"route": "local"})
    there = client.responses.create(**args, extra_body={"route": "upstream"})
    assert (
        there.output_text == here.output_text != "" and there.usage.output_tokens == here.usage.output_tokens
    )
    assert proxy.connections >= 1


def test_policy_local_when_dialects_ask_for_upstream_then_refused_and_nothing_leaves(local, proxy) -> None:
    srv = local(route="local")
    with srv.client() as c:
        r = c.post("/api/chat", json={**CHAT, "stream": False}, headers={"X-Simmer-Route": "upstream"})
        assert r.status_code == 403 and "SIMMER_ROUTE=local" in r.json()["error"]
        r = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "route": "upstream"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "upstream_not_allowed"
        ok = c.post("/api/chat", json={**CHAT, "stream": False})
        assert ok.status_code == 200 and ok.headers["x-simmer-route"] == "local; reason=policy"
    assert proxy.connections == 0
