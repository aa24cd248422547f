"""What each level asks of the engine, and the ladder of variants to step down on.

Levers are ordered cheapest and most reversible first: fewer threads, a CPU pace, capped tokens, a shorter
context, a cheaper variant or smaller model, then pausing. The worker applies them between tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from governor.policy import LEVELS, Level


@dataclass(frozen=True)
class Limits:
    """None means "no limit". `variant`/`model_id` name the ladder rung to run, when a ladder is known."""

    threads: int | None = None
    variant: str | None = None
    context_cap: int | None = None
    max_tokens: int | None = None
    tokens_per_second: float | None = None
    pause_new: bool = False
    pause_running: bool = False
    model_id: str | None = None
    cpu_budget_cores: float | None = None  # average busy cores allowed (the pace, when s/token is unknown)

    def pace_delay(self, pass_seconds: float) -> float:
        """Seconds to idle after a forward pass that kept `threads` cores busy for `pass_seconds`, so the
        average stays within cpu_budget_cores. A worker that paces by tokens_per_second needs not call it."""
        if self.cpu_budget_cores is None or self.cpu_budget_cores <= 0:
            return 0.0
        busy = self.threads or 1
        return max(0.0, pass_seconds * (busy / self.cpu_budget_cores - 1.0))


@dataclass(frozen=True)
class LevelLimits:
    """One row of the table. Threads and pace are relative so the table fits any machine and model."""

    thread_fraction: float = 1.0  # of the usable CPUs, rounded down, at least 1
    cpu_budget_cores: float | None = None  # pace decode to this many busy cores (needs cpu_s_per_token)
    tokens_per_second: float | None = None  # explicit pace; wins over cpu_budget_cores
    context_cap: int | None = None
    max_tokens: int | None = None
    rung_step: int = 0  # rungs below the start rung (cheaper)
    pause_new: bool = False
    pause_running: bool = False


# Sized on the phone profile with 2 cores (docs/governor.md, "The thermal model"; leakage included): 2 busy
# cores settle at ~69 C, 1 core at ~44.6 C (just above T_throttle 43), 0.75 core at ~40 C. So fair halves the
# threads, serious paces to 0.75 core on a cheaper rung (the device then settles below T_throttle at
# serious), critical pauses.
DEFAULT_TABLE: dict[Level, LevelLimits] = {
    "nominal": LevelLimits(),
    "fair": LevelLimits(thread_fraction=0.5),
    "serious": LevelLimits(
        thread_fraction=0.0, cpu_budget_cores=0.75, context_cap=1024, max_tokens=512, rung_step=1
    ),
    "critical": LevelLimits(
        thread_fraction=0.0,
        cpu_budget_cores=0.25,
        context_cap=512,
        max_tokens=256,
        rung_step=1,
        pause_new=True,
        pause_running=True,
    ),
}


def make_table(overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[Level, LevelLimits]:
    """The default table with per-level field overrides, e.g. {"serious": {"max_tokens": 256}}."""
    table = dict(DEFAULT_TABLE)
    for level, fields in (overrides or {}).items():
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r} in limits overrides")
        table[level] = replace(table[level], **fields)  # type: ignore[index]
    return table


# -- the variant ladder ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rung:
    model_id: str
    variant: str
    cpu_s_per_token: float
    quality_top1: float
    bytes: int


def build_ladder(rungs: Sequence[tuple[str, str, float, float, int]]) -> list[Rung]:
    """Best first by quality, then cheapness (CPU s/token, then bytes). A rung that is no cheaper than a
    better one is dropped: every step down the ladder then saves CPU, which is what the governor wants."""
    ordered = sorted((Rung(*r) for r in rungs), key=lambda r: (-r.quality_top1, r.cpu_s_per_token, r.bytes))
    ladder: list[Rung] = []
    for rung in ordered:
        if not ladder or rung.cpu_s_per_token < ladder[-1].cpu_s_per_token:
            ladder.append(rung)
    return ladder


def rungs_from_manifest(model_id: str, variants: Mapping[str, Mapping[str, Any]]) -> list[tuple]:
    """Manifest entries {"q4": {"speed": {"cpu_s_per_token": ..}, "quality": {"top1_agreement": ..},
    "weights_bytes": .. (or "memory": {"total_bytes": ..})}, ...} -> build_ladder() tuples. Unmeasured
    variants are skipped."""
    out = []
    for variant, data in variants.items():
        try:
            size = data["weights_bytes"] if "weights_bytes" in data else data["memory"]["total_bytes"]
            out.append(
                (
                    model_id,
                    variant,
                    float(data["speed"]["cpu_s_per_token"]),
                    float(data["quality"]["top1_agreement"]),
                    int(size),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    return out


class NoRungFits(ValueError):
    """No variant of any installed model fits the memory budget. Refuse to load rather than be OOM-killed."""

    code = "insufficient_memory"


def pick_rung(
    ladder: Sequence[Rung], budget_bytes: int, estimate: Callable[[Rung], int] | None = None
) -> int:
    """Index of the best rung whose estimated memory (weights + KV + runtime) fits the budget."""
    estimate = estimate or (lambda r: r.bytes)
    needs = []
    for i, rung in enumerate(ladder):
        need = estimate(rung)
        if need <= budget_bytes:
            return i
        needs.append(f"{rung.model_id}/{rung.variant} needs {need / 2**20:.0f} MiB")
    detail = "; ".join(needs) or "no variants installed"
    raise NoRungFits(f"no model variant fits the memory budget of {budget_bytes / 2**20:.0f} MiB ({detail})")


def resolve_limits(
    level: Level,
    *,
    usable_cpus: int,
    table: Mapping[Level, LevelLimits] = DEFAULT_TABLE,
    ladder: Sequence[Rung] = (),
    start_rung: int = 0,
) -> Limits:
    """The concrete Limits for a level on this machine and ladder."""
    row = table[level]
    threads = max(1, math.floor(usable_cpus * row.thread_fraction))
    rung = ladder[min(start_rung + row.rung_step, len(ladder) - 1)] if ladder else None
    pace = row.tokens_per_second
    if pace is None and row.cpu_budget_cores is not None and rung is not None and rung.cpu_s_per_token > 0:
        pace = row.cpu_budget_cores / rung.cpu_s_per_token
    return Limits(
        threads=threads,
        variant=rung.variant if rung else None,
        model_id=rung.model_id if rung else None,
        context_cap=row.context_cap,
        max_tokens=row.max_tokens,
        tokens_per_second=pace,
        pause_new=row.pause_new,
        pause_running=row.pause_running,
        cpu_budget_cores=row.cpu_budget_cores,
    )
