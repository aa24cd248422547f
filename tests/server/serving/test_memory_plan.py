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


# -- batch rows go before a model --------------------------------------------------------------------------
def batched(weights_mib: int, rows: int = 4, row_mib: int = 10) -> Estimate:
    """A model serving batches of `rows` replies, each row a KV buffer of row_mib."""
    return Estimate(weights_mib * MiB, rows * row_mib * MiB, 0, 0, rows=rows, row_bytes=row_mib * MiB)


def idle(model_id: str, weights_mib: int, last_used: float, busy: bool = False) -> Resident:
    e = batched(weights_mib)
    return Resident(model_id, e.total, last_used, busy, e.rows, e.row_bytes)


@pytest.mark.parametrize(
    ("batch", "kv_mib", "rows"),
    [(None, 40, 4), (4, 40, 4), (8, 40, 4), (3, 30, 3), (2, 20, 2), (1, 0, 0), (0, 0, 0)],
)
def test_estimate_with_rows_when_fewer_replies_then_fewer_kv_rows_never_more(batch, kv_mib, rows):
    fewer = batched(300).with_rows(batch)
    assert (fewer.kv_bytes, fewer.rows) == (kv_mib * MiB, rows)  # one at a time: no batch decoder


def test_estimate_when_batch_rows_then_each_a_kv_buffer_of_the_whole_context():
    e = estimate(
        MANIFEST, "q4-a8", context_length=2048, prefix_slots=1, prefix_budget_bytes=1 << 30, batch_rows=4
    )
    row = kv_bytes_per_token(30, 3, 64) * 2048
    assert (e.rows, e.row_bytes, e.kv_bytes) == (4, row, 5 * row)
    assert e.with_rows(2).kv_bytes == 3 * row and e.with_rows(1).kv_bytes == row


@pytest.mark.parametrize(
    ("free_mib", "loaded", "rows", "evict"),
    [
        (400, [], None, ()),  # 340 fits
        (335, [], 3, ()),  # 330 at three rows
        (315, [], 1, ()),  # 320 at two rows does not fit: one reply at a time, 300
        (310, [idle("a", 100, 1.0)], 2, ()),  # a's rows beyond 2 count: 310 + 20 >= 320
        (310, [idle("a", 100, 1.0, busy=True)], 1, ()),  # a busy model's batch keeps its rows
        (200, [idle("a", 100, 2.0), idle("b", 50, 1.0)], 1, ("b",)),  # rows first, then the LRU model
        (250, [idle("a", 100, 2.0), idle("b", 50, 1.0)], 1, ()),  # their rows alone make room
        (150, [idle("a", 100, 2.0), idle("b", 50, 1.0)], 1, ("b", "a")),
    ],
)
def test_plan_load_when_short_then_batch_rows_go_before_any_model(free_mib, loaded, rows, evict):
    plan = plan_load("new", batched(300), free_mib * MiB, loaded)
    assert (plan.rows, plan.evict) == (rows, evict)
    assert plan.need_bytes == batched(300).with_rows(rows).total


def test_plan_load_when_short_even_one_reply_at_a_time_then_refused_with_its_numbers():
    with pytest.raises(InsufficientMemory) as err:
        plan_load("new", batched(300), 200 * MiB, [idle("a", 100, 1.0, busy=True)])
    assert "needs ~300 MiB" in err.value.message and "one reply at a time" in err.value.message
    assert err.value.numbers["needed_bytes"] == 300 * MiB


def test_estimate_when_the_variant_has_a_half_cache_then_half_the_kv_and_the_others_unchanged():
    manifest = {**MANIFEST, "variants": {**MANIFEST["variants"], "fast": {"weights_bytes": 120 * MiB}}}
    manifest["variants"]["q4-a8"] = {**manifest["variants"]["q4-a8"], "kv_dtype": "float16"}
    half = estimate(manifest, "q4-a8", context_length=2048, prefix_slots=2, prefix_budget_bytes=1 << 30)
    full = estimate(manifest, "fast", context_length=2048, prefix_slots=2, prefix_budget_bytes=1 << 30)
    assert half.kv_bytes == kv_bytes_per_token(30, 3, 64, "float16") * 2048 * 2
    assert 2 * half.kv_bytes == full.kv_bytes == kv_bytes_per_token(30, 3, 64) * 2048 * 2
    assert half.row_bytes * 2 == full.row_bytes


def test_estimate_when_half_cache_then_the_budget_holds_twice_the_prefix_slots():
    half = {**MANIFEST, "variants": {"q4-a8": {**MANIFEST["variants"]["q4-a8"], "kv_dtype": "float16"}}}
    slot = kv_bytes_per_token(30, 3, 64) * 2048  # one fp32 slot
    e32 = estimate(MANIFEST, "q4-a8", context_length=2048, prefix_slots=4, prefix_budget_bytes=2 * slot)
    e16 = estimate(half, "q4-a8", context_length=2048, prefix_slots=4, prefix_budget_bytes=2 * slot)
    assert e16.row_bytes * 2 == e32.row_bytes
    assert e16.kv_bytes == e32.kv_bytes  # four half slots in the budget of two fp32 ones
