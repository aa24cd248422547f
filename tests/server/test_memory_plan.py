"""The memory planner with fake budgets: what a model costs, what is free, and what a load unloads."""

from __future__ import annotations

import pytest

from governor.sensors import MemoryReading
from models.errors import InsufficientMemory
from models.runtime.session import kv_bytes_per_token
from server.serving.memory_plan import (
    RUNTIME_BYTES,
    TOKENIZER_FACTOR,
    Estimate,
    MemoryBudget,
    Resident,
    estimate,
    plan_load,
)

MiB = 1 << 20
MANIFEST = {
    "context_length": 8192,
    "architecture": {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64},
    "variants": {"q4-a8": {"weights_bytes": 146 * MiB}},
    "files": {"tokenizer.json": {"size": 2 * MiB}},
}


def test_estimate_when_manifest_then_weights_kv_at_the_cap_per_slot_tokenizer_runtime():
    e = estimate(MANIFEST, "q4-a8", context_length=2048, prefix_slots=2, prefix_budget_bytes=1 << 30)
    per_token = kv_bytes_per_token(30, 3, 64)  # the one formula, next to the KV cache
    assert e.weights_bytes == 146 * MiB
    assert e.kv_bytes == per_token * 2048 * 2
    assert e.tokenizer_bytes == 2 * MiB * TOKENIZER_FACTOR
    assert e.total == 146 * MiB + per_token * 2048 * 2 + 2 * MiB * TOKENIZER_FACTOR + RUNTIME_BYTES


def test_estimate_when_context_cap_above_the_model_then_the_model_context_and_one_slot_in_budget():
    e = estimate(MANIFEST, "q4-a8", context_length=100_000, prefix_slots=4, prefix_budget_bytes=1)
    assert e.kv_bytes == kv_bytes_per_token(30, 3, 64) * 8192  # one slot always: the reply needs it


def reading(available_mib: int) -> MemoryReading:
    return MemoryReading(
        limit_bytes=4096 * MiB, used_bytes=0, available_bytes=available_mib * MiB, source="cgroup-v2"
    )


@pytest.mark.parametrize(
    ("budget", "loaded", "free"),
    [
        (MemoryBudget(1000 * MiB, 64 * MiB), 300 * MiB, 700 * MiB),  # explicit: what the models leave of it
        (MemoryBudget(None, 64 * MiB, lambda: reading(500)), 300 * MiB, 436 * MiB),  # available - reserve
        (MemoryBudget(None, 64 * MiB), 0, None),  # nothing known
    ],
)
def test_budget_free(budget, loaded, free):
    assert budget.free(loaded) == free


def need(mib: int) -> Estimate:
    return Estimate(mib * MiB, 0, 0, 0)


def residents() -> list[Resident]:
    return [
        Resident("a", 100 * MiB, last_used=3.0),
        Resident("b", 200 * MiB, last_used=1.0),
        Resident("c", 50 * MiB, 2.0),
    ]


@pytest.mark.parametrize(
    ("free_mib", "need_mib", "evict"),
    [
        (None, 10_000, ()),  # no budget known: load
        (400, 400, ()),  # fits
        (100, 300, ("b",)),  # the least recently used goes first
        (100, 350, ("b", "c")),  # then the next
        (100, 450, ("b", "c", "a")),
    ],
)
def test_plan_load_when_it_fits_or_lru_makes_room(free_mib, need_mib, evict):
    free = None if free_mib is None else free_mib * MiB
    assert plan_load("new", need(need_mib), free, residents()).evict == evict


def test_plan_load_when_busy_model_then_never_evicted():
    loaded = [Resident("busy", 500 * MiB, 0.0, busy=True), Resident("idle", 100 * MiB, 5.0)]
    assert plan_load("new", need(150), 100 * MiB, loaded).evict == ("idle",)


def test_plan_load_when_even_every_idle_model_is_not_enough_then_refuse_with_numbers_and_evict_nothing():
    loaded = [Resident("busy", 500 * MiB, 0.0, busy=True), Resident("idle", 100 * MiB, 5.0)]
    with pytest.raises(InsufficientMemory) as err:
        plan_load("new", need(900), 100 * MiB, loaded, budget="the budget of 700 MiB")
    message = err.value.message
    assert "needs ~900 MiB" in message and "leaves 100 MiB free" in message and "100 MiB more" in message
    assert "in use: busy ~500 MiB" in message and "Nothing was unloaded" in message
    assert err.value.numbers == {"needed_bytes": 900 * MiB, "free_bytes": 100 * MiB, "idle_bytes": 100 * MiB}
