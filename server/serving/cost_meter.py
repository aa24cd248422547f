"""The meter: what a pass of each configuration, and of each batch size, really costs here. The gate
(serving/governor_gate.py) feeds it every pass and hands what it publishes to the governor, whose CPU budget
then buys the configuration that is really cheapest on this machine (governor/limits.py pick_config), and
paces the tokens a batch really makes per CPU-second."""

from __future__ import annotations

import statistics
import threading
from collections import deque

from governor.limits import ConfigCost

Key = tuple[str | None, str, int, bool, int]  # model, variant, threads, spinning, tokens per pass


class CostMeter:
    """Process CPU seconds (all threads: the engine's pool, the HTTP thread, everything that heats the
    device) and wall seconds per pass of each configuration (model, variant, threads, spinning) the engine
    runs, apart for each number of tokens a pass makes: one for the one-reply engine's decode step, k for a
    batch's pass of k replies (a pass of k rows costs less than k passes of one: the weights are read once
    for all rows), or k for a round of k replies taking turns (models/runtime/turns.py: k passes of one row,
    about k times one). A pass is what lies between two steps without the gate's idle: one decode pass (the
    forward pass, the sampling, the hand-off), or now and then a prefill chunk, which the medians over the
    last `window` passes leave out (a batch's prefill chunks make no token: not counted at all). A pass is
    work alone: the gate's idle is the only wait that holds a pace (the engine and the batch loop never
    sleep for one), and the gate leaves it out. Every `publish_every` passes of one batch size its
    ConfigCost is published: CPU per token (the pass's over its tokens), tokens per second unpaced (tokens /
    wall per pass), and `rows`, the batch size. A pass that verifies several speculated tokens will have to
    be divided by the tokens it accepted.

    Keyed by model as well as variant: a ladder across models may hold two models' variants of one name."""

    def __init__(self, window: int = 32, publish_every: int = 4) -> None:
        self.window = window
        self.publish_every = publish_every
        self._cpu: dict[Key, deque[float]] = {}
        self._wall: dict[Key, deque[float]] = {}
        self._since: dict[Key, int] = {}
        self._lock = threading.Lock()  # the worker steps it, a /metrics scrape reads its table

    def step(
        self,
        variant: str,
        threads: int,
        spinning: bool,
        cpu_s: float,
        wall_s: float,
        *,
        model_id: str | None = None,
        tokens: int = 1,
    ) -> ConfigCost | None:
        """One pass that made `tokens` tokens (0: a prefill chunk of a batch, not counted)."""
        if tokens < 1:
            return None
        key = (model_id, variant, threads, spinning, tokens)
        with self._lock:
            cpu = self._cpu.setdefault(key, deque(maxlen=self.window))
            wall = self._wall.setdefault(key, deque(maxlen=self.window))
            cpu.append(max(0.0, cpu_s) / tokens)
            wall.append(max(0.0, wall_s))
            self._since[key] = self._since.get(key, 0) + 1
            if self._since[key] < self.publish_every or len(cpu) < self.publish_every:
                return None
            self._since[key] = 0
            return self._cost(key)

    def _cost(self, key: Key) -> ConfigCost | None:
        model_id, variant, threads, spinning, tokens = key
        per_token, per_pass = statistics.median(self._cpu[key]), statistics.median(self._wall[key])
        if per_token <= 0:
            return None
        tok_s = tokens / per_pass if per_pass > 0 else 0.0
        return ConfigCost(variant, threads, spinning, per_token, tok_s, model_id, rows=tokens)

    def table(self) -> list[ConfigCost]:
        """What every configuration and batch size measured costs now (at least publish_every passes),
        fewest rows first: what `simmer bench concurrency` and /metrics show."""
        with self._lock:
            least = min(self.publish_every, self.window)
            costs = [self._cost(key) for key, cpu in self._cpu.items() if len(cpu) >= least]
        found = [c for c in costs if c is not None]
        return sorted(found, key=lambda c: (c.model_id or "", c.variant, c.threads, bool(c.spinning), c.rows))
