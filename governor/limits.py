"""What each level asks of the engine, the ladder of variants to step down on, and the configuration a CPU
budget buys the most tokens with.

Levers are ordered cheapest and most reversible first: fewer threads, a CPU pace, capped tokens, a shorter
context, a cheaper variant or smaller model, then pausing. The worker applies them between tokens.

A CPU budget (busy cores: the level table's, or the pace controller's in governor/policy.py) is spent on
the configuration of the level's variant (threads x spinning) that makes the most tokens per second within
it; the variant itself steps down the ladder, which orders variants by their measured CPU per token. Where
the budget binds, that is the one with the least CPU time per token, not the fastest: a phone held at its
envelope runs one thread without spinning, because a thread pool never makes a token cheaper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from governor.policy import LEVELS, Level, LoadRoom


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
    spin: bool | None = None  # may thread pools spin between runs (pool_spin); None: the engine's setting
    rung_held: bool = False  # the level names another rung, whose load the device has no room for now

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
    rung_step: int = 0  # rungs below the start rung (cheaper); clamped to the ladder's last (BOTTOM_RUNG)
    pause_new: bool = False
    pause_running: bool = False


BOTTOM_RUNG = 1 << 16  # a rung_step past any ladder: the cheapest rung, however long the ladder is


# Sized on the phone profile with 2 cores (docs/governor.md, "The thermal model"; leakage included): 2 busy
# cores settle at ~69 C, 1 core at ~44.6 C (just above T_throttle 43), 0.75 core at ~40 C. So fair halves the
# threads, serious paces to 0.75 core on a cheaper rung (the device then settles below T_throttle at
# serious), critical pauses.
# With the pace controller on (the default) a thermal level's threads and CPU budget come from the controller
# instead (resolve_limits): these rows' thread fractions and budgets then serve the other causes (memory,
# battery, background at low priority) and pace_control off.
# The ladder (rungs best first: each model's variants, then the next model's):
#   nominal, fair -> the start rung (the memory tier's pick): fair's fewer threads cost no quality
#   serious       -> one rung down: the next cheaper variant, or, with one rung per model (the nominal q4-a8
#                    ladder), the next model; the pace controller holds the envelope on it, and one step
#                    keeps a reply that moves mid-way on the nearest quality
#   critical      -> the cheapest rung (BOTTOM_RUNG). Work is paused there, so its quality costs nothing
#                    while it lasts, and it is the rung that frees the most: the worker unloads the idle
#                    bigger models (critical from memory is an OOM kill ahead) and the device sheds their
#                    memory while it cools. Cooling, the rung climbs back with the level (serious's one
#                    step, then the start rung); with more than two rungs that reloads a bigger model once.
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
        rung_step=BOTTOM_RUNG,
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
    threads: int = 0  # the threads cpu_s_per_token was measured with (0: unknown)
    decode_tok_s: float = 0.0  # the decode speed measured with them (0: unknown)


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
    """Manifest entries {"q4": {"speed": {"cpu_s_per_token": .., "threads": .., "decode_tok_s": ..},
    "quality": {"top1_agreement": ..}, "weights_bytes": .. (or "memory": {"total_bytes": ..})}, ...}
    -> build_ladder() tuples. Unmeasured variants are skipped."""
    out = []
    for variant, data in variants.items():
        try:
            size = data["weights_bytes"] if "weights_bytes" in data else data["memory"]["total_bytes"]
            speed = data["speed"]
            out.append(
                (
                    model_id,
                    variant,
                    float(speed["cpu_s_per_token"]),
                    float(data["quality"]["top1_agreement"]),
                    int(size),
                    int(speed.get("threads") or 0),
                    float(speed.get("decode_tok_s") or 0.0),
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


# The rung a level names, where reaching it would load a model (the worker loads on demand). A load is the
# one burst of CPU no pace governs, so a rung whose model is not loaded counts its load's heat first:
#
#   no room known (no temperature; memory pressure), or what is loaded not known (None) -> the level's rung
#   fits(rung): its model is loaded, or the device is below its throttling point and the heat that model's
#               load adds (rises: measured, or scaled from another model's, load_heat.with_priors; not
#               known: 0) is less than the room before critical
#   the level's rung fits                               -> it
#   else the nearest fitting rung below it, else the nearest fitting rung above it
#   none fits (nothing loaded, no load fits)            -> the cheapest rung: a load must happen, and it is
#                                                          the smallest
# Below first: it is the cheaper one the level asked for. Above: the loaded model goes on serving, paced by
# the same CPU budget, until the device has room for the load. At start nothing is loaded: the start rung
# is the best one whose load the device can take (a phone in a heatwave does not start on its biggest model).
def choose_rung(
    ladder: Sequence[Rung],
    index: int,
    loaded: Collection[str] | None,
    room: LoadRoom | None,
    rises: Mapping[str, float],
) -> int:
    if room is None or loaded is None or not ladder:
        return index

    def fits(rung: Rung) -> bool:
        if rung.model_id in loaded:
            return True
        return room.below_throttle and rises.get(rung.model_id, 0.0) < room.room_c

    for i in [index, *range(index + 1, len(ladder)), *range(index - 1, -1, -1)]:
        if fits(ladder[i]):
            return i
    return len(ladder) - 1


# -- configurations and what a token costs in each -------------------------------------------------------
@dataclass(frozen=True)
class ConfigCost:
    """One way to run a variant and what a token costs there: measured (the gate's meter, the engine
    bench), or derived from the manifest's one measurement (config_costs).

    Spinning is not a lever of its own: the engine spins only while unpaced (session_key), which is what
    pick_config's rule says too. It is part of the key because a spinning pool's cost is another number."""

    variant: str
    threads: int
    spinning: bool | None  # None: not known (a prior)
    cpu_s_per_token: float  # process CPU seconds (all threads) per generated token
    tok_s: float  # decode tokens per wall second, unpaced
    model_id: str | None = None  # whose variant (None: any model's of this name, e.g. an engine bench table)
    # replies per pass measured (a batch decodes several at once, each token cheaper): the governor's table
    # holds, per configuration, the batch size that ran last (merge_cost), so its pace follows the batch
    rows: int = 1


# Busy cores per thread under which a manifest's speed was measured starved (see config_costs). Two quiet
# threads here keep 1.6-1.8 cores busy (SmolLM2, Gemma 3); a store converted at machine load 5+ measured
# Gemma 3 at 1.0 core of 2, and every server on it then decoded on one thread.
STARVED_SHARE = 0.6


def config_costs(rung: Rung, max_threads: int, measured: Sequence[ConfigCost] = ()) -> list[ConfigCost]:
    """The configurations of `rung`'s variant with 1..max_threads threads.

    A thread count with measured entries (the gate's meter, an engine bench table) uses them (one of
    unknown speed, tok_s 0, gets the prior's). Where none is of a quiet (non-spinning) pool, a prior stands
    in, from the manifest's one measurement (c CPU s/token and s tok/s at T threads; T unknown:
    max_threads) and the rule that a thread pool never makes a token cheaper: t threads cost c, or more if
    fewer threads were measured dearer here (the manifest may come from a quieter machine), and make at
    most t / cost tokens per second (one thread: 1 / cost, at most s; more: s * t / T). A measurement that
    kept fewer than STARVED_SHARE x T cores busy (s * c) was starved of CPU by other work (a store
    converted on a busy machine): its s says how busy the machine was, not what T threads make, so
    s = T / c, and the meter's own measurements correct it. A rung measured nowhere has no configurations
    (the worker then paces by the CPU budget alone)."""
    out: list[ConfigCost] = []
    c = rung.cpu_s_per_token
    big_t = rung.threads or max_threads
    s = rung.decode_tok_s or (big_t / c if c > 0 else 0.0)
    if c > 0 and s * c < STARVED_SHARE * big_t:
        s = big_t / c
    mine = [
        m
        for m in measured
        if m.variant == rung.variant and m.model_id in (None, rung.model_id) and m.cpu_s_per_token > 0
    ]
    for t in range(1, max_threads + 1):
        fewer = [m.cpu_s_per_token for m in mine if m.threads < t and not m.spinning]
        cost = max([c, *fewer])
        prior_tok_s = 0.0 if cost <= 0 else min(s, 1.0 / cost) if t == 1 else min(s * t / big_t, t / cost)
        own = [m for m in mine if m.threads == t]
        for m in own:  # a speed not measured: the prior's, else what t busy cores allow
            out.append(m if m.tok_s > 0 else replace(m, tok_s=prior_tok_s or t / m.cpu_s_per_token))
        if c > 0 and all(m.spinning for m in own):  # no measurement of a quiet pool: the prior stands in
            out.append(ConfigCost(rung.variant, t, None, cost, prior_tok_s))
    return out


def merge_cost(costs: Sequence[ConfigCost], new: ConfigCost) -> tuple[ConfigCost, ...]:
    """The table with `new` in place of the entry for its (model, variant, threads, spinning), whatever
    batch size either measured: the cost of the batch running now is the one a pace must buy."""

    def key(c: ConfigCost) -> tuple:
        return (c.model_id, c.variant, c.threads, c.spinning)

    return (*(c for c in costs if key(c) != key(new)), new)


SWITCH_GAIN = 1.10  # another configuration must make this much more to replace the running one


def pick_config(
    configs: Sequence[ConfigCost],
    budget_cores: float | None,
    current: tuple[str, int] | None = None,
    hold: bool = False,
    frugal: bool = False,
) -> tuple[ConfigCost, float | None]:
    """The configuration that makes the most tokens per second within budget_cores (None: no budget), and
    the pace (tokens/s) that keeps it within the budget (None: no budget).

    Rule table, for each configuration: rate = min(tok_s, budget / cpu_s_per_token)
      under a budget, spinning pools do not compete (a paced stream leaves gaps a spinning pool burns)
      the near ones: rate within 5 % of the highest
      among them: the least CPU per token, then the fewest threads, then no spinning
      the running configuration (`current`: variant, threads) stays if it is not near and the winner makes
      less than SWITCH_GAIN times its rate (a new thread count is a new onnxruntime session: not for a few
      per cent; together with the 5 % this is a hysteresis band, so a budget near a boundary cannot flap)
      `hold`: the running configuration stays whatever the others make (it changed moments ago: a budget
      swinging across the band must not rebuild the session every few seconds); the pace still keeps it
      within the budget
    `frugal` (on battery): rate = tokens per CPU-second (1 / cpu_s_per_token) whatever the budget, and
      spinning pools do not compete: a charge buys tokens, not speed; the rest of the table is the same
    Where the budget binds every configuration, the highest rate IS the least CPU per token.
    """
    if not configs:
        raise ValueError("pick_config needs at least one configuration")
    if budget_cores is not None or frugal:
        configs = [c for c in configs if not c.spinning] or list(configs)

    def rate(c: ConfigCost) -> float:
        if frugal:
            return 1.0 / c.cpu_s_per_token
        return c.tok_s if budget_cores is None else min(c.tok_s, budget_cores / c.cpu_s_per_token)

    top = max(rate(c) for c in configs)
    near = [c for c in configs if rate(c) >= 0.95 * top]
    best = min(near, key=lambda c: (c.cpu_s_per_token, c.threads, bool(c.spinning)))
    running = [c for c in configs if (c.variant, c.threads) == current]
    if running and (hold or (running[0] not in near and rate(best) < SWITCH_GAIN * rate(running[0]))):
        best = running[0]
    # The pace is the budget's even where the configuration cannot reach it (it then never waits): a pace
    # that vanished as the budget crossed the configuration's speed would make the output discontinuous,
    # and a controller sitting there would cycle.
    return best, (None if budget_cores is None else budget_cores / best.cpu_s_per_token)


# Whether the engine's thread pools may spin between runs (onnxruntime's allow_spinning), decided with the
# pace because a pool's spinning is CPU time: under a thermal cap tokens/s = the envelope's busy cores x
# tokens per CPU-second, and a pool that spins through the idle a pace leaves (the gate's idle after each
# pass) spends envelope on no token. Measured (q4-a8 decode, Gemma 3 270M and SmolLM2, a shared 2-core
# host): two spinning threads made 0.49-0.58x the tokens per CPU-second of one thread, two quiet threads
# 0.80-0.86x.
#   on battery (resolve_limits' `frugal`)              -> False: the charge buys tokens, not speed
#   a CPU budget (the pace controller's or the row's) -> False
#   a tokens/s pace (the row's own)                   -> False
#   neither: unpaced (nominal, a cool device, an ungoverned server: the limits are not enforced, so no
#            budget reaches here)                      -> None: the engine's setting (SIMMER_SPIN; auto spins,
#                                                         back to back tokens come faster on a spinning pool)
def pool_spin(budget_cores: float | None, tokens_per_second: float | None) -> bool | None:
    return False if budget_cores is not None or tokens_per_second is not None else None


def resolve_limits(
    level: Level,
    *,
    usable_cpus: int,
    table: Mapping[Level, LevelLimits] = DEFAULT_TABLE,
    ladder: Sequence[Rung] = (),
    start_rung: int = 0,
    pace_cores: float | None = None,
    thermal: bool = False,
    costs: Sequence[ConfigCost] = (),
    current: tuple[str, int] | None = None,
    hold: bool = False,
    loaded: Collection[str] | None = None,
    room: LoadRoom | None = None,
    rises: Mapping[str, float] | None = None,
    frugal: bool = False,
) -> Limits:
    """The concrete Limits for a level on this machine and ladder.

    The rung is start_rung + the row's rung_step, clamped to the ladder's cheapest (the table's comment
    says which level uses which rungs, and why), or the nearest one whose model is `loaded` or whose load
    the device has `room` for (choose_rung).
    pace_cores is the pace controller's CPU budget. When the level's cause is thermal it replaces the
    row's budget and thread fraction (the controller, not the table, holds the thermal envelope; up to
    usable_cpus threads); otherwise the row's apply, with the tighter of the two budgets.

    The budget buys the configuration pick_config() names among the rung's: its threads and spinning by
    measured cost, and its pace is tokens_per_second. The variant is the rung's: the ladder already steps
    to cheaper variants by their measured CPU per token, and a variant switch mid-reply costs a re-prefill
    of the history, so it is not chased on a few per cent of measurement noise. Without a measured cost
    the worker paces by cpu_budget_cores alone (Limits.pace_delay). Paced, the pools do not spin
    (pool_spin). `frugal` (on battery): the configuration with the most tokens per CPU-second, and no
    spinning pool (a spinning thread burns the charge while it waits for work)."""
    row = table[level]
    max_threads = max(1, math.floor(usable_cpus * row.thread_fraction))
    named = min(start_rung + row.rung_step, len(ladder) - 1) if ladder else -1
    rung_index = choose_rung(ladder, named, loaded, room, rises or {})
    rung = ladder[rung_index] if ladder else None
    budget = row.cpu_budget_cores
    if pace_cores is not None and thermal:
        budget, max_threads = pace_cores, max(1, usable_cpus)
    elif pace_cores is not None:
        budget = pace_cores if budget is None else min(budget, pace_cores)
    if budget is not None and budget >= usable_cpus:
        budget = None  # every usable core: no budget at all (a cool device's controller sits here)
    threads, pace = max_threads, None
    if rung is not None:
        configs = config_costs(rung, max_threads, costs)
        if configs:
            best, pace = pick_config(configs, budget, current, hold, frugal)
            threads = best.threads
    if row.tokens_per_second is not None:
        pace = row.tokens_per_second if pace is None else min(pace, row.tokens_per_second)
    return Limits(
        threads=threads,
        variant=rung.variant if rung else None,
        model_id=rung.model_id if rung else None,
        context_cap=row.context_cap,
        max_tokens=row.max_tokens,
        tokens_per_second=pace,
        pause_new=row.pause_new,
        pause_running=row.pause_running,
        cpu_budget_cores=budget,
        spin=False if frugal else pool_spin(budget, pace),
        rung_held=rung_index != named,
    )
