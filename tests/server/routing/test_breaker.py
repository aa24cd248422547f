"""The breaker on a fake clock: opens after N consecutive failures, half-opens after the cooldown, one probe
decides; Retry-After and "offline" open it at once."""

from __future__ import annotations

import pytest

from server.routing.breaker import MAX_RETRY_AFTER_S, Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_breaker_when_n_consecutive_failures_then_open_for_cooldown(clock) -> None:
    b = Breaker(3, 30.0, clock=clock)
    for _ in range(2):
        b.failure("connect")
        assert b.state == "closed" and b.available()
    b.failure("connect")
    assert b.state == "open" and not b.available()
    assert b.view().retry_in_s == 30.0 and b.view().opened == 1
    clock.now += 29.9
    assert not b.available()
    clock.now += 0.1
    assert b.state == "half_open" and b.available()


def test_breaker_when_success_between_failures_then_count_restarts(clock) -> None:
    b = Breaker(3, 30.0, clock=clock)
    b.failure("timeout")
    b.failure("timeout")
    b.success()
    b.failure("timeout")
    b.failure("timeout")
    assert b.state == "closed"


def test_breaker_when_half_open_then_one_probe_and_its_success_closes(clock) -> None:
    b = Breaker(1, 10.0, clock=clock)
    b.failure("server_error")
    clock.now += 10
    probe = b.begin()
    assert probe and b.state == "open" and not b.available()  # others wait for the probe
    b.success(probe)
    assert b.state == "closed" and b.available() and b.view().consecutive_failures == 0


def test_breaker_when_probe_fails_then_open_again_for_a_full_cooldown(clock) -> None:
    b = Breaker(2, 10.0, clock=clock)
    b.failure("connect")
    b.failure("connect")
    clock.now += 10
    probe = b.begin()
    b.failure("connect", probe=probe)
    assert b.state == "open" and b.view().retry_in_s == 10.0 and b.view().opened == 2


def test_breaker_when_probe_abandoned_then_next_request_probes(clock) -> None:
    b = Breaker(1, 10.0, clock=clock)
    b.failure("connect")
    clock.now += 10
    probe = b.begin()
    b.abandon(probe)
    assert b.state == "half_open" and b.begin()


def test_breaker_when_closed_then_begin_is_no_probe(clock) -> None:
    b = Breaker(1, 10.0, clock=clock)
    assert b.begin() is False
    b.abandon(False)
    assert b.state == "closed"


def test_breaker_when_offline_then_open_at_once(clock) -> None:
    b = Breaker(5, 30.0, clock=clock)
    b.failure("offline")
    assert b.state == "open" and b.view().last_failure == "offline"


@pytest.mark.parametrize(
    ("retry_after", "expected_open_s"),
    [(120.0, 120.0), (5.0, 30.0), (10_000.0, MAX_RETRY_AFTER_S)],
)
def test_breaker_when_retry_after_then_open_until_it_passes(clock, retry_after, expected_open_s) -> None:
    """Retry-After opens the breaker on the first failure, for the longer of it and the cooldown once
    counted failures open it; a huge one is capped."""
    b = Breaker(1, 30.0, clock=clock)
    b.failure("rate_limited", retry_after)
    assert b.view().retry_in_s == expected_open_s


def test_breaker_when_retry_after_below_threshold_then_open_for_it(clock) -> None:
    b = Breaker(5, 30.0, clock=clock)
    b.failure("rate_limited", 7.0)
    assert b.state == "open" and b.view().retry_in_s == 7.0
    clock.now += 7
    assert b.available()


def test_breaker_when_already_open_then_late_failure_only_lengthens(clock) -> None:
    b = Breaker(1, 30.0, clock=clock)
    b.failure("connect")
    clock.now += 20
    b.failure("connect")  # an earlier request failing late
    assert b.view().retry_in_s == 30.0 and b.view().opened == 1


def test_breaker_when_bad_settings_then_refused() -> None:
    with pytest.raises(ValueError):
        Breaker(0, 1.0)
    with pytest.raises(ValueError):
        Breaker(1, 0.0)
