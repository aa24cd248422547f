"""Whose prompt a request is, for prefix reuse (GenerationParams.cache_scope).

Reusing another client's cached prefix is an oracle: `cached_tokens` (and the prefill time) tell a client
how much of someone else's prompt it guessed, so a door code in one client's prompt came out digit by digit
in another's guesses. A prefix is reused only within one scope:

- with SIMMER_API_KEY set, the key the request presented (every holder of the key is one client: they can
  read each other's work anyway);
- and the request's `cache_salt` (vLLM's name for it): a secret the client picks, such as a random value
  kept per user. Requests with different salts, or one with a salt and one without, never share a prefix.
- Neither: the one default scope. On a single-user device (the default setup: loopback, no key) that is
  what you want: every tool of the one user reuses every prefix. Clients that must not observe each other
  each send their own secret `cache_salt` (docs/server.md).

A lifecycle client name (POST /v1/lifecycle) is no scope: it is chosen by the client and listed by
/v1/thermal, so anyone could claim another's. Secrets enter the scope only as hashes.
"""

from __future__ import annotations

import hashlib

SUMMARY_SCOPE = (
    "simmer:summary"  # the server's own summaries (server/serving/summary.py) never share with a client
)


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def cache_scope(*, api_key_set: bool, authorization: str | None, cache_salt: str | None) -> str:
    """The request's scope: "" (shared) without a key or a salt."""
    parts = []
    if api_key_set and authorization:
        parts.append("key:" + _digest(authorization.partition(" ")[2].strip()))
    if cache_salt:
        parts.append("salt:" + _digest(cache_salt))
    return "|".join(parts)
