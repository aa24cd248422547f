"""One thread owns the engines: it puts them in the model pool and takes them out, builds prompts and
generates, one
job at a time, or several replies of one model at once (in a batch, or taking turns); one client's jobs first
in first out, the next to join rotating over clients (turn_order.py). This module is the queue, its thread
and the idle work; the rest of what the worker does lives beside it:
- server/serving/contracts.py: the Job, its Sink and the protocols the worker is driven through (the Gate);
- server/serving/placement.py: which model a reply runs on, the limits its engine gets, handovers between
  models and memory relief;
- server/serving/batch_loop.py: the passes (one reply alone, or a batch);
- server/serving/reply.py: one started reply, which delivers, closes and fails itself;
- server/serving/load_waits.py: jobs whose model is not loaded wait there while its sessions are built
  beside the worker (serving/loader.py), and the worker goes on serving the loaded models.

The event loop never touches the engine. It submits a `Job` (cheap: no tokenizing, so a full queue is
rejected before any real work) and reads the job's events from an asyncio.Queue that the worker fills
through `loop.call_soon_threadsafe`. Events, in order:
  Started(prompt_tokens, truncated, summarized)  -> TokenEvent* -> FinishEvent
or Failed(error) at any point (prompt too long, engine error, shutdown). GovernorUpdate may come anywhere.

`worker.publish_governor(state)` (any thread) sends a JSON-able state to every open job; streams that asked
for it (`governor_events: true`) forward it as SSE `event: governor`. It also wakes an idle worker to look
at the governor's rung (`gate.rung`): once it moved below a loaded bigger model, that model is unloaded when
idle (placement.py), not at the end of its keep_alive.

While the queue is empty the worker runs `idle work` (add_idle_work): jobs that wait for an idle worker
(a summary written off the critical path); a submitted job cancels them between their steps.
A job's `account` (serving/accounting.py) hears what the engine did and, exactly once, that the worker is
done with the job: after generating, or when it leaves the queue unstarted (`withdraw`, `close`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from governor.limits import Rung
from models.protocol import Engine
from models.types import CancelToken
from server.refusals import ModelLoading, ServerBusy, ShuttingDown
from server.serving.batch_loop import BatchLoop
from server.serving.contracts import (
    Gate,
    IdleWork,
    Job,
    NoGate,
    Placer,
    StandIn,
    Window,
    WorkerMetrics,
    reply_tokens,
)
from server.serving.embedding import EmbedJob, EncoderShelf, EncoderView, PassGaps, gated_step
from server.serving.events import Failed, GovernorUpdate
from server.serving.ladder import Target
from server.serving.load_waits import LoadWaits
from server.serving.model_pool import ModelPool
from server.serving.placement import Placement, requested_model
from server.serving.reply import Desk, Held, Reply
from server.serving.session_builds import SessionBuilds
from server.serving.turn_order import next_turn

log = logging.getLogger("simmer.server")

# How long the worker waits, idle, after a reply before it drops the sessions a swap replaced: their
# teardown (85 ms for a 1.5B model's, and a full collection) holds the GIL, and the reply's last chunks and
# the next request's parsing need it first.
RETIRE_AFTER_S = 0.5

State = Literal["loading", "ready", "closed"]  # the queue: "loading" until start(), "ready" until close()
StartState = Literal["loading", "ready", "failed"]  # the model loaded at start


class Worker:
    """The queue and the thread that owns the engines. It takes jobs in order, hands each to its placement
    and its batch loop, and is what a batch draws its next replies from (batch_loop.Lineup)."""

    def __init__(
        self,
        pool: ModelPool,
        *,
        max_queue: int,
        gate: Gate | None = None,
        metrics: WorkerMetrics | None = None,
        place: Placer | None = None,
        preload: str | None = None,
        window: Window | None = None,
        ladder: Sequence[Rung] = (),
        max_batch: int = 1,
        encoder_threads: int = 1,
        encoder_variant: str | None = None,
        stand_in: StandIn | None = None,
        stand_in_at_start: Callable[[str], str | None] = lambda start: None,
        keep_warm: int | None = None,
    ) -> None:
        self.pool = pool
        self.max_batch = max(1, max_batch)  # replies of one model decoded together (batch_loop.py)
        self.max_queue = max_queue
        self.gate: Gate = gate or NoGate()
        self._preload = preload
        self.state: State = "loading"
        self.start_model: str | None = None  # the model loaded at start (placement.start_model)
        self._stand_in_at_start = stand_in_at_start
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._held = Held(self._cond)  # the jobs the worker runs now (several in a batch)
        # replies moved to another model mid-batch: they go on there once the batch they left is done
        self._moved: collections.deque[Reply] = collections.deque()
        # embedding jobs (server/serving/embedding.py), a batch per turn, alternating with generation jobs
        self._embeds: collections.deque[EmbedJob] = collections.deque()
        self._embeds_turn = False
        self._gaps = PassGaps()  # the running replies' passes, which size an embedding slice between them
        self._encoders = EncoderShelf(encoder_threads, pool.keep_alive_s, pool.clock, encoder_variant)
        pool.outside = self._open_encoder
        pool.close_outside = lambda model_id, reason: self._encoders.close(reason)
        self._idle_work: list[IdleWork] = []
        self._idle_due = True
        self._idle_cancel = CancelToken()
        # when the sessions a swap replaced may go (Engine.retire_sessions): once the worker is idle a moment
        # after a reply, so that the reply's last chunks are out before the teardown takes the GIL
        self._retire_at: float | None = None
        self.placement = Placement(
            pool,
            self.gate,
            Desk(self._held, pool, metrics, window),
            place=place or requested_model(preload),
            queued=self._queued,
            ladder=ladder,
            max_batch=self.max_batch,
        )
        self._loads = LoadWaits(
            pool,
            self._cond,
            load_limits=self.placement.load_limits,
            fail=self.placement.fail,
            busy=lambda: bool(self._queue) or bool(self._held) or bool(self._moved),
        )
        self.placement.waits_for_load = self._wait_for_load
        self.placement.stand_in = stand_in
        self.placement.keep_warm = keep_warm
        room = lambda engine, limits: self.pool.session_room(engine, limits)  # noqa: E731 (the pool's now)
        self.placement.builds = self._builds = SessionBuilds(self._wake, room)
        self.placement.warm = lambda target: self._loads.warm(target.model_id, target)
        self.placement.sooner = lambda model, target: self._loads.sooner(model, target.model_id)
        self._batches = BatchLoop(self.placement, self.gate, self)
        self._thread = threading.Thread(target=self._run, name="simmer-worker", daemon=True)

    # ---- event-loop side ------------------------------------------------------------------------

    def start(self) -> None:
        """Take jobs from now on; the models loaded at start are built beside the worker meanwhile (a job for
        one waits for it, or starts on a stand-in)."""
        with self._cond:
            if self.state == "loading":
                self.state = "ready"
        self._start_loads()
        self._thread.start()

    def start_load(self) -> tuple[StartState, BaseException | None]:
        """How the load of the model loaded at start went (any thread): loading, ready (or none asked, or
        unloaded since), or failed (with its error) until a later load of it succeeds."""
        model = self.start_model
        if model is None:
            return ("loading", None) if self.state == "loading" else ("ready", None)
        if self._loads.loading(model):
            return "loading", None
        error = self._loads.failed.get(model)
        return ("failed", error) if error is not None else ("ready", None)

    def encoder(self) -> EncoderView | None:
        """The embedding model open now, for /api/ps (any thread)."""
        return self._encoders.view()

    def _open_encoder(self) -> list[tuple[str, int, float, bool]]:
        view = self._encoders.view()
        return [] if view is None else [(view.model_id, view.bytes, view.last_used, view.busy)]

    def session_builds(self) -> dict[str, int | bool]:
        """Sessions new limits needed: built beside the worker, or inside a reply (any thread)."""
        return self._builds.counts()

    def warm(self, model_id: str) -> None:
        """Load `model_id` beside the worker though no job asks for it yet (Ollama's load request)."""
        self._loads.warm(model_id, Target(model_id, None, "asked to load"))

    def submit(self, job: Job) -> None:
        """Queue `job` or raise at once (loading, busy, closing). Never blocks on the engine."""
        with self._cond:
            self._admit()
            self._queue.append(job)
            self._idle_cancel.cancel()  # idle work yields to the job between its steps
            self._cond.notify()

    def submit_embedding(self, job: EmbedJob) -> None:
        """Queue an embedding job or raise at once, as submit() does."""
        with self._cond:
            self._admit()
            self._embeds.append(job)
            self._idle_cancel.cancel()
            self._cond.notify()

    def _admit(self) -> None:
        """Raise unless a new job may queue now (the worker's lock held)."""
        if self.state == "closed":
            raise ShuttingDown("The server is shutting down")
        if self.state == "loading":  # not started yet: nothing would take the job
            raise ModelLoading("The server is starting; retry shortly")
        if self._waiting() >= self.max_queue:
            raise ServerBusy(f"The server is busy ({self.max_queue} requests waiting); retry shortly")

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def add_idle_work(self, work: IdleWork) -> None:
        with self._cond:
            self._idle_work.append(work)
            self._idle_due = True
            self._cond.notify()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return self._waiting()

    def tokens_ahead(self) -> int:
        """Tokens still to generate before a job submitted now starts: an upper bound for routing's wait
        estimate (each reply runs to its max_tokens; one without counts UNBOUNDED_REPLY_TOKENS)."""
        with self._cond:
            queued = sum(reply_tokens(job) for job in self._waiters() if not job.cancel.cancelled)
            held = self._held.made()
        return queued + sum(max(0, reply_tokens(job) - done) for job, done in held)

    @property
    def busy(self) -> bool:
        return bool(self._held)

    def unload_when_idle(self, model_id: str) -> bool:
        """Ollama's unload request (keep_alive 0 without a prompt): the worker thread, which owns the
        models, unloads `model_id` as soon as no job uses it. False when it is not loaded."""
        if not self.pool.expire_now(model_id):
            return False
        with self._cond:
            self._cond.notify()
        return True

    def publish_governor(self, state: Mapping[str, Any]) -> None:
        with self._cond:
            jobs = list(self._queue) + self._held.jobs()
            self._cond.notify()  # an idle worker looks at the rung (placement.rung_moved)
        for job in jobs:
            job.sink(GovernorUpdate(dict(state)))

    def withdraw(self, job: Job) -> bool:
        """Take a job whose client left out of the queue at once (not when the worker reaches it), so its
        account closes now. False when the worker already has it: then the worker ends it."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                if not self._loads.remove(job):
                    return False
        job.worker_done()
        return True

    def take_back(self, job: Job) -> bool:
        """Routing takes a job that never started out of the queue, to serve it elsewhere: unlike
        withdraw(), the worker is not done with it for the account (the other side ends it). False when the
        worker already has it, or its client left."""
        with self._cond:
            if job.cancel.cancelled:
                return False
            if any(j is job for j in self._queue):
                self._queue.remove(job)
                return True
            return self._loads.remove(job)  # waiting for its model's load: not started either

    def close(self) -> None:
        """Stop taking work; fail every open job with server_shutting_down and cancel it. Any thread."""
        waited = self._loads.close()
        self._builds.close()
        with self._cond:
            self.state = "closed"
            queued = list(self._queue) + waited
            jobs = queued + self._held.jobs()
            embeds = list(self._embeds)
            self._queue.clear()
            self._embeds.clear()
            self._idle_cancel.cancel()
            self._cond.notify_all()
        for job in jobs:
            job.sink(Failed(ShuttingDown("The server is shutting down")))
            job.cancel.cancel()
        for job in queued:  # never started; the running one is ended by the worker thread
            job.worker_done()
        for embed in embeds:
            embed.sink(Failed(ShuttingDown("The server is shutting down")))
            embed.cancel.cancel()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- worker thread ------------------------------------------------------------------------

    def _waiters(self) -> list[Job]:
        """The queue's jobs and those waiting for their model's load (worker's lock held)."""
        return [*self._queue, *self._loads.jobs()]

    def _waiting(self) -> int:
        # Cancelled jobs still in the deque (client left while queued) do not hold a slot.
        waiting = sum(1 for job in self._waiters() if not job.cancel.cancelled)
        return waiting + sum(1 for job in self._embeds if not job.cancel.cancelled)

    def _retire_later(self) -> None:
        with self._cond:
            self._retire_at = self.pool.clock() + RETIRE_AFTER_S

    def _run(self) -> None:
        while True:
            self.between_passes()
            with self._cond:
                while not self._queue and not self._moved and not self._embeds and self.state != "closed":
                    if self._loads.built() or self._loads.due():
                        break
                    if self._idle_due and self._idle_work_runs():
                        break
                    if self.placement.rung_moved():
                        break
                    due = (self.pool.next_expiry(), self._encoders.next_expiry(), self._retire_at)
                    expiries = [t for t in due if t]
                    expiry = min(expiries) if expiries else None
                    timeout = None if expiry is None else max(0.0, expiry - self.pool.clock())
                    if timeout == 0.0:
                        break
                    self._cond.wait(timeout)
                if self.state == "closed":
                    moved = list(self._moved)
                    self._moved.clear()
                    break
                moved_reply = self._moved.popleft() if self._moved else None
                embed = None
                if moved_reply is None and self._embeds and (not self._queue or self._embeds_turn):
                    embed = self._embeds.popleft()
                self._embeds_turn = embed is None  # with both waiting, they take turns
                job = self._queue.popleft() if self._queue and moved_reply is None and embed is None else None
                if job is not None:
                    self._held.hold(job)
                if job is None and moved_reply is None and embed is None:
                    self._idle_cancel = CancelToken()
            if embed is not None:
                self._after_embed_step(embed, gated_step(embed, self._encoders, self.gate))
                continue
            self._gaps.clear()  # replies start: their passes, not the last ones', size the slices
            if moved_reply is not None:
                try:
                    self._batches.serve(moved_reply)
                finally:
                    with self._cond:
                        self._idle_due = True
                    self._retire_later()
                    self.placement.shed_above_rung()
                continue
            if job is None:
                if self._retire_at is not None and self._retire_at <= self.pool.clock():
                    self._retire_at = None
                    self.pool.retire_sessions()  # no reply runs: a replaced session's teardown stops none
                self.pool.expire()  # keep_alive: idle models past their time go, and free their memory
                self._encoders.expire()
                self.placement.shed_above_rung()
                self._run_idle_work()
                continue
            try:
                reply = self.placement.start(job)
                if reply is not None and self.max_batch > 1:
                    self._batches.serve(reply)
                elif reply is not None:  # one reply at a time (SIMMER_MAX_BATCH=1)
                    self._batches.generate_alone(reply)
            finally:
                with self._cond:
                    self._idle_due = True
                self._retire_later()
                self.placement.shed_above_rung()  # a reply that moved down left the bigger model idle
        for reply in moved:  # the server closes: replies waiting to go on on another model end here
            reply.job.sink(Failed(ShuttingDown("The server is shutting down")))
            reply.close()

    def _queued(self) -> list[Job]:
        """The queue's jobs whose client is still there (those waiting for a load too)."""
        with self._cond:
            return [job for job in self._waiters() if not job.cancel.cancelled]

    # ---- loads beside the worker (serving/load_waits.py) ------------------------------------------------
    def _start_loads(self) -> None:
        """The model loaded at start, built beside the worker; before it, a smaller model of the ladder to
        stand in for it (a fraction of its load time), so that a first request is answered at once. Called
        by start(), before the thread runs: /health sees the load from the first request on."""
        start = self.start_model = self.placement.start_model(self._preload)
        if start is None:
            return
        # a preload: it waits, as heavy background work does, on battery, hot or in the background
        first = self._stand_in_at_start(start) if self.gate.background.runs else None
        if first is not None:
            self._loads.warm(
                first, Target(first, self._rung_variant(first), f"stands in while {start} loads")
            )
        self._loads.warm(start, Target(start, self._rung_variant(start), "loaded at start"))
        log.info("loading %s beside the worker%s", start, f" (after {first}, its stand-in)" if first else "")

    def between_passes(self) -> None:
        """A built engine goes into the pool and its jobs to the head of the queue; queued jobs whose model
        is not loaded leave the queue to wait for it (its load starts): the others go on meanwhile."""
        with self._cond:
            for job in [job for job in self._queue if not job.cancel.cancelled]:
                cold = self._cold(job)
                if cold is not None:
                    self._queue.remove(job)
                    self._loads.add(job, *cold)
        self._tend_loads()

    def _tend_loads(self) -> None:
        ready = self._loads.tend()
        if ready:
            with self._cond:
                self._queue.extendleft(reversed(ready))  # they came before the jobs queued behind them

    def _cold(self, job: Job) -> tuple[str, Target] | None:
        """The model `job` waits for (and where it was placed), or None when it can start now."""
        target = self.placement.expected(job)
        model = self._loads.cold(job, target)
        return None if model is None else (model, target)

    def _rung_variant(self, model_id: str) -> str | None:
        """The variant of `model_id`'s first rung on the ladder (None: its own), so that the session a load
        builds is the one its first reply runs on."""
        return next((r.variant for r in self.placement.ladder if r.model_id == model_id), None)

    def _wait_for_load(self, job: Job, target: Target) -> bool:
        """A job starting on a model that is not loaded waits for it (True) instead of loading it on the
        worker thread (placement.start asks, once the gate gave the job its limits: the load opens with
        them)."""
        model = self._loads.cold(job, target)
        if model is None:
            return False
        with self._cond:
            if self.state == "closed":
                return False  # close() failed it while held: start() ends it
            self._held.let_go(id(job))  # it leaves the worker's hands and waits in one step
            self._loads.add(job, model, target)
        self._tend_loads()  # its load starts
        return True

    def _idle_work_runs(self) -> bool:
        """Idle work waits and the governor lets it run (a governor change wakes the worker to look)."""
        return any(w.pending() for w in self._idle_work) and self.gate.background.runs

    def deferred_work(self) -> list[str]:
        """What idle work waits for the governor's leave (on battery, hot, backgrounded), by name."""
        with self._cond:
            if self.gate.background.runs:
                return []
            return [w.name for w in self._idle_work if w.pending()]

    def _run_idle_work(self) -> None:
        cancel = self._idle_cancel
        if not self._idle_work_runs():
            return  # _idle_due stays: the governor's next change wakes the worker, which looks again
        self._idle_due = False
        for work in list(self._idle_work):
            if cancel.cancelled:
                return
            if not work.pending():
                continue
            try:
                work.run(self.pool, cancel)
            except Exception:
                log.exception("idle work failed")

    # ---- what a batch draws from (batch_loop.Lineup) --------------------------------------------------
    def next_for(self, engine: Engine) -> Reply | None:
        """The next reply for `engine`, started: a moved one, else the queue's next by client
        (turn_order.next_turn: the client with the fewest replies running first) when it runs there."""
        with self._cond:
            for reply in self._moved:
                if reply.engine is engine:
                    self._moved.remove(reply)
                    return reply
            if self._moved or self.gate.pauses_new:
                return None  # the moved replies go first; a paused governor holds new work
            for gone in [job for job in self._queue if job.cancel.cancelled]:
                self._queue.remove(gone)
                gone.worker_done()  # its client left while it was queued
            running = collections.Counter(job.client for job in self._held.jobs())
            turn = next_turn([job.client for job in self._queue], running)
            if turn is None:
                return None
            job = self._queue[turn]
            placement = self.placement
            if placement.placed(job, placement.governed, set()).model_id != engine.model_id:
                return None  # another model's turn comes after this batch
            del self._queue[turn]
            self._held.hold(job)  # close() fails it from here on
        return placement.start(job)

    def between_tokens(self) -> None:
        """Between two passes of running replies: a slice of the first embedding job waiting, sized to last
        about as long as one of their passes (embedding.PassGaps, rows_within). Not while the governor holds
        new work back, nor while the job's model is still opening beside the worker. The slice's time counts
        in the replies' pace (the CPU it takes is the budget's too) but not in their configuration's cost
        (gate.note_aside)."""
        self._gaps.note(time.monotonic())
        if not self._embeds:  # the common case, once a token: no median to take, no lock
            return
        budget = self._gaps.budget()
        with self._cond:
            job = (
                self._embeds[0] if self._embeds and budget is not None and not self.gate.pauses_new else None
            )
        if job is None or (not job.cancel.cancelled and not self._encoders.ready(job.model_id, job.path)):
            return
        with self._cond:
            if not self._embeds or self._embeds[0] is not job:
                return  # the server closed meanwhile
            self._embeds.popleft()
        wall, cpu = time.monotonic(), time.process_time()
        done = job.step(self._encoders, budget)
        self.gate.note_aside(time.monotonic() - wall, time.process_time() - cpu)
        self._after_embed_step(job, done)
        self._gaps.restart(time.monotonic())

    def _after_embed_step(self, job: EmbedJob, done: bool) -> None:
        if done:
            self._encoders.done(job.keep_alive_s)
            return
        with self._cond:
            if self.state == "closed":
                job.sink(Failed(ShuttingDown("The server is shutting down")))
            else:
                self._embeds.append(job)  # its next step after what waits now

    def move(self, reply: Reply) -> None:
        """The reply goes on on another model once the running batch is done."""
        with self._cond:
            self._moved.append(reply)
