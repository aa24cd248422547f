"""Embeddings routed upstream, end to end: a second simmer process serves a store with the tiny sentence
encoder (tests/server/api/embedding_store.py), the local simmer has none. Every dialect's embeddings come
back as the upstream's own vectors; policy local never connects; an installed encoder answers when the
upstream is down and the decision allows it (upstream_failed), and a request that forced the upstream
gets upstream_unavailable."""

from __future__ import annotations

import base64
import logging
import shutil
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from server.serving.model_setup import serve_store
from tests.server.api.embedding_store import ENCODER, encoder_home
from tests.server.conftest import make_settings, wait_ready
from tests.server.routing.conftest import UPSTREAM_KEY, UpstreamProcess, free_port, start_upstream
from tests.server.routing.proxy import CountingProxy

TEXTS = ["the cat sat on a mat", "a big red dog ran", "hello world"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_gguf):
    return encoder_home(tmp_path_factory.mktemp("embed-store"), tiny_gguf)[0]


@pytest.fixture(scope="module")
def encoder_upstream(store, tmp_path_factory) -> Iterator[UpstreamProcess]:
    home = tmp_path_factory.mktemp("embed-upstream") / "home"
    shutil.copytree(store, home)
    proc = start_upstream(None, home, model="tiny-a", context_length="128", threads="1")
    yield proc
    proc.stop()


@pytest.fixture
def proxy(encoder_upstream) -> Iterator[CountingProxy]:
    p = CountingProxy(encoder_upstream.port).start()
    yield p
    p.stop()


def upstream_post(upstream: UpstreamProcess, path: str, body: dict) -> httpx.Response:
    """The upstream's own answer (with its key)."""
    auth = {"Authorization": f"Bearer {upstream.key}"}
    return httpx.post(upstream.url + path, json=body, headers=auth, timeout=60)


def routed(live, proxy: CountingProxy, **overrides):
    """The local simmer (the scripted engine: no encoder installed) whose upstream is `proxy`."""
    settings = {
        "route": "auto",
        "upstream_url": proxy.url + "/v1",
        "upstream_api_key": UPSTREAM_KEY,
        "upstream_models": {ENCODER: ENCODER},
        **overrides,
    }
    return live(**settings)


def test_embeddings_when_the_encoder_is_only_upstream_then_every_dialect_gets_the_upstreams_vectors(
    live, proxy, encoder_upstream, caplog
) -> None:
    srv = routed(live, proxy)
    own = upstream_post(encoder_upstream, "/v1/embeddings", {"model": ENCODER, "input": TEXTS}).json()
    with srv.client() as c, caplog.at_level(logging.INFO, logger="simmer.request"):
        # the client's own key is not the upstream's: only simmer's key goes there
        r = c.post(
            "/v1/embeddings",
            json={"model": ENCODER, "input": TEXTS},
            headers={"Authorization": "Bearer the-clients-own-key"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-simmer-route"] == "upstream; reason=model"
        got = r.json()
        assert [d["embedding"] for d in got["data"]] == [d["embedding"] for d in own["data"]]
        assert got["model"] == ENCODER and got["usage"] == own["usage"] and own["usage"]["prompt_tokens"] > 0
        # base64 is this server's encoding of the same vectors (the upstream was asked for floats)
        b64 = c.post(
            "/v1/embeddings", json={"model": ENCODER, "input": TEXTS[0], "encoding_format": "base64"}
        )
        first = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), dtype="<f4")
        alone = upstream_post(encoder_upstream, "/v1/embeddings", {"model": ENCODER, "input": TEXTS[0]})
        assert first.tolist() == np.float32(alone.json()["data"][0]["embedding"]).tolist()
        # Ollama's and llama.cpp's routes: their own shapes, the same vectors
        embed = c.post("/api/embed", json={"model": ENCODER, "input": TEXTS})
        assert embed.status_code == 200 and embed.headers["x-simmer-route"] == "upstream; reason=model"
        their = upstream_post(encoder_upstream, "/api/embed", {"model": ENCODER, "input": TEXTS}).json()
        assert embed.json()["embeddings"] == their["embeddings"]
        assert embed.json()["prompt_eval_count"] == their["prompt_eval_count"]
        legacy = c.post("/api/embeddings", json={"model": ENCODER, "prompt": TEXTS[1]}).json()
        want = upstream_post(encoder_upstream, "/api/embeddings", {"model": ENCODER, "prompt": TEXTS[1]})
        assert legacy["embedding"] == want.json()["embedding"]
        llama = c.post("/embedding", json={"model": ENCODER, "content": TEXTS[2]})
        want = upstream_post(encoder_upstream, "/embedding", {"model": ENCODER, "content": TEXTS[2]}).json()
        assert llama.status_code == 200 and llama.json() == want
    assert proxy.connections >= 1
    logged = [r for r in caplog.records if " embeddings " in r.getMessage()]
    assert logged and all(r.fields["route"] == "upstream/model" for r in logged)  # type: ignore[attr-defined]
    assert logged[0].fields["tokens"] == own["usage"]["prompt_tokens"]  # type: ignore[attr-defined]
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert 'simmer_routed_requests_total{reason="model",route="upstream"} 5.0' in metrics


def test_embeddings_when_upstream_refuses_the_input_then_its_refusal_in_simmers_words(live, proxy) -> None:
    srv = routed(live, proxy)
    with srv.client() as c:
        r = c.post("/v1/embeddings", json={"model": ENCODER, "input": "the cat " * 40})  # over its context
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "upstream HTTP 4" in r.json()["error"]["message"]


def test_embeddings_when_policy_local_then_nothing_leaves(live, proxy) -> None:
    srv = routed(live, proxy, route="local")
    with srv.client() as c:
        r = c.post("/v1/embeddings", json={"model": ENCODER, "input": "hi", "route": "upstream"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "upstream_not_allowed"
        r = c.post("/v1/embeddings", json={"model": ENCODER, "input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = c.post(
            "/api/embed", json={"model": ENCODER, "input": "hi"}, headers={"X-Simmer-Route": "upstream"}
        )
        assert r.status_code == 403
    assert proxy.connections == 0


def test_embeddings_when_upstream_down_then_the_installed_encoder_answers_unless_upstream_was_forced(
    live, tmp_path, store, encoder_upstream
) -> None:
    copy = tmp_path / "home"
    shutil.copytree(store, copy)
    overrides = {
        "home": copy,
        "model": "tiny-a",
        "context_length": 128,
        "threads": 1,
        "route": "upstream",
        "upstream_url": f"http://127.0.0.1:{free_port()}/v1",  # nothing listens
        "upstream_breaker_failures": 100,
    }
    srv = live(served=serve_store(make_settings(tmp_path, **overrides)), **overrides)
    wait_ready(srv)
    own = upstream_post(encoder_upstream, "/v1/embeddings", {"model": ENCODER, "input": TEXTS}).json()
    with srv.client() as c:
        r = c.post("/v1/embeddings", json={"model": ENCODER, "input": TEXTS})
        assert r.status_code == 200, r.text
        assert r.headers["x-simmer-route"] == "local; reason=upstream_failed"
        got = np.array([d["embedding"] for d in r.json()["data"]])
        assert np.abs(got - np.array([d["embedding"] for d in own["data"]])).max() < 1e-5
        forced = c.post("/v1/embeddings", json={"model": ENCODER, "input": "hi", "route": "upstream"})
        assert forced.status_code == 503 and forced.json()["error"]["code"] == "upstream_unavailable"
        here = c.post(
            "/v1/embeddings", json={"model": ENCODER, "input": "hi"}, headers={"X-Simmer-Route": "local"}
        )
        assert here.headers["x-simmer-route"] == "local; reason=request"
        # a generation model's id is refused by its kind, wherever it would be served
        wrong = c.post("/v1/embeddings", json={"model": "tiny-a", "input": "hi"})
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_model_kind"
