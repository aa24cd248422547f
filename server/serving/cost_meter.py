"""The meter: what a step of each configuration really costs here. The gate (serving/governor_gate.py) feeds
it every pass and hands what it publishes to the governor, whose CPU budget then buys the configuration
that is really cheapest on this machine (governor/limits.py pick_config)."""

from __future__ import annotations

import statistics
from collections import deque

from governor.limits import ConfigCost

Key = tuple[str | None, str, int, bool]  # model, variant, threads, spinning


class CostMeter:
    """Process CPU seconds (all threads: the engine's pool, the HTTP thread, everything that heats the
    device) and wall seconds per pass of each configuration (model, variant, threads, spinning) the engine
    runs. A pass is what lies between two steps without the gate's idle: one decode token (a forward pass,
    the sampling, the hand-off), or now and then a prefill chunk, which the medians over the last `window`
    passes leave out. Every `publish_every` passes the configuration's ConfigCost is published: CPU per
    token, and tokens per second unpaced (1 / wall per pass). One pass is one token today; a pass that
    verifies several speculated tokens will have to be divided by the tokens it accepted.

    Keyed by model as well as variant: a ladder across models may hold two models' variants of one name."""

    def __init__(self, window: int = 32, publish_every: int = 4) -> None:
        self.window = window
        self.publish_every = publish_every
        self._cpu: dict[Key, deque[float]] = {}
        self._wall: dict[Key, deque[float]] = {}
        self._since: dict[Key, int] = {}

    def step(
        self,
        variant: str,
        threads: int,
        spinning: bool,
        cpu_s: float,
        wall_s: float,
        *,
        model_id: str | None = None,
    ) -> ConfigCost | None:
        key = (model_id, variant, threads, spinning)
        cpu = self._cpu.setdefault(key, deque(maxlen=self.window))
        wall = self._wall.setdefault(key, deque(maxlen=self.window))
        cpu.append(max(0.0, cpu_s))
        wall.append(max(0.0, wall_s))
        self._since[key] = self._since.get(key, 0) + 1
        if self._since[key] < self.publish_every or len(cpu) < self.publish_every:
            return None
        self._since[key] = 0
        per_token, per_pass = statistics.median(cpu), statistics.median(wall)
        if per_token <= 0:
            return None
        tok_s = 1.0 / per_pass if per_pass > 0 else 0.0
        return ConfigCost(variant, threads, spinning, per_token, tok_s, model_id)
