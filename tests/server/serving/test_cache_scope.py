"""The prefix cache is no oracle across clients (serving/cache_scope.py): after one client sends a door code,
another's guesses get the same cached_tokens whether they are right or wrong. Within one scope the cache
still works. On the tiny real model (the prefix cache is the engine's), two KV slots."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from models.runtime.engine import load_engine
from server.serving.cache_scope import cache_scope
from tests.server.conftest import LiveServer, make_settings, start_server

SECRET = "The door code is 4 7 1 9. Keep it safe."
# Each guess differs from the one before at its first digit: what a guess shares with the attacker's own
# previous prompt is the same for all of them, so any difference could only come from the secret.
GUESSES = ["1 2 3 4", "2 0 0 0", "4 7 1 0", "4 7 1 9"]


def scoped_server(tmp_path: Path, tiny_model_dir: Path, **settings) -> LiveServer:
    engine = load_engine(tiny_model_dir, variant="q4", threads=1, context_length=128)
    base = {"model": engine.model_id, "prefix_cache_slots": 2}
    return start_server(make_settings(tmp_path, **{**base, **settings}), engine=engine)


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory) -> Iterator[LiveServer]:
    server = scoped_server(tmp_path_factory.mktemp("scope"), tiny_model_dir)
    yield server
    server.stop()


def cached(srv: LiveServer, prompt: str, headers: dict | None = None, **fields) -> int:
    with httpx.Client(base_url=srv.url, timeout=30, headers=headers or {}) as client:
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **fields})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def attack(srv: LiveServer, victim: dict, attacker: dict, headers=None) -> list[int]:
    """The attacker's cached_tokens for each guess, the victim's prompt sent again before each, and the
    attacker's own first prompt too (a guess shares a prefix with the attacker's last one otherwise: "4 7 1
    0" then "4 7 1 9", where a batch decoder's rows keep more of a scope's prompts than one KV slot)."""
    got = []
    for guess in GUESSES:
        cached(srv, "The door code is 9 9 9 9.", **attacker)  # the attacker's own first prompt
        cached(srv, SECRET, **victim)
        got.append(cached(srv, f"The door code is {guess}. Keep it safe.", headers, **attacker))
    return got


@pytest.mark.parametrize(
    "victim, attacker",
    [
        ({"cache_salt": "a-secret-of-alice"}, {}),
        ({"cache_salt": "a-secret-of-alice"}, {"cache_salt": "mallory"}),
        ({}, {"cache_salt": "mallory"}),
    ],
    ids=["victim salted", "both salted", "attacker salted"],
)
def test_door_code_when_clients_have_different_scopes_then_guesses_learn_nothing(srv, victim, attacker):
    got = attack(srv, victim, attacker)
    assert len(set(got)) == 1, got  # right or wrong, every guess gets the same


def test_door_code_when_one_scope_then_the_cache_is_reused_as_before(srv):
    """The single-user default (no key, no salt): one scope, the prefix is reused, as it always was; the
    same for two requests with one salt. (This is also the attack working: docs/server.md says when to
    use a salt.)"""
    cached(srv, SECRET)
    assert cached(srv, SECRET) > 10
    cached(srv, SECRET, cache_salt="s1")
    assert cached(srv, SECRET, cache_salt="s1") > 10
    got = attack(srv, {}, {})
    assert got[-1] > got[0], got  # the right guess shares more: what a salt is for


def test_door_code_when_a_key_is_set_then_the_salt_still_separates(tiny_model_dir, tmp_path):
    key = {"Authorization": "Bearer k-123"}
    server = scoped_server(tmp_path, tiny_model_dir, api_key="k-123")
    try:

        def post(prompt: str, **fields) -> int:
            return cached(server, prompt, key, **fields)

        post(SECRET, cache_salt="alice")
        assert post(SECRET, cache_salt="alice") > 10
        assert post(SECRET, cache_salt="mallory") == 0
    finally:
        server.stop()


def test_cache_scope_when_key_or_salt_then_hashed_and_distinct() -> None:
    assert cache_scope(api_key_set=False, authorization=None, cache_salt=None) == ""
    assert cache_scope(api_key_set=False, authorization="Bearer x", cache_salt=None) == ""  # no key set
    salted = cache_scope(api_key_set=False, authorization=None, cache_salt="door-4719")
    keyed = cache_scope(api_key_set=True, authorization="Bearer key-secret", cache_salt="door-4719")
    other_key = cache_scope(api_key_set=True, authorization="Bearer key-other", cache_salt="door-4719")
    assert "4719" not in salted + keyed and "secret" not in keyed  # secrets enter only as hashes
    assert len({salted, keyed, other_key}) == 3


def test_cache_salt_when_empty_or_huge_then_400(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        for salt in ("", "x" * 257, 5):
            response = client.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": salt}
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "cache_salt"
