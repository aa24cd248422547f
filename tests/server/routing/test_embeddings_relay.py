"""server/routing/embeddings.py on its own: the body that leaves, the answer's checks (table by table), the
byte bound, the error each failure becomes; and the router's embeddings step against a scripted upstream:
the breaker, the fallback, the refusal."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import numpy as np
import pytest

from models.errors import ContextLengthExceeded, InvalidParameter
from server.refusals import ServerBusy, UpstreamError, UpstreamUnavailable
from server.routing.breaker import Breaker
from server.routing.embeddings import (
    MAX_DIMENSIONS,
    answer_cap,
    embeddings_body,
    embeddings_error,
    parse_answer,
)
from server.routing.router import Router
from server.routing.upstream import UpstreamClient, UpstreamFailure
from tests import aio
from tests.server.routing.helpers import local_side


def answer(*rows, usage=None, **item_fields) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": r, **item_fields} for i, r in enumerate(rows)]
    return json.dumps({"object": "list", "data": data, "usage": usage or {"prompt_tokens": 4}}).encode()


def test_embeddings_body_when_built_then_model_inputs_and_only_asked_dimensions() -> None:
    assert embeddings_body("up", ["a", "b"], None) == {"model": "up", "input": ["a", "b"]}
    assert embeddings_body("up", [[1, 2]], 384) == {"model": "up", "input": [[1, 2]], "dimensions": 384}


def test_parse_answer_when_good_then_float32_vectors_in_input_order_and_usage() -> None:
    raw = json.dumps(
        {"data": [{"index": 1, "embedding": [3, 4.5]}, {"index": 0, "embedding": [1.0, -2]}], "usage": {}}
    ).encode()
    got = parse_answer(raw, 2, 2)
    assert got.vectors.dtype == np.float32 and got.vectors.tolist() == [[1.0, -2.0], [3.0, 4.5]]
    assert got.prompt_tokens == 0  # not reported: unknown
    assert parse_answer(answer([0.5] * 7), 1, None).prompt_tokens == 4  # width unknown: any one width


@pytest.mark.parametrize(
    ("raw", "rows", "width", "words"),
    [
        (b"<html>", 1, None, "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, 1, None, "not JSON"),  # nested beyond the parser
        (b'{"error": "x"}', 1, None, "no `data` list"),
        (b"[1, 2]", 1, None, "no `data` list"),
        (answer([1.0], [2.0]), 1, None, "2 vectors for 1 inputs"),
        (answer([1.0]), 2, None, "1 vectors for 2 inputs"),
        (answer([1.0, 2.0], [1.0]), 2, None, "has 1 dimensions, not 2"),
        (answer([1.0, 2.0]), 1, 3, "has 2 dimensions, not 3"),
        (answer([0.0] * (MAX_DIMENSIONS + 1)), 1, None, f"at most {MAX_DIMENSIONS}"),
        (answer([]), 1, None, "not a list of numbers"),
        (answer("AAAA"), 1, None, "not a list of numbers"),  # base64 was not asked for
        (answer([1.0, "2"]), 1, None, "other than numbers"),
        (answer([1.0, True]), 1, None, "other than numbers"),
        (answer([1.0, None]), 1, None, "other than numbers"),
        (b'{"data": [{"index": 0, "embedding": [NaN, 1]}]}', 1, None, "NaN"),
        (b'{"data": [{"index": 0, "embedding": [Infinity, 1]}]}', 1, None, "NaN"),
        (b'{"data": [{"index": 0, "embedding": [1e400, 1]}]}', 1, None, "NaN"),
        (b'{"data": [{"index": 0, "embedding": [1e39, 1]}]}', 1, None, "beyond float32"),
        (b'{"data": [{"index": 0, "embedding": [' + b"9" * 400 + b", 1]}]}", 1, None, "out of range"),
        (
            b'{"data": [{"index": 0, "embedding": [1]}, {"index": 0, "embedding": [2]}]}',
            2,
            None,
            "two vectors",
        ),
        (b'{"data": [{"index": 5, "embedding": [1]}]}', 1, None, "no index from 0 to 0"),
        (b'{"data": [{"index": true, "embedding": [1]}]}', 1, None, "no index"),
        (b'{"data": ["x"]}', 1, None, "no index"),
    ],
)
def test_parse_answer_when_unusable_then_bad_response_naming_it(raw, rows, width, words) -> None:
    with pytest.raises(UpstreamFailure) as caught:
        parse_answer(raw, rows, width)
    assert caught.value.kind == "bad_response" and words in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    "usage", [{"prompt_tokens": -1}, {"prompt_tokens": 2**40}, {"prompt_tokens": True}, "x"]
)
def test_parse_answer_when_usage_is_no_count_then_zero(usage) -> None:
    assert parse_answer(answer([1.0], usage=usage), 1, 1).prompt_tokens == 0


def test_answer_cap_when_rows_and_width_then_room_for_the_longest_floats_and_no_more() -> None:
    widest = json.dumps([-1.2345678901234567e-308] * 384)
    row = json.dumps({"object": "embedding", "index": 255, "embedding": json.loads(widest)})
    assert 256 * len(row) < answer_cap(256, 384) < 256 * len(row) * 1.2
    assert answer_cap(1, 10**6) == answer_cap(1, None) == answer_cap(1, MAX_DIMENSIONS)
    assert answer_cap(256, None) < 64 << 20  # the worst a request may be made to read


@pytest.mark.parametrize(
    ("failure", "kind", "code"),
    [
        (UpstreamFailure("bad_response", "NaN"), UpstreamError, "upstream_error"),
        (UpstreamFailure("timeout", "no answer in 3 s"), UpstreamUnavailable, "upstream_unavailable"),
        (UpstreamFailure("server_error", "x", status=500), UpstreamUnavailable, "upstream_unavailable"),
        (UpstreamFailure("client_error", "x", status=404), None, "model_not_found"),
        (
            UpstreamFailure("client_error", "x", status=400, code="context_length_exceeded"),
            None,
            "context_length_exceeded",
        ),
    ],
)
def test_embeddings_error_when_failure_then_simmer_code(failure, kind, code) -> None:
    error = embeddings_error(failure, None)
    assert error.code == code and (kind is None or isinstance(error, kind))


# -- the router's step, against an upstream that does not answer (a closed port) ------------------------
def router(policy: str, served: set[str], breaker: Breaker) -> Router:
    return Router(
        policy=policy,  # type: ignore[arg-type]
        local=replace(local_side([]), served_ids=lambda: served),
        device=lambda: None,
        upstream=UpstreamClient("http://127.0.0.1:9/v1", connect_timeout_s=1),
        upstream_models={"remote": "remote"},
        breaker=breaker,
    )


def test_router_embeddings_when_upstream_down_and_model_local_then_falls_back_and_counts_both() -> None:
    async def scenario():
        r = router("upstream", {"m", "enc"}, Breaker(5, 10.0))
        route = r.plan_embeddings("enc", None, None)
        assert (route.side, route.reason, route.fallback) == ("upstream", "policy", True)
        got = await r.embeddings("t", route, ["a"], dimensions=None, width=4)
        await r.aclose()
        return got, route, r

    got, route, r = aio.run(scenario())
    assert got is None and (route.side, route.reason) == ("local", "upstream_failed")
    assert r.requests == {("upstream", "policy"): 1, ("local", "upstream_failed"): 1}
    assert r.breaker.view().consecutive_failures == 1 and sum(r.failures.values()) == 1


def test_router_embeddings_when_upstream_down_and_model_only_upstream_then_upstream_unavailable() -> None:
    async def scenario():
        r = router("auto", {"m"}, Breaker(1, 10.0))
        route = r.plan_embeddings("remote", None, None)
        assert (route.side, route.reason, route.fallback) == ("upstream", "model", False)
        with pytest.raises(UpstreamUnavailable) as caught:
            await r.embeddings("t", route, ["a"], dimensions=None, width=None)
        # the breaker is open now: the next one is refused before any connection
        with pytest.raises(UpstreamUnavailable):
            r.plan_embeddings("remote", None, None)
        await r.aclose()
        return caught.value

    error = aio.run(scenario())
    assert "upstream connect" in error.message and error.retry_after_s


def test_router_embeddings_when_cancelled_then_the_probe_is_freed() -> None:
    clock = [0.0]
    breaker = Breaker(1, 10.0, clock=lambda: clock[0])
    breaker.failure("connect")
    clock[0] = 10.0  # half-open: the next request is the probe

    async def scenario():
        r = router("auto", {"m"}, breaker)
        route = r.plan_embeddings("remote", None, None)
        task = asyncio.ensure_future(r.embeddings("t", route, ["a"], dimensions=None, width=None))
        await asyncio.sleep(0)
        assert breaker.state == "open"  # the probe is out
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await r.aclose()

    aio.run(scenario())
    assert breaker.state == "half_open"


@pytest.mark.parametrize(
    ("policy", "error", "moves"),
    [
        ("auto", ServerBusy("busy"), ("upstream", "queue")),
        ("auto", ContextLengthExceeded("long"), None),  # the same model refuses it upstream too
        ("auto", InvalidParameter("bad"), None),  # not a refusal the policy learns from
        ("local", ServerBusy("busy"), None),  # nothing leaves
    ],
)
def test_reroute_embeddings_when_local_refuses_then_decided_again(policy, error, moves) -> None:
    async def scenario():
        r = router(policy, {"m", "enc"}, Breaker(5, 10.0))
        route = r.plan_embeddings("enc", None, None)
        assert route.side == "local"
        moved = r.reroute_embeddings(route, error)
        await r.aclose()
        return moved, (route.side, route.reason)

    moved, where = aio.run(scenario())
    assert moved is (moves is not None) and (moves is None or where == moves)
