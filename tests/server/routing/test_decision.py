"""decide_route(), table by table: one table per part of the rule table in server/routing/decision.py."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from server.routing.decision import (
    HOME_FACTOR,
    DeviceState,
    RouteInputs,
    decide_route,
    local_wait_s,
    pace_slow,
    strictest,
)

# An auto server, an available upstream, a local model that is ready, a cool device: served locally.
AUTO = RouteInputs(
    policy="auto",
    requested=None,
    upstream_available=True,
    model_local=True,
    model_upstream=True,
    device=DeviceState("nominal"),
)
HOT = DeviceState("critical", paused=True, cause="thermal")
BACKGROUND = DeviceState("critical", paused=True, lifecycle="background", cause="lifecycle")


def row(decision) -> tuple:
    return (decision.side, decision.reason, decision.fallback, decision.refusal)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # policy local: nothing leaves, whatever the request says
        ({"policy": "local"}, ("local", "policy", False, None)),
        ({"policy": "local", "requested": "auto", "device": HOT}, ("local", "policy", False, None)),
        ({"policy": "local", "requested": "upstream"}, (None, "policy", False, "upstream_not_allowed")),
        ({"policy": "local", "model_local": False}, (None, "policy", False, "model_not_found")),
        # a request can always forbid upstream
        ({"requested": "local", "device": HOT}, ("local", "request", False, None)),
        ({"policy": "upstream", "requested": "local"}, ("local", "request", False, None)),
        ({"requested": "local", "model_local": False}, (None, "request", False, "model_not_found")),
        # a request may force upstream when the policy is not local; no local fallback then
        ({"requested": "upstream"}, ("upstream", "request", False, None)),
        (
            {"requested": "upstream", "upstream_available": False},
            (None, "request", False, "upstream_unavailable"),
        ),
        ({"requested": "upstream", "model_upstream": False}, (None, "request", False, "model_not_found")),
        # policy upstream: everything goes, local stays the fallback
        ({"policy": "upstream"}, ("upstream", "policy", True, None)),
        ({"policy": "upstream", "upstream_available": False}, ("local", "breaker_open", False, None)),
        ({"policy": "upstream", "model_upstream": False}, ("local", "policy", False, None)),
        ({"policy": "upstream", "requested": "auto"}, ("local", "offline_first", False, None)),
    ],
)
def test_policy_and_request_modes(changes, expected) -> None:
    assert row(decide_route(replace(AUTO, **changes))) == expected


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, ("local", "offline_first", False, None)),
        ({"device": None}, ("local", "offline_first", False, None)),  # no governor
        ({"device": HOT}, ("upstream", "thermal", True, None)),
        ({"device": DeviceState("critical", cause="thermal")}, ("upstream", "thermal", True, None)),
        (
            {"device": DeviceState("serious", paused=True, cause="thermal")},
            ("upstream", "thermal", True, None),
        ),
        ({"device": DeviceState("nominal", killed=True)}, ("upstream", "thermal", True, None)),
        ({"device": BACKGROUND}, ("upstream", "background", True, None)),
        (
            {"device": DeviceState("critical", paused=True, cause="memory")},
            ("upstream", "memory", True, None),
        ),
        # serious (paced) or fair still serve locally: the device copes
        ({"device": DeviceState("serious", cause="thermal")}, ("local", "offline_first", False, None)),
        ({"device": DeviceState("fair", cause="battery")}, ("local", "offline_first", False, None)),
        # background with low_priority: serious, not paused
        (
            {"device": DeviceState("serious", lifecycle="background", cause="lifecycle")},
            ("local", "offline_first", False, None),
        ),
        ({"prompt_over_context": True}, ("upstream", "context", True, None)),
        ({"prompt_over_context": True, "truncate": True}, ("local", "offline_first", False, None)),
        ({"model_local": False}, ("upstream", "model", False, None)),
        ({"model_local": False, "model_upstream": False}, (None, "model", False, "model_not_found")),
        ({"model_upstream": False, "device": HOT}, ("local", "offline_first", False, None)),
        ({"local": "no_memory"}, ("upstream", "memory", False, None)),
        ({"local": "failed"}, ("upstream", "local_failed", False, None)),
        ({"local": "loading"}, ("upstream", "loading", True, None)),
        ({"queue_full": True}, ("upstream", "queue", True, None)),
        ({"requested": "auto", "queue_full": True}, ("upstream", "queue", True, None)),
    ],
)
def test_auto_rules(changes, expected) -> None:
    assert row(decide_route(replace(AUTO, **changes))) == expected


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # the first matching row names the reason
        ({"local": "no_memory", "device": HOT}, ("upstream", "memory", False, None)),
        (
            {"device": HOT, "prompt_over_context": True, "queue_full": True},
            ("upstream", "thermal", True, None),
        ),
        ({"prompt_over_context": True, "queue_full": True}, ("upstream", "context", True, None)),
        ({"local": "loading", "queue_full": True}, ("upstream", "loading", True, None)),
    ],
)
def test_auto_rules_when_several_hold_then_first_row_wins(changes, expected) -> None:
    assert row(decide_route(replace(AUTO, **changes))) == expected


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # the upstream is wanted but the breaker is open: offline first, or a clear refusal
        ({"device": HOT}, ("local", "breaker_open", False, None)),
        ({"queue_full": True}, ("local", "breaker_open", False, None)),
        ({"local": "no_memory"}, ("local", "breaker_open", False, None)),
        ({"model_local": False}, (None, "model", False, "upstream_unavailable")),
        ({}, ("local", "offline_first", False, None)),
    ],
)
def test_auto_rules_when_upstream_unavailable(changes, expected) -> None:
    assert row(decide_route(replace(AUTO, upstream_available=False, **changes))) == expected


@pytest.mark.parametrize(
    ("modes", "expected"),
    [
        ((None, None), None),
        (("upstream", None), "upstream"),
        ((None, "auto"), "auto"),
        (("upstream", "local"), "local"),
        (("local", "upstream"), "local"),
        (("auto", "upstream"), "auto"),
    ],
)
def test_strictest_when_field_and_header_disagree_then_forbidding_wins(modes, expected) -> None:
    assert strictest(*modes) == expected


# -- under the pace controller: heat slows the device instead of pausing it ------------------------------
def paced(tok_s: float | None, level: str = "serious") -> DeviceState:
    return DeviceState(level, cause="thermal", pace_tok_s=tok_s)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # the pace is under the floor (pace_slow decided it): new work goes upstream, local as fallback
        ({"device": paced(2.0), "pace_slow": True}, ("upstream", "thermal", True, None)),
        ({"device": paced(2.0, "fair"), "pace_slow": True}, ("upstream", "thermal", True, None)),
        # paced but fast enough, nothing ahead: stays here
        ({"device": paced(20.0)}, ("local", "offline_first", False, None)),
        # the work ahead would hold the first token longer than the bound: 200 tokens at 20 tok/s = 10 s
        (
            {"device": paced(20.0), "local_tokens_ahead": 200, "max_local_wait_s": 5.0},
            ("upstream", "thermal", True, None),
        ),
        (
            {"device": paced(20.0), "local_tokens_ahead": 200, "max_local_wait_s": 10.0},
            ("local", "offline_first", False, None),
        ),
        (
            {"device": paced(20.0), "local_tokens_ahead": 50, "max_local_wait_s": 5.0},
            ("local", "offline_first", False, None),
        ),
        # bound 0: off
        ({"device": paced(20.0), "local_tokens_ahead": 10**6}, ("local", "offline_first", False, None)),
        # no thermal pace (cool enough that heat does not bind, no cost known, or no governor): the queue is
        # SIMMER_MAX_QUEUE's business, not the wait rule's
        (
            {"device": paced(None), "local_tokens_ahead": 10**6, "max_local_wait_s": 5.0},
            ("local", "offline_first", False, None),
        ),
        (
            {"device": DeviceState("nominal"), "local_tokens_ahead": 10**6, "max_local_wait_s": 5.0},
            ("local", "offline_first", False, None),
        ),
        (
            {"device": None, "local_tokens_ahead": 10**6, "max_local_wait_s": 5.0},
            ("local", "offline_first", False, None),
        ),
        # a stale slow flag without a pace is ignored (the device is no longer paced by heat)
        ({"device": paced(None), "pace_slow": True}, ("local", "offline_first", False, None)),
        # a request can still forbid it; the policy local still keeps everything
        ({"device": paced(1.0), "pace_slow": True, "requested": "local"}, ("local", "request", False, None)),
        ({"device": paced(1.0), "pace_slow": True, "policy": "local"}, ("local", "policy", False, None)),
        # nothing to offload to: the model is not served upstream, or the breaker is open
        (
            {"device": paced(1.0), "pace_slow": True, "model_upstream": False},
            ("local", "offline_first", False, None),
        ),
        (
            {"device": paced(1.0), "pace_slow": True, "upstream_available": False},
            ("local", "breaker_open", False, None),
        ),
        # a paused or critical device is still the pause row's (the pace is moot)
        ({"device": replace(paced(9.0, "critical"), paused=True)}, ("upstream", "thermal", True, None)),
        # the rows after it: a slow pace names thermal before context, loading and queue
        (
            {"device": paced(1.0), "pace_slow": True, "prompt_over_context": True, "queue_full": True},
            ("upstream", "thermal", True, None),
        ),
    ],
)
def test_auto_rules_when_heat_paces_the_device(changes, expected) -> None:
    assert row(decide_route(replace(AUTO, **changes))) == expected


@pytest.mark.parametrize(
    ("was_slow", "device", "floor", "expected"),
    [
        (False, paced(4.9), 5.0, True),  # under the floor: slow
        (False, paced(5.0), 5.0, False),
        (False, paced(7.0), 5.0, False),
        (True, paced(7.0), 5.0, True),  # slow stays slow inside the band
        (True, paced(HOME_FACTOR * 5.0 - 0.01), 5.0, True),
        (True, paced(HOME_FACTOR * 5.0), 5.0, False),  # home at HOME_FACTOR x the floor
        (True, paced(None), 5.0, False),  # heat no longer binds (or no cost known): home at once
        (True, DeviceState("nominal"), 5.0, False),
        (True, None, 5.0, False),  # no governor
        (False, paced(0.1), 0.0, False),  # floor 0: the rule is off
        (True, paced(0.1), 0.0, False),
    ],
)
def test_pace_slow_table(was_slow, device, floor, expected) -> None:
    assert pace_slow(was_slow, device, floor) is expected


def test_pace_slow_when_pace_wobbles_around_the_floor_then_one_change_each_way() -> None:
    """The pace follows a high-gain controller: it wobbles around the floor as the device heats and cools.
    The band keeps the route from changing side on every wobble: out once, home once."""
    trace = [8.0, 6.0, 5.1, 4.9, 5.2, 4.8, 6.0, 7.2, 5.5, 7.4, 7.6, 6.9, 8.0, 5.2]
    slow, states = False, []
    for tok_s in trace:
        slow = pace_slow(slow, paced(tok_s), 5.0)
        states.append(slow)
    changes = sum(a != b for a, b in itertools.pairwise(states))
    assert states[3] and not states[2]  # out when it first drops under 5
    assert states[9] and not states[10]  # home when it first reaches 7.5
    assert changes == 2


@pytest.mark.parametrize(
    ("ahead", "tok_s", "expected"),
    [(0, 5.0, 0.0), (100, 5.0, 20.0), (160, 16.0, 10.0), (10, 0.0, float("inf"))],
)
def test_local_wait_s(ahead, tok_s, expected) -> None:
    assert local_wait_s(ahead, tok_s) == expected


# -- embeddings: the same policy, for work that makes no tokens ------------------------------------------
EMBED = replace(AUTO, work="embed")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, ("local", "offline_first", False, None)),
        # the model rows: an encoder installed only upstream goes there (nothing to fall back to)
        ({"model_local": False}, ("upstream", "model", False, None)),
        ({"model_local": False, "upstream_available": False}, (None, "model", False, "upstream_unavailable")),
        ({"model_local": False, "model_upstream": False}, (None, "model", False, "model_not_found")),
        ({"model_upstream": False, "device": HOT}, ("local", "offline_first", False, None)),
        # the device rows, as for generation, with the installed encoder as the fallback
        ({"device": HOT}, ("upstream", "thermal", True, None)),
        ({"device": DeviceState("nominal", killed=True)}, ("upstream", "thermal", True, None)),
        ({"device": BACKGROUND}, ("upstream", "background", True, None)),
        ({"device": HOT, "upstream_available": False}, ("local", "breaker_open", False, None)),
        ({"queue_full": True}, ("upstream", "queue", True, None)),
        # the generation model's state is not the encoder's: it neither sends vectors away nor stops the
        # fallback
        ({"local": "no_memory"}, ("local", "offline_first", False, None)),
        ({"local": "failed"}, ("local", "offline_first", False, None)),
        ({"local": "loading"}, ("local", "offline_first", False, None)),
        ({"local": "no_memory", "device": HOT}, ("upstream", "thermal", True, None)),
        # a batch makes no tokens: the pace rows do not fire
        ({"device": paced(1.0), "pace_slow": True}, ("local", "offline_first", False, None)),
        (
            {"device": paced(20.0), "local_tokens_ahead": 10**6, "max_local_wait_s": 5.0},
            ("local", "offline_first", False, None),
        ),
        ({"prompt_over_context": True}, ("local", "offline_first", False, None)),
        # the policy and request rows are the same table
        ({"policy": "local", "requested": "upstream"}, (None, "policy", False, "upstream_not_allowed")),
        ({"policy": "local", "model_local": False}, (None, "policy", False, "model_not_found")),
        ({"requested": "local", "device": HOT}, ("local", "request", False, None)),
        ({"requested": "upstream"}, ("upstream", "request", False, None)),
        ({"policy": "upstream"}, ("upstream", "policy", True, None)),
        ({"policy": "upstream", "local": "no_memory"}, ("upstream", "policy", True, None)),
        ({"policy": "upstream", "model_local": False}, ("upstream", "policy", False, None)),
    ],
)
def test_embed_rules(changes, expected) -> None:
    assert row(decide_route(replace(EMBED, **changes))) == expected
