"""POST /v1/lifecycle as a lease: it names its client, lapses unless renewed, shows in /v1/thermal, needs the
API key like every route, and refuses what it does not understand with a 400."""

from __future__ import annotations

import logging

import httpx
import pytest

from governor.governor import Governor
from governor.policy import PolicyConfig
from server.serving.governor_gate import GovernorGate
from server.serving.governor_setup import build_gate
from tests.server.conftest import MODEL, make_settings

MSG = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def gate(**config) -> GovernorGate:
    # No thermal sensor: only the lifecycle moves the level. Fast polls, so a lapsed lease is seen at once.
    return GovernorGate(Governor(config=PolicyConfig(**config), poll_s=0.02), pause_timeout_s=30)


def thermal(srv, **kw) -> dict:
    return httpx.get(srv.url + "/v1/thermal", timeout=5, **kw).json()


def test_lifecycle_when_background_not_renewed_then_lapses_and_held_request_runs(live, caplog) -> None:
    srv = live(governor=gate(lifecycle_ttl_s=0.5))
    with srv.client() as c, caplog.at_level(logging.INFO, logger="simmer.governor"):
        body = c.post("/v1/lifecycle", json={"state": "background", "client": "fuzzer"}).json()
        assert body["lifecycle"] == "background" and body["level"] == "critical"
        assert body["lease"]["client"] == "fuzzer" and body["lease"]["ttl_s"] == 0.5
        assert 0 < body["lease"]["expires_in"] <= 0.5
        # a request sent now waits out the pause, then runs when the lease lapses (no one reports foreground)
        r = c.post("/v1/chat/completions", json=MSG)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert thermal(srv)["lifecycle"] == "foreground" and thermal(srv)["leases"] == []
    messages = [r.getMessage() for r in caplog.records]
    assert "background -> foreground: lease from fuzzer expired" in messages


def test_lifecycle_when_two_clients_then_thermal_lists_leases_and_background_until_both_end(live) -> None:
    srv = live(governor=gate(lifecycle_ttl_s=60))
    with srv.client() as c:
        c.post("/v1/lifecycle", json={"state": "background", "client": "app"})
        c.post("/v1/lifecycle", json={"state": "background", "client": "page-1", "ttl_s": 20})
        leases = {lease["client"]: lease["expires_in"] for lease in thermal(srv)["leases"]}
        assert set(leases) == {"app", "page-1"} and 50 < leases["app"] <= 60 and 10 < leases["page-1"] <= 20
        body = c.post("/v1/lifecycle", json={"state": "foreground", "client": "page-1"}).json()
        assert body["lifecycle"] == "background" and body["lease"] is None  # app's lease still holds
        body = c.post("/v1/lifecycle", json={"state": "foreground", "client": "app"}).json()
        assert body["lifecycle"] == "foreground" and body["leases"] == []


def test_lifecycle_when_settings_ttl_then_governor_uses_it(tmp_path) -> None:
    assert build_gate(make_settings(tmp_path, thermal_source="none")).governor.config.lifecycle_ttl_s == 30.0
    g = build_gate(make_settings(tmp_path, thermal_source="none", lifecycle_ttl_s=7.5))
    assert g.governor.config.lifecycle_ttl_s == 7.5
    ((client, left),) = g.set_lifecycle("background", "x").leases
    assert client == "x" and 7 < left <= 7.5


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"state": "background", "client": "app", "colour": "red"}, "colour"),
        ({"state": "background", "ttl_s": 0}, "ttl_s"),
        ({"state": "background", "ttl_s": -3}, "ttl_s"),
        ({"state": "background", "ttl_s": "5"}, "ttl_s"),
        ({"state": "background", "ttl_s": True}, "ttl_s"),
        ({"state": "background", "ttl_s": None, "client": ""}, "client"),
        ({"state": "background", "client": "a b"}, "client"),
        ({"state": "background", "client": "x\nINFO forged log line"}, "client"),
        ({"state": "background", "client": "c" * 65}, "client"),
        ({"state": "background", "client": 7}, "client"),
        ({"state": 1}, "state"),
        ({"client": "app"}, "state"),
    ],
)
def test_lifecycle_when_bad_field_then_400_naming_it_and_nothing_changes(live, body, param) -> None:
    srv = live(governor=gate(lifecycle_ttl_s=60))
    r = srv.client().post("/v1/lifecycle", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_parameter" and error["param"] == param, error
    assert thermal(srv)["lifecycle"] == "foreground"


def test_lifecycle_when_ttl_above_limit_then_capped_and_the_answer_says_so(live) -> None:
    """A schema-valid ttl_s is accepted (schemathesis: valid data must not get a 400); the server grants at
    most SIMMER_LIFECYCLE_TTL_S."""
    srv = live(governor=gate(lifecycle_ttl_s=60))
    r = srv.client().post("/v1/lifecycle", json={"state": "background", "client": "app", "ttl_s": 3600})
    assert r.status_code == 200, r.text
    assert r.json()["lease"]["ttl_s"] == 60
    assert 0 < thermal(srv)["leases"][0]["expires_in"] <= 60


def test_lifecycle_when_too_many_clients_then_429_and_holders_unaffected(live) -> None:
    srv = live(governor=gate(lifecycle_ttl_s=60, max_leases=2))
    with srv.client() as c:
        for name in ("a", "b"):
            assert c.post("/v1/lifecycle", json={"state": "background", "client": name}).status_code == 200
        r = c.post("/v1/lifecycle", json={"state": "background", "client": "c"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_leases"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert (
            c.post("/v1/lifecycle", json={"state": "background", "client": "a"}).status_code == 200
        )  # renew
    assert sorted(lease["client"] for lease in thermal(srv)["leases"]) == ["a", "b"]


def test_lifecycle_when_api_key_set_then_needs_the_key(live) -> None:
    srv = live(governor=gate(), api_key="sekrit")
    background = {"state": "background", "client": "app"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        r = httpx.post(srv.url + "/v1/lifecycle", json=background, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(srv.url + "/v1/thermal").status_code == 401
    key = {"Authorization": "Bearer sekrit"}
    assert thermal(srv, headers=key)["lifecycle"] == "foreground"  # the refused reports changed nothing
    assert (
        httpx.post(srv.url + "/v1/lifecycle", json=background, headers=key).json()["lifecycle"]
        == "background"
    )
