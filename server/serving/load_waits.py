"""The jobs that wait for their model to load, and that model's build beside the worker (serving/loader.py).
A model may also be asked for with no job waiting (`warm`): the server's start, a model a reply stands in for
(serving/ladder.py stand_in), Ollama's load request.

A job whose model is not loaded leaves the queue and waits here, so the worker goes on serving the models
that are loaded (running replies, and queued jobs behind it). Loads go one at a time, in the order their
first job came: the memory plan sees each load in progress before it plans the next (`pool.plan` counts it
as a busy model), and refuses a load that does not fit before it starts, as it did on the worker. When a
build is done the worker, between two passes, puts the engine in the pool and its jobs back at the head of
the queue (in their order); a build that failed fails its jobs with the error a load on the worker gave.

The worker thread calls `tend`; the others run on any thread, under the worker's lock, which this shares (as
serving/reply.py's Held does).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from models.errors import InsufficientMemory
from models.protocol import Engine, EngineLimits
from server.serving.contracts import Job
from server.serving.ladder import Target
from server.serving.loader import Loader
from server.serving.model_pool import ModelPool, Pending


class LoadWaits:
    def __init__(
        self,
        pool: ModelPool,
        lock: threading.Condition,
        *,
        load_limits: Callable[[Target], EngineLimits | None],
        fail: Callable[[Job, BaseException], None],
        busy: Callable[[], bool],
    ) -> None:
        self.pool = pool
        self._lock = lock
        self._load_limits = load_limits  # what a model loaded for a target opens with (placement's)
        self._fail = fail  # ends a job that never started with an error (placement's)
        self._busy = busy  # the worker runs or has queued jobs for loaded models (its lock held)
        self._waiting: dict[str, list[tuple[Job, Target]]] = {}  # by model, in the order they came
        self._warm: dict[str, Target] = {}  # models to load though no job waits for them (in _waiting too)
        self.failed: dict[str, BaseException] = {}  # each model's last failed load, until one succeeds
        self._building: Pending | None = None  # the load whose sessions the loader builds now
        self._ready: list[Job] = []  # jobs whose model is loaded now, for the head of the queue
        self._loader: Loader[Engine] = Loader(self._wake)

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # -- any thread, under the worker's lock ---------------------------------------------------------------
    def jobs(self) -> list[Job]:
        with self._lock:
            return [job for waiting in self._waiting.values() for job, _ in waiting]

    def remove(self, job: Job) -> bool:
        """Take `job` out (its client left, or routing serves it elsewhere). False when it does not wait."""
        with self._lock:
            for waiting in self._waiting.values():
                for i, (waiter, _) in enumerate(waiting):
                    if waiter is job:
                        del waiting[i]
                        return True
        return False

    def loading(self, model_id: str) -> bool:
        """`model_id` is being built, or waits for its build."""
        with self._lock:
            building = self._building is not None and self._building.entry.id == model_id
            return building or model_id in self._waiting

    def sooner(self, model_id: str, than: str) -> bool:
        """`model_id` will be loaded before `than`: it is being built, or waits ahead of it while `than` is
        not being built (a stand-in loaded at start, before the start model)."""
        with self._lock:
            building = self._building.entry.id if self._building is not None else None
            if building in (model_id, than):
                return building == model_id
            order = list(self._waiting)
            return model_id in order and (than not in order or order.index(model_id) < order.index(than))

    def warm(self, model_id: str, target: Target) -> None:
        """Load `model_id` though no job waits for it (any thread, the worker's lock held or not): after the
        loads asked for before it, unless it is loaded or on its way already. The worker's next `tend`
        starts it."""
        if self.pool.is_ready(model_id):
            return
        with self._lock:
            if model_id not in self._waiting:
                self._waiting[model_id] = []
                self._warm[model_id] = target
            self._lock.notify_all()

    def due(self) -> bool:
        """A load waits to start and none is being built (the idle worker's next `tend` starts it)."""
        with self._lock:
            return self._building is None and bool(self._waiting)

    def built(self) -> bool:
        """A build is done: the worker has an engine to put in the pool (or jobs to fail)."""
        return self._loader.has_done()

    def close(self) -> list[Job]:
        """No build starts any more; the jobs that waited, for the worker to fail."""
        self._loader.close()
        with self._lock:
            jobs = [job for waiting in self._waiting.values() for job, _ in waiting]
            self._waiting.clear()
            self._warm.clear()
        return jobs

    # -- the worker thread ---------------------------------------------------------------------------------
    def cold(self, job: Job, target: Target) -> str | None:
        """The model `job` must wait for (its id in the catalog), or None when it can start now: its model
        is loaded, or not installed at all (starting it fails it as before)."""
        entry = self.pool.catalog.get(target.model_id)
        if entry is None or self.pool.is_ready(entry.id):
            return None
        return entry.id

    def add(self, job: Job, model_id: str, target: Target) -> None:
        """`job` waits for `model_id` (any thread, the worker's lock held: the job leaves the queue and
        waits here in one step). Its load starts at the worker's next `tend`, unless it is under way."""
        with self._lock:
            self._waiting.setdefault(model_id, []).append((job, target))

    def tend(self) -> list[Job]:
        """Between two passes: a finished build goes into the pool, and its jobs are returned to go back to
        the head of the queue (a failed one fails them); then the next model's build starts."""
        ready, self._ready = self._ready, []
        for model_id, result in self._loader.take_done():
            pending, self._building = self._building, None
            assert pending is not None and pending.entry.id == model_id
            with self._lock:
                jobs = [job for job, _ in self._waiting.pop(model_id, [])]
                self._warm.pop(model_id, None)
            if isinstance(result, BaseException):
                self.pool.abandon(pending)
                self.failed[model_id] = result
                for job in jobs:
                    self._fail(job, result)
                continue
            self.failed.pop(model_id, None)
            # its keep_alive runs from now: every job that waited for it may have left meanwhile
            self.pool.install(pending, result, expires=True)
            ready += jobs
        if not ready:  # else the next build waits until they are in the queue (the busy rule below)
            self._next()
        ready += self._ready
        self._ready = []
        return ready

    # A load planned while the worker serves loaded models (rule table, first match):
    #   fits as it is                              -> built now, beside the worker
    #   needs rows capped or models unloaded, or
    #   does not fit at all, and the worker runs
    #   or has queued jobs for loaded models       -> waits (asked again between passes, until they are idle)
    #   otherwise                                  -> planned: room made, or refused (its jobs fail)
    # so a load never unloads the model that the jobs just put back at the head of the queue wait for, and
    # is refused only where the worker, loading it in its turn, refused it too.
    def _next(self) -> None:
        """Start the next model's build when none runs: the memory plan first, which may refuse it (its jobs
        fail with insufficient_memory, and nothing was unloaded) or make room (idle models unloaded)."""
        while self._building is None:
            with self._lock:
                for gone in [m for m, w in self._waiting.items() if not w and m not in self._warm]:
                    del self._waiting[gone]  # every job that waited for it left
                model_id = next(iter(self._waiting), None)
                if model_id is None:
                    return
                waiting = self._waiting[model_id]
                target = waiting[0][1] if waiting else self._warm[model_id]
                if self.pool.is_ready(model_id):  # loaded meanwhile (a handover loads on the worker)
                    self._ready += [job for job, _ in self._waiting.pop(model_id)]
                    self._warm.pop(model_id, None)
                    continue
            try:
                room = self.pool.preview(model_id, target.variant)
            except InsufficientMemory:
                room = None
            except Exception:
                room = None  # plan() below raises it again, for the jobs
            if room is None or room.evict or room.rows is not None:
                with self._lock:
                    if self._busy():
                        return  # its room comes from models in use now or soon: it waits until they are idle
            try:
                pending = self.pool.plan(model_id, target.variant, self._load_limits(target))
            except Exception as err:
                with self._lock:
                    jobs = [job for job, _ in self._waiting.pop(model_id, [])]
                    self._warm.pop(model_id, None)
                self.failed[model_id] = err
                for job in jobs:
                    self._fail(job, err)
                continue
            self._building = pending
            self._loader.start(model_id, functools.partial(self.pool.build, pending))
