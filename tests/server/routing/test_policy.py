"""decide_route(), table by table: one table per part of the rule table in server/routing/policy.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from server.routing.policy import DeviceState, RouteInputs, decide_route, strictest

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
