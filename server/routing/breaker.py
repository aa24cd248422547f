"""The upstream's circuit breaker: after N consecutive failures, stop sending for a cooldown.

Three ideas kept apart, as LiteLLM's router keeps them (retries, fallbacks, cooldowns):
- this breaker is the cooldown: it only says whether a request may go upstream now;
- the fallback (serve locally when the upstream fails before the first token) is the router's;
- there are no retries inside simmer: a failed upstream attempt falls back once or fails; the client's own
  retry (the openai SDK has one) is the only retry loop around simmer.

States: closed -> (N consecutive failures, an "offline" failure, or a Retry-After) -> open until the
cooldown (or Retry-After) ends -> half-open: one probe goes through; its success closes the breaker, its
failure opens it again. The clock is a seam (tests pass a fake one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["closed", "open", "half_open"]

# Failure kinds (upstream.py classifies): each counts towards N; "offline" (no route to the host, no DNS)
# opens at once, since the next request would fail the same way.
OPENS_AT_ONCE = frozenset({"offline"})
MAX_RETRY_AFTER_S = 600.0  # a Retry-After beyond this is capped (a misconfigured upstream must not exile us)


@dataclass(frozen=True)
class BreakerView:
    state: State
    consecutive_failures: int
    retry_in_s: float  # until the next probe may go (0 unless open)
    opened: int  # times it opened
    last_failure: str | None


class Breaker:
    def __init__(
        self,
        failures: int = 3,
        cooldown_s: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("failures must be >= 1 and cooldown_s > 0")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._consecutive = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False  # a half-open probe is in flight
        self.opened = 0
        self.last_failure: str | None = None

    @property
    def state(self) -> State:
        if self._open_until is None:
            return "closed"
        return "open" if self._clock() < self._open_until or self._probing else "half_open"

    def available(self) -> bool:
        """May a request go upstream now? (Closed, or the cooldown is over and no probe is in flight.)"""
        return self.state != "open"

    def begin(self) -> bool:
        """A request goes upstream now. In half-open it is the probe (returns True): others wait for its
        outcome. Pass the result to success/failure/abandon."""
        if self.state == "half_open":
            self._probing = True
            return True
        return False

    def success(self, probe: bool = False) -> None:
        self._consecutive = 0
        self._open_until = None
        self._probing = False

    def failure(self, kind: str, retry_after_s: float | None = None, probe: bool = False) -> None:
        self._consecutive += 1
        self.last_failure = kind
        now = self._clock()
        was_probe = probe and self._probing
        if probe:
            self._probing = False
        until = None
        if was_probe or self._consecutive >= self.failures or kind in OPENS_AT_ONCE:
            until = now + self.cooldown_s
        if retry_after_s is not None and retry_after_s > 0:
            told = now + min(retry_after_s, MAX_RETRY_AFTER_S)
            until = told if until is None else max(until, told)
        if until is None:
            return
        if self._open_until is None or was_probe or now >= self._open_until:
            self.opened += 1
            self._open_until = until
        else:  # already open: a late failure of an earlier request can only lengthen the cooldown
            self._open_until = max(self._open_until, until)

    def abandon(self, probe: bool = False) -> None:
        """The attempt ended without a verdict (the client left first): free the probe slot."""
        if probe:
            self._probing = False

    def view(self) -> BreakerView:
        state = self.state
        retry = 0.0
        if state == "open" and self._open_until is not None:
            retry = max(0.0, self._open_until - self._clock())
        return BreakerView(state, self._consecutive, _round(retry), self.opened, self.last_failure)


def _round(seconds: float) -> float:
    return 0.0 if not math.isfinite(seconds) else round(seconds, 3)
