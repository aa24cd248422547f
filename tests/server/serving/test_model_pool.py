"""The model pool on a fake clock, fake budgets and scripted engines (through the Engine seam): load on
demand, LRU unloading to make room, refusals that unload nothing, keep_alive 0 / duration / forever."""

from __future__ import annotations

import math

import pytest

from models.errors import InsufficientMemory, ModelNotFound
from server.serving.catalog import CatalogEntry
from server.serving.memory_plan import Estimate, MemoryBudget
from server.serving.model_pool import ModelPool
from tests.server.fakes import ScriptedEngine

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Catalog:
    def __init__(self, sizes: dict[str, int]) -> None:
        self.entries_ = {m: CatalogEntry(m, None, {"size": s}, True, "k") for m, s in sizes.items()}

    def entries(self) -> list[CatalogEntry]:
        return list(self.entries_.values())

    def get(self, model_id: str) -> CatalogEntry | None:
        return self.entries_.get(model_id)

    def refresh(self) -> None:
        return None


class Unloads(ScriptedEngine):
    def __init__(self, model_id: str, log: list[str]) -> None:
        super().__init__(model_id=model_id)
        self.log = log

    def unload(self) -> None:
        self.log.append(self.model_id)
        super().unload()


def pool(budget_mib: int | None = 300, keep_alive_s: float = 300.0, **sizes_mib: int):
    clock = Clock()
    unloaded: list[str] = []
    opened: list[str] = []

    def opener(entry: CatalogEntry, variant: str | None, limits=None):
        opened.append(entry.id)
        return Unloads(entry.id, unloaded)

    p = ModelPool(
        Catalog({m: s * MiB for m, s in (sizes_mib or {"a": 100, "b": 100, "c": 100}).items()}),
        opener,
        lambda entry, variant: Estimate(entry.manifest["size"], 0, 0, 0),
        MemoryBudget(None if budget_mib is None else budget_mib * MiB, 0),
        keep_alive_s=keep_alive_s,
        clock=clock,
    )
    return p, clock, opened, unloaded


def test_acquire_when_loaded_then_same_engine_without_loading_again():
    p, _, opened, _ = pool()
    first = p.acquire("a")
    p.release("a")
    assert p.acquire("a") is first and opened == ["a"]
    last = p.last_served()
    assert last is not None and last.model_id == "a" and last.busy


def test_acquire_when_unknown_model_then_model_not_found():
    p, *_ = pool()
    with pytest.raises(ModelNotFound):
        p.acquire("zzz")


def test_acquire_when_budget_full_then_least_recently_used_idle_model_unloaded():
    p, clock, _, unloaded = pool(budget_mib=250)
    for model in ("a", "b", "a"):  # a is the most recently used
        clock.now += 1
        p.acquire(model)
        p.release(model)
    p.acquire("c")
    assert unloaded == ["b"] and set(p.loaded()) == {"a", "c"}


def test_acquire_when_only_a_busy_model_holds_the_memory_then_refused_and_it_keeps_serving():
    p, _, _, unloaded = pool(budget_mib=250, a=200, b=100)
    p.acquire("a")  # serving
    with pytest.raises(InsufficientMemory) as err:
        p.acquire("b")
    assert "in use: a ~200 MiB" in err.value.message and "Nothing was unloaded" in err.value.message
    assert unloaded == [] and set(p.loaded()) == {"a"}


@pytest.fixture
def big_pool():
    return pool(budget_mib=250, a=100, b=100, big=300)


def test_acquire_when_a_model_needs_more_than_the_idle_ones_free_then_refuse_and_keep_them(big_pool):
    p, _, _, unloaded = big_pool
    p.acquire("a")
    p.release("a")
    with pytest.raises(InsufficientMemory) as err:
        p.acquire("big")
    assert err.value.numbers == {"needed_bytes": 300 * MiB, "free_bytes": 150 * MiB, "idle_bytes": 100 * MiB}
    assert unloaded == [] and set(p.loaded()) == {"a"}


def test_release_when_keep_alive_zero_then_unloaded_after_the_reply():
    p, _, _, unloaded = pool()
    p.acquire("a")
    p.release("a", 0.0)
    assert unloaded == ["a"] and p.loaded() == {} and p.last_served() is None


def test_release_when_duration_then_unloaded_once_it_passed():
    p, clock, _, unloaded = pool()
    p.acquire("a")
    p.release("a", 10.0)
    assert p.next_expiry() == clock.now + 10 and p.loaded()["a"].expires_in_s == 10.0
    clock.now += 9.9
    p.expire()
    assert unloaded == []
    clock.now += 0.1
    p.expire()
    assert unloaded == ["a"] and p.next_expiry() is None


def test_release_when_forever_then_never_expires():
    p, clock, _, unloaded = pool()
    p.acquire("a")
    p.release("a", math.inf)
    clock.now += 10**9
    p.expire()
    assert unloaded == [] and p.next_expiry() is None and p.loaded()["a"].expires_in_s is None


def test_release_when_no_keep_alive_given_then_the_default():
    p, clock, _, _ = pool(keep_alive_s=42.0)
    p.acquire("a")
    p.release("a")
    assert p.next_expiry() == clock.now + 42.0


def test_acquire_when_serving_then_not_expired_meanwhile():
    p, clock, _, unloaded = pool(keep_alive_s=1.0)
    p.acquire("a")
    p.release("a")
    p.acquire("a")  # a new request: busy again
    clock.now += 100
    p.expire()
    assert unloaded == []


def test_borrow_when_idle_work_uses_a_model_then_keep_alive_and_current_unchanged():
    """Idle work (a summary) borrows a loaded model: the request's keep_alive stays, and it is not "the engine
    that ran last". A model that is not loaded is not loaded for it (None): a load cannot be interrupted."""
    p, _, opened, _ = pool(budget_mib=300)
    p.acquire("a")
    p.release("a", keep_alive_s=math.inf)  # a request asked to keep it
    with p.borrow("a") as engine:
        assert engine is not None and engine.model_id == "a" and p.next_expiry() is None
        assert p.loaded()["a"].busy
    assert p.loaded()["a"].expires_in_s is None and not p.loaded()["a"].busy  # still kept, idle
    with p.borrow("b") as engine:  # fits, but not loaded: not loaded for idle work
        assert engine is None
    assert opened == ["a"] and set(p.loaded()) == {"a"}
    last = p.last_served()  # borrowing is not serving
    assert last is not None and last.model_id == "a"


# -- batch rows before models --------------------------------------------------------------------------------
class Batched(Unloads):
    """A scripted engine with a batch decoder's rows (the pool drops them through shrink_batch)."""

    def __init__(self, model_id: str, log: list[str], shrunk: list[tuple[str, int]]) -> None:
        super().__init__(model_id, log)
        self.shrunk = shrunk

    def shrink_batch(self, slots: int) -> bool:
        self.shrunk.append((self.model_id, slots))
        return True


def batched_pool(budget_mib: int, weights_mib: dict[str, int], available_mib: list[int] | None = None):
    """Models of weights_mib with batches of 4 rows of 10 MiB each (the real estimate's shape); an explicit
    budget, or (available_mib) a fake memory reading."""
    from governor.sensors import MemoryReading

    unloaded: list[str] = []
    shrunk: list[tuple[str, int]] = []

    def opener(entry: CatalogEntry, variant: str | None, limits=None):
        return Batched(entry.id, unloaded, shrunk)

    def cost(entry: CatalogEntry, variant: str | None) -> Estimate:
        return Estimate(entry.manifest["size"], 40 * MiB, 0, 0, rows=4, row_bytes=10 * MiB)

    def read() -> MemoryReading:
        assert available_mib is not None
        return MemoryReading(
            limit_bytes=4096 * MiB, used_bytes=0, available_bytes=available_mib[0] * MiB, source="fake"
        )

    budget = MemoryBudget(budget_mib * MiB, 0) if available_mib is None else MemoryBudget(None, 0, read)
    p = ModelPool(Catalog({m: s * MiB for m, s in weights_mib.items()}), opener, cost, budget, clock=Clock())
    return p, unloaded, shrunk


def test_load_when_short_then_every_model_serves_fewer_rows_before_one_is_unloaded():
    p, unloaded, shrunk = batched_pool(300, {"a": 100, "b": 120, "c": 150})
    p.acquire("a")
    p.release("a")
    assert p.rows_cap is None
    p.acquire("b")  # 140 + 160 = 300 fits
    p.release("b")
    p.acquire("c")  # 190 more, none free: one reply at a time frees 80 of a and b and needs 150
    assert (p.rows_cap, unloaded) == (1, ["a"])  # then the LRU model goes: 120 + 150 <= 300
    assert ("b", 1) in shrunk
    assert {m: v.bytes for m, v in p.loaded().items()} == {"b": 120 * MiB, "c": 150 * MiB}


def test_load_when_fewer_rows_make_room_then_no_model_unloaded_and_idle_rows_dropped():
    p, unloaded, shrunk = batched_pool(330, {"a": 100, "b": 150})
    p.acquire("a")
    p.release("a")
    p.acquire("b")  # 140 + 190 = 330: fits
    p.release("b")
    p, unloaded, shrunk = batched_pool(300, {"a": 100, "b": 150})
    p.acquire("a")
    p.release("a")
    p.acquire("b")  # at three rows: 130 + 180 = 310 > 300; at two: 120 + 170 = 290
    assert (p.rows_cap, unloaded, shrunk) == (2, [], [("a", 2)])


def test_rows_fit_when_memory_comes_back_then_the_rows_may_come_back():
    available = [200]
    p, _, _ = batched_pool(0, {"a": 100}, available_mib=available)
    p.acquire("a")
    available[0] = 30
    p.cap_rows(1, "memory pressure")
    assert p.loaded()["a"].bytes == 100 * MiB
    assert not p.rows_fit(None)  # four rows more: 40 MiB, and 30 are free now
    available[0] = 40
    assert p.rows_fit(None) and p.rows_fit(2)


def test_deleting_when_the_model_loads_then_refused_and_no_load_starts_while_its_files_go():
    """A delete and a load of one model exclude each other: deleted files under a session being built
    failed that load with a 500. While it loads, the delete is told "loading" (the route's 409); while it
    is deleted, a load is refused (ModelNotFound); once loaded, "loaded"."""
    import threading

    started, go = threading.Event(), threading.Event()
    clock = Clock()

    def opener(entry: CatalogEntry, variant: str | None, limits=None):
        started.set()
        assert go.wait(10)
        return ScriptedEngine(model_id=entry.id)

    p = ModelPool(
        Catalog({"a": 100 * MiB, "b": 100 * MiB}),
        opener,
        lambda entry, variant: Estimate(entry.manifest["size"], 0, 0, 0),
        MemoryBudget(None, 0),
        clock=clock,
    )
    loader = threading.Thread(target=p.acquire, args=("a",))
    loader.start()
    assert started.wait(10)
    with p.deleting("a") as busy:
        assert busy == "loading"
    go.set()
    loader.join(10)
    with p.deleting("a") as busy:
        assert busy == "loaded"
    with p.deleting("b") as busy:
        assert busy is None
        with pytest.raises(ModelNotFound, match="being deleted"):
            p.acquire("b")
        with p.deleting("b") as again:
            assert again == "being deleted"
    assert p.acquire("b").model_id == "b"  # the delete is over: it loads again


# -- a load built beside the worker: planned first, counted while it is built ----------------------------
def test_plan_when_a_load_is_being_built_then_it_counts_and_is_never_unloaded_for_the_next():
    p, _, opened, unloaded = pool(budget_mib=250, a=200, b=100)
    building = p.plan("a", None, None)  # its sessions built beside the worker: not in the pool yet
    assert opened == [] and set(p.loaded()) == set()
    with pytest.raises(InsufficientMemory) as err:
        p.plan("b", None, None)
    assert "in use: a ~200 MiB" in err.value.message and unloaded == []
    engine = p.build(building)
    p.install(building, engine, expires=True)
    assert opened == ["a"] and p.engine("a") is engine
    assert p.loaded()["a"].expires_in_s == 300.0  # its waiting jobs may all have left: keep_alive runs
    p.plan("b", None, None)  # a is idle: unloaded to make room, as before
    assert unloaded == ["a"]


def test_abandon_when_a_build_failed_then_not_counted_and_deletable():
    p, _, _, _ = pool(budget_mib=250, a=200, b=100)
    failed = p.plan("a", None, None)
    with p.deleting("a") as why:
        assert why == "loading"
    p.abandon(failed)
    p.plan("b", None, None)  # the room a's load held is free again
    with p.deleting("a") as why:
        assert why is None
