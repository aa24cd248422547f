"""What is loaded now: load on demand, unload least-recently-used idle ones to make room, keep_alive (what
can be loaded is serving/catalog.py's; which model a job runs on, serving/model_choice.py's).

Only the worker thread plans loads, puts engines in the pool and unloads (one thread owns every engine);
the sessions of a load may be built beside it (`build`, on serving/loader.py's thread). The views (`loaded`,
`last_served`) are read by the routes from the event loop, under a lock. Before a load the memory planner
(serving/memory_plan.py) decides what must go: batch rows first (`rows_cap`: every model serves batches of
fewer replies), then idle models; a refusal unloads nothing and raises insufficient_memory.

keep_alive, as Ollama has it: after each request the model stays loaded for that request's keep_alive
(SIMMER_KEEP_ALIVE_S when it gives none), 0 unloads it at once, infinity keeps it. Unloading drops the
engine, its sessions and KV buffers, and hands the freed heap back to the OS.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from models.errors import ModelNotFound
from models.protocol import Engine, EngineLimits
from models.runtime.engine import DecoderEngine, release_freed_memory
from server.serving.catalog import Catalog, CatalogEntry
from server.serving.keep_alive import describe as describe_keep_alive
from server.serving.memory_plan import Estimate, LoadPlan, MemoryBudget, Resident, mib, plan_load

log = logging.getLogger("simmer.pool")

# (entry, variant, the limits it will run with first: its sessions are built for them, not built twice)
Opener = Callable[[CatalogEntry, str | None, EngineLimits | None], Engine]
Cost = Callable[[CatalogEntry, str | None], Estimate]


@dataclass
class _Loaded:
    entry: CatalogEntry
    engine: Engine
    last_used: float
    expires_at: float = math.inf
    users: int = 0  # replies (and idle work) using it now: a batch of replies acquires it once each

    @property
    def busy(self) -> bool:
        return self.users > 0


@dataclass(frozen=True)
class Pending:
    """A load planned (its room made) and not yet in the pool: the planner counts it as a busy model."""

    entry: CatalogEntry
    variant: str | None
    limits: EngineLimits | None
    need_bytes: int
    free_bytes: int | None
    t0: float


@dataclass(frozen=True)
class LoadedView:
    model_id: str
    variant: str
    bytes: int  # the planner's estimate
    expires_in_s: float | None  # None: kept until the server stops
    busy: bool = False  # serving a reply now
    threads: int = 0  # the threads its session runs on now


@dataclass
class ModelPool:
    catalog: Catalog
    opener: Opener
    cost: Cost
    budget: MemoryBudget = field(default_factory=lambda: MemoryBudget(None, 0))
    keep_alive_s: float = 300.0  # the default (SIMMER_KEEP_ALIVE_S; math.inf: keep)
    pinned: bool = False  # one engine handed over ready: unloading frees its sessions, the object stays
    clock: Callable[[], float] = time.monotonic
    # wraps every load of a model (the governor's loading(model_id): the pace controller credits none of
    # its CPU, and its heat is measured), and, with None, every session a loaded engine builds afterwards
    # (a thread or variant change: a load's CPU too, but not the heat of loading that model)
    loading: Callable[[str | None], contextlib.AbstractContextManager[None]] = lambda _: (
        contextlib.nullcontext()
    )
    # hears which models are loaded after every load and unload (the governor's rung counts on them: a
    # rung whose model must load waits for room on a hot device, governor/limits.py choose_rung)
    on_loaded: Callable[[frozenset[str]], object] = lambda models: None
    # models open outside the pool, (id, bytes, last used, busy), whose memory the plan counts (the worker's
    # encoder), and what closes one the plan unloads to make room (worker thread)
    outside: Callable[[], list[tuple[str, int, float, bool]]] = lambda: []
    close_outside: Callable[[str, str], None] = lambda model_id, reason: None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[str, _Loaded] = {}
        self._current: Engine | None = None
        self._kept: dict[str, Engine] = {}  # pinned engines, loaded or not
        # A delete and a load of one model exclude each other: a model's files deleted while its session
        # was built failed that load with a 500 ("External data path validation failed").
        self._opening: set[str] = set()  # models being loaded now
        self._pending: dict[str, Pending] = {}  # loads planned, not yet installed (maybe built beside)
        self._deleting: set[str] = set()  # models whose files are being deleted now
        self.loads = 0
        self.unloads = 0
        # replies a batch may hold (None: as configured); the planner lowers it before it unloads a model,
        # the worker under memory pressure too (Worker._relieve_memory), and raises it again
        self.rows_cap: int | None = None

    # -- views (any thread) -----------------------------------------------------------------------------
    def last_served(self) -> LoadedView | None:
        """The model that served last (or loaded at start), while it is loaded: a view of the device for
        /health, /v1/thermal and the governor's metric, never how a request picks its model."""
        now = self.clock()
        with self._lock:
            engine = self._current
            item = next((i for i in self._loaded.values() if i.engine is engine), None)
            if engine is not None and item is None and self.pinned:  # unloaded sessions, the object kept
                return LoadedView(engine.model_id, engine.variant, 0, None, False, engine.threads)
            return self._view(item, now) if item is not None else None

    def loaded(self) -> dict[str, LoadedView]:
        now = self.clock()
        with self._lock:
            return {mid: self._view(item, now) for mid, item in self._loaded.items()}

    def _view(self, item: _Loaded, now: float) -> LoadedView:
        return LoadedView(
            item.engine.model_id,
            item.engine.variant,
            self._estimate(item.entry, item.engine.variant).total,
            None if item.expires_at == math.inf else max(0.0, item.expires_at - now),
            item.busy,
            item.engine.threads,
        )

    def engine(self, model_id: str) -> Engine | None:
        with self._lock:
            item = self._loaded.get(model_id)
            return item.engine if item else None

    def kept(self, model_id: str) -> Engine | None:
        """A pinned engine (handed over ready), loaded or not: unloading freed its sessions, not its
        tokenizer."""
        with self._lock:
            return next((e for e in self._kept.values() if e.model_id == model_id), None)

    @contextlib.contextmanager
    def deleting(self, model_id: str) -> Iterator[str | None]:
        """Around the deletion of `model_id`'s files: yields None while no load of it may start, or why it
        cannot be deleted now (it is loaded, or being loaded)."""
        with self._lock:
            if model_id in self._loaded:
                why = "loaded"
            elif model_id in self._opening or model_id in self._deleting:
                why = "loading" if model_id in self._opening else "being deleted"
            else:
                why = None
                self._deleting.add(model_id)
        try:
            yield why
        finally:
            if why is None:
                with self._lock:
                    self._deleting.discard(model_id)

    # -- the worker thread ------------------------------------------------------------------------------
    def acquire(
        self, model_id: str, variant: str | None = None, limits: EngineLimits | None = None
    ) -> Engine:
        """The loaded engine of `model_id` (loading it first, maybe unloading idle ones), marked busy.
        `limits`: what a load opens it with (the governor's, on the worker's rung for this job)."""
        entry = self.catalog.get(model_id)
        if entry is None:
            raise ModelNotFound(f"The model '{model_id}' is not installed", param="model")
        with self._lock:
            item = self._loaded.get(entry.id)
        if item is None:
            item = self._load(entry, variant, limits)
        item.users += 1
        item.last_used = self.clock()
        item.expires_at = math.inf  # not while it serves
        self._current = item.engine
        return item.engine

    @contextlib.contextmanager
    def borrow(self, model_id: str) -> Iterator[Engine | None]:
        """Idle work's use of a loaded model (a summary), or None when `model_id` is not loaded: idle work
        never loads one (a load cannot be interrupted, so a request arriving meanwhile would wait for all of
        it; serving/summary.py). Marked busy while borrowed, but it is not "the engine that ran last" and
        keeps the keep_alive a request gave it."""
        with self._lock:
            item = self._loaded.get(model_id)
        if item is None:
            yield None
            return
        expires_at = item.expires_at
        item.users += 1
        try:
            yield item.engine
        finally:
            item.users -= 1
            item.expires_at = expires_at

    def release(self, model_id: str, keep_alive_s: float | None = None) -> None:
        """The request is done with it (`model_id`: the engine's own id): once no other reply uses it, keep
        it loaded for keep_alive (0: unload now)."""
        with self._lock:
            item = self._loaded.get(model_id)
        if item is None:
            return
        keep = self.keep_alive_s if keep_alive_s is None else keep_alive_s
        item.users = max(0, item.users - 1)
        item.last_used = self.clock()
        if item.busy:  # other replies of a batch still run on it
            return
        if keep <= 0:
            self.unload(model_id, "keep_alive 0: unloaded after the reply")
            return
        item.expires_at = item.last_used + keep if keep != math.inf else math.inf

    def next_expiry(self) -> float | None:
        with self._lock:
            times = [i.expires_at for i in self._loaded.values() if not i.busy and i.expires_at != math.inf]
        return min(times) if times else None

    def expire_now(self, model_id: str) -> bool:
        """Make `model_id` due for unloading (any thread; the worker's next expire() unloads it once it is
        idle). False when it is not loaded."""
        with self._lock:
            item = self._loaded.get(model_id)
            if item is None:
                return False
            item.expires_at = self.clock()
            return True

    def retire_sessions(self) -> None:
        """Idle models drop the sessions they kept past a swap (Engine.retire_sessions): worker thread,
        between replies (a busy model's reply would wait for the teardown)."""
        with self._lock:
            idle = [i.engine for i in self._loaded.values() if not i.busy]
        for engine in idle:
            if engine.retire_sessions():
                log.info("%s: dropped the session a swap replaced", engine.model_id)

    def expire(self) -> None:
        """Unload every idle model past its keep_alive."""
        now = self.clock()
        with self._lock:
            due = [m for m, i in self._loaded.items() if not i.busy and i.expires_at <= now]
        for model_id in due:
            self.unload(model_id, "idle past its keep_alive")

    def unload(self, model_id: str, reason: str) -> bool:
        with self._lock:
            item = self._loaded.pop(model_id, None)
            if item is not None and self._current is item.engine and not self.pinned:
                self._current = None
        if item is None:
            if any(m == model_id for m, *_ in self.outside()):
                self.close_outside(model_id, reason)
                return True
            return False
        item.engine.unload()  # sessions and KV buffers
        self.unloads += 1
        del item
        release_freed_memory()
        log.info("unloaded %s: %s", model_id, reason)
        self.on_loaded(self.loaded_ids())
        return True

    def loaded_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._loaded)

    def unload_all(self) -> None:
        with self._lock:
            ids = list(self._loaded)
        for model_id in ids:
            self.unload(model_id, "server stopping")

    # -- batch rows: what the planner gives up before a model ------------------------------------------
    def _estimate(self, entry: CatalogEntry, variant: str | None) -> Estimate:
        return self.cost(entry, variant).with_rows(self.rows_cap)

    def _residents(self) -> list[Resident]:
        with self._lock:
            items = list(self._loaded.items())
            pending = list(self._pending.values())
        out = []
        for m, i in items:
            est = self._estimate(i.entry, i.engine.variant)
            out.append(Resident(m, est.total, i.last_used, i.busy, est.rows, est.row_bytes))
        # a load in progress holds its memory (or soon will): never unloaded to make room, counted in full
        out += [Resident(p.entry.id, p.need_bytes, self.clock(), True) for p in pending]
        # models outside the pool (the worker's open encoder): counted; an idle one may be closed for room
        out += [Resident(m, size, used, busy) for m, size, used, busy in self.outside()]
        return out

    def cap_rows(self, rows: int | None, reason: str) -> None:
        """Batches of at most `rows` replies from now (None: as configured). An idle model's batch decoder
        holding more rows goes now (rebuilt at its next batch); a busy one's running batch keeps its rows
        until it ends (its new replies wait in the queue beyond `rows`)."""
        if rows == self.rows_cap:
            return
        log.info(
            "batch rows: %s -> %s (%s)", self.rows_cap or "as configured", rows or "as configured", reason
        )
        self.rows_cap = rows
        if rows is None:
            return
        with self._lock:
            idle = [i.engine for i in self._loaded.values() if not i.busy]
        for engine in idle:
            engine.shrink_batch(rows)

    def rows_fit(self, rows: int | None) -> bool:
        """Whether the loaded models serving batches of `rows` (None: as configured) stay within the budget
        (what raising rows_cap to it would add, against what is free now)."""
        residents = self._residents()
        with self._lock:
            entries = [(i.entry, i.engine.variant) for i in self._loaded.values()]
        more = sum(self.cost(e, v).with_rows(rows).total - self._estimate(e, v).total for e, v in entries)
        free = self.budget.free(sum(r.bytes for r in residents))
        return free is None or more <= free

    # -- a load: planned and installed on the worker, built on it or beside it (serving/loader.py) -------
    def is_ready(self, model_id: str) -> bool:
        """Whether acquire(model_id) builds nothing (loaded, or a pinned engine kept): False for a model
        that must load, or that is not installed (plan() says which)."""
        entry = self.catalog.get(model_id)
        if entry is None:
            return False
        with self._lock:
            return entry.id in self._loaded or entry.id in self._kept

    def spare(self, headroom_bytes: int) -> bool:
        """Whether the budget keeps `headroom_bytes` free with every loaded model in it (False when it is
        unknown: what is spare cannot be said)."""
        free = self.budget.free(sum(r.bytes for r in self._residents()))
        return free is not None and free >= headroom_bytes

    def session_room(self, engine: Engine, limits: EngineLimits) -> bool:
        """Whether memory holds another session of `engine` (for `limits`' variant) beside the one it runs:
        its weights once more, packed (True when the budget is unknown, as the planner has it)."""
        entry = self.catalog.get(engine.model_id)
        if entry is None:
            return False
        residents = self._residents()
        free = self.budget.free(sum(r.bytes for r in residents))
        need = self.cost(entry, limits.variant or engine.variant).weights_bytes
        return free is None or need <= free

    def preview(self, model_id: str, variant: str | None) -> LoadPlan:
        """What a load of `model_id` would do now (rows capped, models unloaded), doing none of it. Raises
        ModelNotFound or InsufficientMemory, as plan() would."""
        entry = self.catalog.get(model_id)
        if entry is None:
            raise ModelNotFound(f"The model '{model_id}' is not installed", param="model")
        need = self._estimate(entry, variant or entry.default_variant)
        residents = self._residents()
        free = self.budget.free(sum(r.bytes for r in residents))
        return plan_load(entry.id, need, free, residents, budget=self.budget.describe())

    def plan(self, model_id: str, variant: str | None, limits: EngineLimits | None) -> Pending:
        """Room for a load of `model_id` (batch rows capped, idle models unloaded) and the load marked in
        progress: the planner counts it from now on, as a busy model, until install() or abandon(). Raises
        ModelNotFound or InsufficientMemory (then nothing was unloaded)."""
        entry = self.catalog.get(model_id)
        if entry is None:
            raise ModelNotFound(f"The model '{model_id}' is not installed", param="model")
        model_id = entry.id
        self.retire_sessions()  # the plan counts one session a model: extras kept past a swap go first
        need = self._estimate(entry, variant or entry.default_variant)
        residents = self._residents()
        free = self.budget.free(sum(r.bytes for r in residents))
        plan = plan_load(model_id, need, free, residents, budget=self.budget.describe())
        if plan.rows is not None:
            self.cap_rows(plan.rows, f"room for {model_id}")
        for victim in plan.evict:
            self.unload(victim, f"least recently used: room for {model_id}")
        with self._lock:
            if model_id not in self._kept:
                if model_id in self._deleting:
                    raise ModelNotFound(f"The model '{model_id}' is being deleted", param="model")
                self._opening.add(model_id)
            pending = Pending(entry, variant, limits, plan.need_bytes, plan.free_bytes, time.perf_counter())
            self._pending[model_id] = pending
        return pending

    def build(self, pending: Pending) -> Engine:
        """The engine of a planned load: its sessions built (any thread: the worker's, or the loader's)."""
        model_id = pending.entry.id
        engine = self._kept.get(model_id)
        if engine is not None:
            return engine
        with self.loading(model_id):
            return self.opener(pending.entry, pending.variant, pending.limits)

    def abandon(self, pending: Pending) -> None:
        """A planned load that failed: no longer counted, the model may be deleted again."""
        with self._lock:
            self._opening.discard(pending.entry.id)
            self._pending.pop(pending.entry.id, None)

    def install(self, pending: Pending, engine: Engine, *, expires: bool = False) -> _Loaded:
        """The built engine into the pool (worker thread). `expires`: its keep_alive runs from now, for an
        engine built beside the worker whose waiting jobs may all have left meanwhile."""
        self.abandon(pending)
        model_id = pending.entry.id
        if isinstance(engine, DecoderEngine):
            engine.building = lambda: self.loading(None)
        if self.pinned:
            self._kept[model_id] = engine
        entry = (
            self.catalog.get(engine.model_id) or pending.entry
        )  # a factory's engine names itself once loaded
        item = _Loaded(entry, engine, self.clock())
        if expires and self.keep_alive_s != math.inf:
            item.expires_at = item.last_used + self.keep_alive_s
        with self._lock:
            self._loaded[engine.model_id] = item
            if self._current is None:  # the device's view before any request: what loaded (at start)
                self._current = engine
        self.loads += 1
        self.on_loaded(self.loaded_ids())
        log.info(
            "loaded %s/%s in %.2f s: ~%s of %s free (%s); keep_alive %s",
            model_id,
            engine.variant,
            time.perf_counter() - pending.t0,
            mib(pending.need_bytes),
            mib(pending.free_bytes),
            self.budget.describe(),
            describe_keep_alive(self.keep_alive_s),
        )
        return item

    def _load(self, entry: CatalogEntry, variant: str | None, limits: EngineLimits | None) -> _Loaded:
        pending = self.plan(entry.id, variant, limits)
        try:
            engine = self.build(pending)
        except BaseException:
            self.abandon(pending)
            raise
        return self.install(pending, engine)
