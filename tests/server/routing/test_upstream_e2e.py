"""Routing against a real upstream: a second simmer process on the same tiny model (conftest.py).

Both sides run the same weights (variant q4), so a greedy reply served upstream must equal the one served
locally, token for token: that is "one output shape" checked on content, not only on keys.
"""

from __future__ import annotations

import pytest

from tests.helpers import sdk
from tests.server.routing.conftest import MODEL
from tests.server.routing.helpers import CHAT, stream, text_of

TEXT = {"model": MODEL, "prompt": "once upon a time", "temperature": 0, "max_tokens": 12}


@pytest.mark.parametrize(
    ("path", "body", "kind"), [("/v1/chat/completions", CHAT, "chat"), ("/v1/completions", TEXT, "text")]
)
def test_route_upstream_when_streamed_then_same_text_and_shape_as_local(
    local, proxy, path, body, kind
) -> None:
    srv = local()
    r_local, local_chunks, _ = stream(srv, path, {**body, "route": "local"})
    assert proxy.connections == 0
    r, chunks, done = stream(srv, path, {**body, "route": "upstream"})
    assert r.status_code == 200 and done
    assert proxy.connections == 1
    assert r.headers["x-simmer-route"] == "upstream; reason=request"
    assert r_local.headers["x-simmer-route"] == "local; reason=request"
    assert text_of(chunks, kind) == text_of(local_chunks, kind) != ""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    assert {c["object"] for c in chunks} == {obj} and {c["model"] for c in chunks} == {MODEL}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-" if kind == "chat" else "cmpl-")
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    usage = chunks[-1]
    assert final["route"] == {"served": "upstream", "reason": "request"}
    assert usage["choices"] == [] and usage["route"] == final["route"]
    assert usage["usage"]["completion_tokens"] == local_chunks[-1]["usage"]["completion_tokens"] > 0
    assert usage["usage"]["prompt_tokens"] == local_chunks[-1]["usage"]["prompt_tokens"]
    assert usage["timings"]["predicted_n"] == usage["usage"]["completion_tokens"]
    assert usage["timings"]["ttft_ms"] > 0
    assert final["choices"][0]["finish_reason"] == local_chunks[-2]["choices"][0]["finish_reason"]


def test_route_upstream_when_not_streamed_then_openai_sdk_reads_it(local, proxy) -> None:
    srv = local()
    client = sdk(srv)
    here = client.chat.completions.create(**CHAT, extra_body={"route": "local"})
    there = client.chat.completions.with_raw_response.create(**CHAT, extra_body={"route": "upstream"})
    reply = there.parse()
    assert there.headers["x-simmer-route"] == "upstream; reason=request"
    assert reply.choices[0].message.content == here.choices[0].message.content
    assert reply.model == MODEL and reply.object == "chat.completion"
    assert reply.usage.completion_tokens == here.usage.completion_tokens
    assert reply.model_extra["route"] == {"served": "upstream", "reason": "request"}
    assert here.model_extra["route"] == {"served": "local", "reason": "request"}
    text = client.completions.create(**TEXT, extra_body={"route": "upstream"})
    assert text.object == "text_completion" and text.choices[0].text
    assert text.model_extra["route"]["served"] == "upstream"
    assert proxy.connections >= 1


def test_header_when_upstream_then_served_upstream_and_field_local_wins(local, proxy) -> None:
    srv = local()
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"X-Simmer-Route": "upstream"})
        assert r.json()["route"] == {"served": "upstream", "reason": "request"}
        # the body forbids upstream: forbidding always wins
        r = c.post(
            "/v1/chat/completions", json={**CHAT, "route": "local"}, headers={"X-Simmer-Route": "upstream"}
        )
        assert r.json()["route"] == {"served": "local", "reason": "request"}
        bad = c.post("/v1/chat/completions", json=CHAT, headers={"X-Simmer-Route": "cloud"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Simmer-Route"


def test_auto_when_device_cool_then_local_offline_first(local, proxy) -> None:
    srv = local()
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-simmer-route"] == "local; reason=offline_first"
    assert proxy.connections == 0


def test_request_log_when_served_upstream_then_route_named_and_no_text(local, caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="simmer.request")
    srv = local()
    with srv.client() as c:
        reply = c.post("/v1/chat/completions", json={**CHAT, "route": "upstream"}).json()
    lines = [r.getMessage() for r in caplog.records if r.name == "simmer.request"]
    assert any(line.endswith("route=upstream/request") for line in lines), lines
    text = reply["choices"][0]["message"]["content"]
    assert len(text) >= 8  # long enough that finding it in a log line would mean it was logged
    assert all("the cat sat" not in line and text not in line for line in lines)


def test_cors_when_web_app_origin_then_route_header_allowed_and_exposed(local) -> None:
    srv = local(cors_origins=["http://app.example"])
    with srv.client() as c:
        pre = c.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type,x-simmer-route",
            },
        )
        assert (
            pre.status_code == 200 and "x-simmer-route" in pre.headers["access-control-allow-headers"].lower()
        )
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://app.example"})
        assert "x-simmer-route" in r.headers["access-control-expose-headers"].lower()
