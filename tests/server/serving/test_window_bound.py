"""A reply under the sliding window (truncate) is bounded (SIMMER_WINDOW_REPLY_CONTEXTS contexts' worth of
tokens, finish_reason length) whatever max_tokens asks: before, `max_tokens: 1e300` (a valid integer) or none
with a model that never says EOS generated until the client left. A tiny real model, over HTTP."""

from __future__ import annotations

import httpx
import pytest

from server.serving.model_setup import serve_folders
from tests.server.conftest import make_settings, wait_ready

CONTEXT = 64


@pytest.fixture
def start_pair_server(live, tmp_path, tiny_pair_dirs):
    def start(**overrides):
        overrides = {"model": "tiny-small", "context_length": CONTEXT, **overrides}
        settings = make_settings(tmp_path, **overrides)
        srv = live(served=serve_folders(settings, tiny_pair_dirs), **overrides)
        wait_ready(srv)
        return srv

    return start


def post(srv, path: str, body: bytes) -> dict:
    r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("contexts", [None, 2])
def test_window_when_max_tokens_huge_or_none_then_reply_bounded_with_length(start_pair_server, contexts):
    srv = start_pair_server() if contexts is None else start_pair_server(window_reply_contexts=contexts)
    bound = (contexts or 1) * CONTEXT
    chat = b'"messages": [{"role": "user", "content": "hi"}], "truncate": true, "ignore_eos": true'
    for max_tokens in (b', "max_tokens": 1e300', b', "max_tokens": 100000000000000000000000', b""):
        body = post(srv, "/v1/chat/completions", b"{" + chat + max_tokens + b', "temperature": 0}')
        assert body["choices"][0]["finish_reason"] == "length", max_tokens
        assert body["usage"]["completion_tokens"] == bound and body["truncated"] is True
    # a cap below the bound still rules; without truncate the context itself ends the reply
    small = post(srv, "/v1/chat/completions", b"{" + chat + b', "max_tokens": 5}')
    assert small["usage"]["completion_tokens"] == 5
    plain = b'{"messages": [{"role": "user", "content": "hi"}], "ignore_eos": true, "max_tokens": 1e300}'
    body = post(srv, "/v1/chat/completions", plain)
    assert body["choices"][0]["finish_reason"] == "length" and body["truncated"] is False
    used = body["usage"]["completion_tokens"] + body["usage"]["prompt_tokens"]
    assert CONTEXT <= used <= CONTEXT + 1  # the last token sampled needs no room in the KV


def test_window_when_ollama_num_predict_unbounded_then_reply_bounded(start_pair_server):
    """Ollama's truncate defaults to true: `num_predict` -1 ("until a stop") or huge ends at the bound."""
    srv = start_pair_server()
    for predict in (b"-1", b"1e300"):
        body = b'{"model": "tiny-small", "prompt": "hi", "raw": true, "stream": false, '
        options = b'"options": {"num_predict": ' + predict + b', "temperature": 0}}'
        reply = post(srv, "/api/generate", body + options)
        if reply["done_reason"] == "stop":  # the tiny model said EOS first: nothing to bound
            pytest.skip("the tiny model ends its reply itself")
        assert reply["done_reason"] == "length" and reply["eval_count"] == CONTEXT
