"""The embedding model the worker opens is a model like the others: /api/ps lists it with when its keep_alive
runs out, a request's keep_alive (Ollama's /api/embed) sets how long it stays (0 closes it after the request),
and the memory plan counts it while it is open."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.api.embedding_store import ENCODER, encoder_home, encoder_server


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_gguf):
    return encoder_home(tmp_path_factory.mktemp("encoder-keep-alive"), tiny_gguf)


def running(srv) -> dict[str, dict]:
    return {m["model"]: m for m in httpx.get(srv.url + "/api/ps").json()["models"]}


def embed(srv, **extra) -> None:
    r = httpx.post(
        srv.url + "/api/embed", json={"model": ENCODER, "input": "the cat sat", **extra}, timeout=60
    )
    assert r.status_code == 200, r.text


def test_encoder_when_used_then_listed_by_ps_counted_by_the_plan_and_closed_by_keep_alive(
    live, tmp_path, home
):
    srv = encoder_server(live, tmp_path, home[0])
    pool = srv.app.state.runtime.served.pool
    assert ENCODER not in {m.split(":")[0] for m in running(srv)} and pool.outside() == []

    embed(srv)  # the server's keep_alive: kept
    listed = {m.split(":")[0]: m for m in running(srv)}
    assert ENCODER in listed
    shown = running(srv)[listed[ENCODER]]
    assert shown["size"] > 0 and shown["expires_at"]
    [(model, size, _, busy)] = pool.outside()  # what the memory plan counts beside the pool
    assert (model, size, busy) == (ENCODER, shown["size"], False)

    embed(srv, keep_alive=0)  # closed once the request is answered
    assert ENCODER not in {m.split(":")[0] for m in running(srv)} and pool.outside() == []

    embed(srv, keep_alive="1s")
    assert ENCODER in {m.split(":")[0] for m in running(srv)}
    deadline = time.monotonic() + 10
    while pool.outside() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.outside() == []  # the idle worker closed it when its keep_alive ran out


@pytest.mark.parametrize("keep_alive", ["soon", [1], "1e400"])
def test_encoder_keep_alive_when_malformed_then_ollama_400(live, tmp_path, home, keep_alive):
    srv = encoder_server(live, tmp_path, home[0])
    r = httpx.post(srv.url + "/api/embed", json={"model": ENCODER, "input": "x", "keep_alive": keep_alive})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]


def test_encoder_when_idle_and_a_load_needs_its_room_then_closed_for_it(live, tmp_path, home) -> None:
    from server.serving.memory_plan import MemoryBudget

    srv = encoder_server(live, tmp_path, home[0])
    served = srv.app.state.runtime.served
    unload = {"model": "tiny-a", "messages": [], "keep_alive": 0}
    assert httpx.post(srv.url + "/api/chat", json=unload).status_code == 200
    deadline = time.monotonic() + 10
    while "tiny-a" in served.pool.loaded_ids() and time.monotonic() < deadline:
        time.sleep(0.05)
    embed(srv)
    [(_, encoder_bytes, _, _)] = served.pool.outside()
    entry = served.catalog.get("tiny-a")
    need = served.cost(entry, entry.default_variant).with_rows(1).total  # its least: one reply at a time
    served.pool.budget = MemoryBudget(need + encoder_bytes // 2, 0)  # the chat model fits only without it
    chat = {"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert served.pool.outside() == []  # the idle encoder went, least recently used, to make room
