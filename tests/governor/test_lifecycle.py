"""Lifecycle leases: the pure rules table by table, then the governor driving them on a fake clock."""

from __future__ import annotations

import logging

import pytest

from governor.governor import Governor
from governor.lifecycle import Lease, TooManyLeases, expire, lifecycle_of, report
from governor.policy import PolicyConfig
from governor.sensors import SimulatedThermalSource
from tests.governor.fakes import FakeClock, make_sim
from tests.governor.helpers import make_governor

A = Lease("app", 130.0, 30.0)
B = Lease("page", 115.0, 30.0)


@pytest.mark.parametrize(
    ("leases", "client", "state", "expected"),
    [
        ((), "app", "background", (Lease("app", 130.0, 30.0),)),  # new lease: now + ttl
        ((A,), "app", "background", (Lease("app", 130.0, 30.0),)),  # renewal: same report
        ((Lease("app", 101.0, 30.0),), "app", "background", (Lease("app", 130.0, 30.0),)),  # extended
        ((B,), "app", "background", (B, Lease("app", 130.0, 30.0))),  # a second client
        ((A,), "app", "foreground", ()),  # foreground ends the client's own lease
        ((A, B), "app", "foreground", (B,)),  # ... and no other
        ((B,), "app", "foreground", (B,)),  # foreground without a lease: nothing changes
        ((), "app", "foreground", ()),
    ],
)
def test_report_when_rule_table_row_then_leases(leases, client, state, expected):
    assert report(leases, client, state, now=100.0, ttl_s=30.0, max_leases=8) == expected


def test_report_when_max_leases_held_then_new_client_refused_but_holders_renew_and_leave():
    full = (A, B)
    with pytest.raises(TooManyLeases):
        report(full, "fuzzer", "background", now=100.0, ttl_s=30.0, max_leases=2)
    assert report(full, "page", "background", now=100.0, ttl_s=30.0, max_leases=2)[-1].expires_at == 130.0
    assert report(full, "page", "foreground", now=100.0, ttl_s=30.0, max_leases=2) == (A,)


@pytest.mark.parametrize(
    ("now", "held", "gone"),
    [
        (100.0, (A, B), ()),
        (114.9, (A, B), ()),
        (115.0, (A,), (B,)),  # over at its expiry instant
        (129.0, (A,), (B,)),
        (130.0, (), (A, B)),
    ],
)
def test_expire_when_clock_passes_expiry_then_lease_gone(now, held, gone):
    assert expire((A, B), now) == (held, gone)


@pytest.mark.parametrize(
    ("leases", "lifecycle"), [((), "foreground"), ((A,), "background"), ((A, B), "background")]
)
def test_lifecycle_of_when_any_lease_then_background(leases, lifecycle):
    assert lifecycle_of(leases) == lifecycle


# -- the governor: the same rules on its clock -------------------------------------------------------------
def governor(ttl: float = 30.0):
    return make_governor(config=PolicyConfig(lifecycle_ttl_s=ttl))


def test_governor_when_lease_not_renewed_then_expires_on_its_clock_with_a_log_line(caplog):
    gov, _, clock = governor()
    snap = gov.set_lifecycle("background", "fuzzer")
    assert (snap.lifecycle, snap.level, snap.leases) == ("background", "critical", (("fuzzer", 30.0),))
    clock.advance(29.9)
    assert gov.tick().lifecycle == "background"
    assert gov.active_leases() == [{"client": "fuzzer", "expires_in": 0.1}]
    clock.advance(0.1)
    with caplog.at_level(logging.INFO, logger="simmer.governor"):
        snap = gov.tick()
    assert (snap.lifecycle, snap.level, snap.leases) == ("foreground", "nominal", ())
    assert not snap.limits.pause_new and gov.wait_while_paused(timeout=0.0)
    assert "background -> foreground: lease from fuzzer expired" in [r.getMessage() for r in caplog.records]


def test_governor_when_lease_renewed_before_expiry_then_stays_background():
    gov, _, clock = governor()
    gov.set_lifecycle("background", "page")
    for _ in range(10):  # a page renewing every 10 s for 100 s
        clock.advance(10)
        assert gov.tick().lifecycle == "background"
        gov.set_lifecycle("background", "page")
    assert gov.active_leases() == [{"client": "page", "expires_in": 30.0}]


def test_governor_when_two_clients_then_background_while_any_lease_holds(caplog):
    gov, _, clock = governor()
    gov.set_lifecycle("background", "app")
    clock.advance(20)
    gov.set_lifecycle("background", "page")
    assert gov.set_lifecycle("foreground", "stranger").lifecycle == "background"  # holds no lease
    with caplog.at_level(logging.INFO, logger="simmer.governor"):
        caplog.clear()  # only what follows (another test may have set the root logger to INFO)
        clock.advance(10)  # app's lease runs out, page's holds
        assert gov.tick().lifecycle == "background"
        snap = gov.set_lifecycle("foreground", "page")
    assert snap.lifecycle == "foreground" and snap.level == "nominal"
    assert [
        r.getMessage()
        for r in caplog.records
        # the lifecycle's own lines (the ladder's "rung a -> b" moves are another test's)
        if ("lease" in r.getMessage() or "->" in r.getMessage()) and not r.getMessage().startswith("rung ")
    ] == [
        "lease from app expired; still background (leases from page)",
        "background -> foreground: page reported foreground",
        "critical -> nominal: thermal: 30.0 C, headroom 0.57 (forecast 0.57)",
    ]


def test_governor_when_shorter_ttl_asked_then_used_and_longer_or_bad_refused():
    gov, _, clock = governor(ttl=30.0)
    assert gov.set_lifecycle("background", "app", ttl_s=5.0).leases == (("app", 5.0),)
    clock.advance(5)
    assert gov.tick().lifecycle == "foreground"
    for bad in (0.0, -1.0, 30.5):
        with pytest.raises(ValueError):
            gov.set_lifecycle("background", "app", ttl_s=bad)
    assert gov.snapshot().leases == ()


def test_governor_when_lease_changes_then_subscribers_told_but_not_on_renewal():
    gov, _, clock = governor()
    seen = []
    gov.subscribe(lambda snap: seen.append(tuple(c for c, _ in snap.leases)))
    gov.set_lifecycle("background", "app")
    gov.set_lifecycle("background", "page")
    clock.advance(5)
    gov.set_lifecycle("background", "page")  # a renewal: nothing new to tell
    gov.set_lifecycle("foreground", "app")
    assert seen == [("app",), ("app", "page"), ("page",)]


def test_governor_when_simulated_device_then_leases_still_run_on_the_wall_clock():
    sim, _, sim_clock = make_sim(time_scale=100.0)
    clock = FakeClock()
    gov = Governor(thermal=SimulatedThermalSource(sim), clock=clock, usable_cpus=2)
    gov.set_lifecycle("background", "app")
    sim_clock.advance(36)  # an hour of device time ...
    assert gov.tick().lifecycle == "background"  # ... is not 30 s of the client's
    clock.advance(30)
    assert gov.tick().lifecycle == "foreground"


def test_policy_config_when_ttl_not_positive_then_refused():
    for bad in (0.0, -5.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            PolicyConfig(lifecycle_ttl_s=bad)
