"""What goes over the wire to an upstream, and what comes back when it misbehaves: a scripted upstream (a real
HTTP server) records requests and answers as each test sets (scripted.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from server.routing.breaker import Breaker
from tests.server.conftest import MODEL
from tests.server.routing.helpers import sse_chunks, text_of
from tests.server.routing.scripted import Script, ScriptedUpstream, chat_chunk

KEY = "sk-scripted-0123456789abcdef"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture
def scripted():
    s = ScriptedUpstream().start()
    yield s
    s.stop()


@pytest.fixture
def via(live, scripted):
    """via(**settings) -> a local server (scripted engine) whose upstream is the scripted one."""

    def make(**overrides):
        return live(**{"route": "auto", "upstream_url": scripted.url, "upstream_api_key": KEY, **overrides})

    return make


def post(srv, body: dict, headers: dict | None = None) -> httpx.Response:
    with srv.client() as c:
        return c.post("/v1/chat/completions", json=body, headers=headers)


def stream_events(srv, body: dict) -> tuple[list[dict], bool]:
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_chunks(r)


def test_forwarded_when_client_sends_everything_then_upstream_gets_only_what_it_needs(via, scripted) -> None:
    srv = via(api_key="client-key-local", upstream_models={MODEL: "org/Big-Model"})
    body = {
        **CHAT,
        "messages": [
            {"role": "developer", "content": "be brief", "name": "ops"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "temperature": 0.3,
        "top_k": 20,
        "seed": 7,
        "user": "alice@example.com",
        "truncate": True,
        "governor_events": True,
        "route": "upstream",
        "stream_options": {"include_usage": False},
    }
    headers = {
        "Authorization": "Bearer client-key-local",
        "X-Forwarded-For": "10.1.2.3",
        "Cookie": "session=abc",
        "X-Simmer-Route": "upstream",
    }
    r = post(srv, body, headers)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello world"
    sent, got_headers = scripted.received[-1]
    assert sent == {
        "model": "org/Big-Model",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0.3,
        "top_k": 20,
        "seed": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert got_headers["authorization"] == f"Bearer {KEY}"
    assert not {"cookie", "x-forwarded-for", "x-simmer-route"} & set(got_headers)
    assert "client-key-local" not in json.dumps(got_headers)
    assert r.json()["model"] == MODEL  # as the client asked


@pytest.mark.parametrize(
    ("script", "status", "code", "words"),
    [
        (
            Script(400, {"error": {"message": "temperature too hot", "code": None}}),
            400,
            "invalid_parameter",
            "HTTP 400: temperature too hot",
        ),
        (
            Script(404, {"error": {"message": "no such model"}}),
            404,
            "model_not_found",
            "HTTP 404: no such model",
        ),
        (
            Script(400, {"error": {"message": "too long", "code": "context_length_exceeded"}}),
            400,
            "context_length_exceeded",
            "HTTP 400: too long",
        ),
        (Script(422, {"detail": "bad field"}), 400, "invalid_parameter", "HTTP 422: bad field"),
        (Script(401, {"error": {"message": "bad key"}}), 502, "upstream_error", "HTTP 401: bad key"),
        (
            Script(307, "", headers={"Location": "https://elsewhere.example/v1/chat/completions"}),
            502,
            "upstream_error",
            "HTTP 307: redirected to https://elsewhere.example",
        ),
        (Script(500, "boom"), 503, "upstream_unavailable", "HTTP 500: boom"),
        (
            Script(503, {"error": {"message": "overloaded"}}),
            503,
            "upstream_unavailable",
            "HTTP 503: overloaded",
        ),
        (Script(200, events=["not json"]), 503, "upstream_unavailable", "bad_response"),
        (
            Script(200, events=[json.dumps({"error": {"message": "engine died"}})]),
            503,
            "upstream_unavailable",
            "engine died",
        ),
        (Script(200, events=[chat_chunk("a")]), 503, "upstream_unavailable", "dropped"),
    ],
)
def test_errors_when_upstream_fails_before_first_token_then_mapped_with_its_status(
    via, scripted, script, status, code, words
) -> None:
    """Forced upstream (no fallback): each failure in simmer's vocabulary, the upstream's status in the text.
    (The last row sent a token and then closed without finishing: a reply that started, see below.)"""
    scripted.script = script
    srv = via()
    body = {**CHAT, "route": "upstream"}
    if script.events == [chat_chunk("a")]:
        chunks, done = stream_events(srv, body)
        assert (
            done
            and chunks[-1]["error"]["code"] == "upstream_error"
            and words in chunks[-1]["error"]["message"]
        )
        assert text_of(chunks[:-1], "chat") == "a"
        return
    r = post(srv, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and words in err["message"], err


def test_error_when_upstream_not_sse_then_bad_response(via, scripted) -> None:
    scripted.script = Script(200, events=[], headers={"content-type": "application/json"})
    r = post(via(), {**CHAT, "route": "upstream"})
    assert r.status_code == 503 and "text/event-stream" in r.json()["error"]["message"]


def test_error_when_upstream_quotes_the_key_then_redacted(via, scripted) -> None:
    scripted.script = Script(400, {"error": {"message": f"key {KEY} is not valid for this"}})
    r = post(via(), {**CHAT, "route": "upstream"})
    assert KEY not in r.text and "[redacted]" in r.json()["error"]["message"]


def test_retry_after_when_429_then_breaker_open_for_it_and_no_request_until_then(via, scripted) -> None:
    scripted.script = Script(429, {"error": {"message": "slow down"}}, headers={"Retry-After": "120"})
    srv = via(route="upstream", upstream_breaker_failures=5)
    r = post(srv, {**CHAT, "route": "upstream"})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 119
    assert "HTTP 429" in r.json()["error"]["message"]
    for _ in range(3):  # policy upstream: served on the device while the upstream asked for quiet
        assert post(srv, CHAT).json()["route"] == {"served": "local", "reason": "breaker_open"}
    refused = post(srv, {**CHAT, "route": "upstream"})
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 118
    assert len(scripted.received) == 1


def test_mid_stream_when_upstream_sends_error_event_then_error_event_and_done(via, scripted) -> None:
    scripted.script = Script(
        events=[chat_chunk("one"), chat_chunk(" two"), json.dumps({"error": {"message": "oom"}})]
    )
    chunks, done = stream_events(via(route="upstream"), CHAT)
    assert done and text_of(chunks[:-1], "chat") == "one two"
    assert chunks[-1]["error"]["code"] == "upstream_error" and "oom" in chunks[-1]["error"]["message"]


def test_stream_when_cut_after_finish_reason_then_complete(via, scripted) -> None:
    scripted.script = Script(events=[chat_chunk("done", "length")])  # no usage chunk, no [DONE]
    r = post(via(route="upstream"), CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 1  # none sent: counted from the tokens relayed


def test_fallback_when_policy_upstream_and_bad_stream_then_local(via, scripted) -> None:
    scripted.script = Script(200, events=["not json"])
    r = post(via(route="upstream", breaker=Breaker(5, 30.0)), CHAT)
    assert r.status_code == 200 and r.json()["route"] == {"served": "local", "reason": "upstream_failed"}


def test_logprobs_when_upstream_sends_them_then_relayed_per_token(via, scripted) -> None:
    entries = [
        {
            "token": "he",
            "logprob": -0.5,
            "bytes": [104, 101],
            "top_logprobs": [{"token": "he", "logprob": -0.5, "bytes": [104, 101]}],
        },
        {"token": "llo", "logprob": -1.25, "bytes": [108, 108, 111], "top_logprobs": []},
    ]
    first = json.loads(chat_chunk("hello"))
    first["choices"][0]["logprobs"] = {"content": entries}
    usage = {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    scripted.script = Script(events=[json.dumps(first), chat_chunk("", "stop"), json.dumps(usage), "[DONE]"])
    r = post(via(route="upstream"), {**CHAT, "logprobs": True, "top_logprobs": 1})
    body = r.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [("he", -0.5), ("llo", -1.25)]
    assert content[0]["top_logprobs"] == [{"token": "he", "logprob": -0.5, "bytes": [104, 101]}]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 2
    assert scripted.received[-1][0]["logprobs"] is True and scripted.received[-1][0]["top_logprobs"] == 1


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A private CA and a certificate for 127.0.0.1 signed by it (openssl CLI)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("tls")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=simmer test CA",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    )
    return d


def test_tls_when_upstream_cert_from_private_ca_then_refused_unless_ca_bundle_set(live, tls_files) -> None:
    up = ScriptedUpstream(
        certfile=str(tls_files / "server.pem"), keyfile=str(tls_files / "server.key")
    ).start()
    try:
        settings = {"route": "upstream", "upstream_url": up.url, "upstream_api_key": KEY}
        strict = live(**settings)
        r = post(strict, {**CHAT, "route": "upstream"})
        assert r.status_code == 503 and "certificate verify failed" in r.json()["error"]["message"]
        assert up.received == []  # no request (and no key) went over an unverified connection
        trusting = live(**settings, upstream_ca_bundle=tls_files / "ca.pem")
        r = post(trusting, {**CHAT, "route": "upstream"})
        assert r.status_code == 200 and r.json()["route"] == {"served": "upstream", "reason": "request"}
        assert r.json()["choices"][0]["message"]["content"] == "hello world"
        assert up.received[0][1]["authorization"] == f"Bearer {KEY}"
    finally:
        up.stop()
