"""One thread owns the engines: it loads them (through the model pool), builds prompts and generates, one
job at a time, FIFO.

The event loop never touches the engine. It submits a `Job` (cheap: no tokenizing, so a full queue is
rejected before any real work) and reads the job's events from an asyncio.Queue that the worker fills
through `loop.call_soon_threadsafe`. Events, in order:
  Started(prompt_tokens, truncated, summarized)  -> TokenEvent* -> FinishEvent
or Failed(error) at any point (prompt too long, engine error, shutdown). GovernorState may come anywhere.

The governor seam (kept small on purpose), both called on the worker thread:
- `gate.before_job(cancel, enqueued_at) -> EngineLimits | None` runs before a job starts. It may hold new
  work while the governor pauses it (bounded: it raises once the job has waited too long) and returns new
  limits or None for "unchanged".
- `gate.before_step(cancel) -> EngineLimits | None` runs between every token / prefill chunk (as the
  engine's step hook). It may idle (device throttling), block while the running reply is paused (the
  job's CancelToken interrupts that wait when the client leaves), raise (device killed), and returns new
  limits or None.
- a batch asks two more (Gate): `gate.pauses_new` (new work waits: no reply joins the running ones) and
  `gate.note_pass(tokens)` (what each pass made, for the gate's meter and pace).
- `worker.publish_governor(state)` (any thread) sends a JSON-able state to every open job; streams that
  asked for it (`governor_events: true`) forward it as SSE `event: governor`. It also wakes an idle worker
  to look at the governor's rung (`gate.rung`): once it moved below a loaded bigger model, that model is
  unloaded when idle (`shed_above`, server/serving/ladder.py), not at the end of its keep_alive.

Which model a job runs on is placed per job and again at every changed limit (`place`, serving/ladder.py):
the governor's rung, never above the model the client asked for, skipping rungs that cannot serve it. When
the rung moves to another model mid-reply, the engine ends its part with a Handover and the worker hands the
reply to the new model (`Switched` goes to the stream), which continues it without losing or repeating text.

While the queue is empty the worker runs `idle work` (add_idle_work): jobs that wait for an idle worker
(a summary written off the critical path); a submitted job cancels them between their steps.
A job's `account` (serving/accounting.py) hears what the engine did and, exactly once, that the worker is
done with the job: after generating, or when it leaves the queue unstarted (`withdraw`, `close`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from governor.limits import Rung
from models.errors import Cancelled, SimmerError
from models.protocol import BatchDecoding, Engine, EngineLimits, Prompt
from models.types import BatchEvent, CancelToken, FinishEvent, Handover, RowError, TokenEvent, ToolUse
from server.refusals import ModelLoading, ServerBusy, ShuttingDown
from server.serving.events import Failed, GovernorState, Started, Switched
from server.serving.ladder import Target, shed_above
from server.serving.model_pool import ModelPool
from server.serving.summary import Windowed

if TYPE_CHECKING:
    from server.serving.accounting import RequestAccount
    from server.serving.request import GenerationRequest

log = logging.getLogger("simmer.server")


class Gate(Protocol):
    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None: ...
    def before_step(self, cancel: CancelToken) -> EngineLimits | None: ...
    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Any:
        """`callback(state)` on every governor change (the worker forwards it to streams)."""
        ...

    @property
    def memory_pressure(self) -> bool: ...

    @property
    def pauses_new(self) -> bool:
        """New work waits now: a batch then admits no reply beside its running ones."""
        ...

    def note_pass(self, tokens: int) -> None:
        """What a batch's pass before the next step made (its replies' tokens, 0 for a prefill chunk), for
        the gate's meter and pace; a gate never told counts a step as one token."""
        ...

    @property
    def rung(self) -> str | None:
        """The model of the governor's rung now (None: no ladder, no governor). Read from any thread."""
        ...


class NoGate:
    """The default gate: never pauses, never changes limits."""

    memory_pressure = False
    pauses_new = False
    rung = None

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> None:
        return None

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        return None

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        return None

    def note_pass(self, tokens: int) -> None:
        return None


class Window(Protocol):
    """A chat job's prompt through a sliding window that may carry a summary (server/serving/summary.py)."""

    def window(
        self, engine: Engine, messages: list[dict], *, truncate: bool, reserve: int, tools: ToolUse | None
    ) -> Windowed: ...

    def dropped(self, messages: list[dict], windowed: Windowed, turns: int) -> None:
        """After the reply: its window dropped `turns` turns of windowed.messages, some during the reply."""
        ...


class IdleWork(Protocol):
    """Work for an idle worker (never on a reply's critical path)."""

    def pending(self) -> bool: ...
    def run(self, pool: ModelPool, cancel: CancelToken) -> None:
        """On the worker thread; return soon after `cancel` fires (a job arrived)."""
        ...


# (job, the governor's latest limits, models this job could not move to) -> where the job runs
Placer = Callable[["Job", EngineLimits | None, set[str]], Target]


class WorkerMetrics(Protocol):
    def observe_ttft(self, seconds: float) -> None: ...
    def observe_inter_token(self, seconds: float) -> None: ...
    def add_busy(self, seconds: float) -> None: ...
    def count_window(self, truncated: bool, summarized: bool) -> None: ...


Sink = Callable[[object], None]


def loop_sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Sink:
    """Deliver worker events into `queue` on `loop`, from any thread."""

    def put(item: object) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            loop.call_soon_threadsafe(queue.put_nowait, item)

    return put


@dataclass
class Job:
    id: str
    request: GenerationRequest  # what to generate, with what, on which model, for how long it stays loaded
    sink: Sink
    cancel: CancelToken = field(default_factory=CancelToken)
    enqueued_at: float = field(default_factory=time.monotonic)
    account: RequestAccount | None = None

    def worker_done(self) -> None:
        if self.account is not None:
            self.account.worker_done()


State = Literal["loading", "ready", "failed", "closed"]


class Worker:
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
    ) -> None:
        self.pool = pool
        self.max_batch = max(1, max_batch)  # replies of one model decoded together (_run_batch)
        self._window = window
        self.ladder = list(ladder)  # the governor's rungs across models (what shed_above reads)
        self.max_queue = max_queue
        self.gate: Gate = gate or NoGate()
        self._metrics = metrics
        self._place = place or _requested_model(preload)
        self._preload = preload
        self.state: State = "loading"
        self.load_error: BaseException | None = None
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._held: dict[int, Job] = {}  # id(job) -> the jobs the worker runs now (several in a batch)
        self._held_tokens: dict[int, int] = {}  # id(job) -> tokens it generated so far (tokens_ahead)
        # replies moved to another model mid-batch: they go on there once the batch they left is done
        self._moved: collections.deque[_Reply] = collections.deque()
        self._batch: BatchDecoding | None = None  # the decoder running a batch now
        self._batch_events: list[BatchEvent] = []  # what applying limits to it ended (_sync_limits)
        self._governed: EngineLimits | None = None  # the governor's latest limits (its rung included)
        self._applied: dict[int, EngineLimits] = {}  # per engine (id()): the limits it runs with
        self._idle_work: list[IdleWork] = []
        self._idle_due = True
        self._idle_cancel = CancelToken()
        self._rung_seen: str | None = None  # the governor's rung the worker last shed models for
        self._thread = threading.Thread(target=self._run, name="simmer-worker", daemon=True)

    # ---- event-loop side ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` or raise at once (loading, busy, closing). Never blocks on the engine."""
        with self._cond:
            if self.state == "closed":
                raise ShuttingDown("The server is shutting down")
            if self.state == "loading":
                raise ModelLoading("The model is still loading; retry shortly")
            if self.state == "failed":
                raise ModelLoading(f"The model failed to load: {self.load_error}")
            if self._waiting() >= self.max_queue:
                raise ServerBusy(f"The server is busy ({self.max_queue} requests waiting); retry shortly")
            self._queue.append(job)
            self._idle_cancel.cancel()  # idle work yields to the job between its steps
            self._cond.notify()

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
            queued = sum(_reply_tokens(job) for job in self._queue if not job.cancel.cancelled)
            held = [(job, self._held_tokens.get(key, 0)) for key, job in self._held.items()]
        return queued + sum(max(0, _reply_tokens(job) - done) for job, done in held)

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
            jobs = list(self._queue) + list(self._held.values())
            self._cond.notify()  # an idle worker looks at the rung (_rung_moved)
        for job in jobs:
            job.sink(GovernorState(dict(state)))

    def withdraw(self, job: Job) -> bool:
        """Take a job whose client left out of the queue at once (not when the worker reaches it), so its
        account closes now. False when the worker already has it: then the worker ends it."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
        job.worker_done()
        return True

    def take_back(self, job: Job) -> bool:
        """Routing takes a job that never started out of the queue, to serve it elsewhere: unlike
        withdraw(), the worker is not done with it for the account (the other side ends it). False when the
        worker already has it, or its client left."""
        with self._cond:
            if job.cancel.cancelled or not any(j is job for j in self._queue):
                return False
            self._queue.remove(job)
        return True

    def close(self) -> None:
        """Stop taking work; fail every open job with server_shutting_down and cancel it. Any thread."""
        with self._cond:
            self.state = "closed"
            queued = list(self._queue)
            jobs = queued + list(self._held.values())
            self._queue.clear()
            self._idle_cancel.cancel()
            self._cond.notify_all()
        for job in jobs:
            job.sink(Failed(ShuttingDown("The server is shutting down")))
            job.cancel.cancel()
        for job in queued:  # never started; the running one is ended by the worker thread
            job.worker_done()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- worker thread ------------------------------------------------------------------------

    def _waiting(self) -> int:
        # Cancelled jobs still in the deque (client left while queued) do not hold a slot.
        return sum(1 for job in self._queue if not job.cancel.cancelled)

    def _run(self) -> None:
        try:
            preload = self._start_model()
            if preload is not None:
                engine = self.pool.acquire(preload)
                self.pool.release(engine.model_id)
        except BaseException as err:  # the worker must report, not die silently
            log.exception("model load failed")
            with self._cond:
                self.load_error = err
                if self.state != "closed":
                    self.state = "failed"
            return
        with self._cond:
            if self.state == "loading":
                self.state = "ready"
        ready = self.pool.last_served()
        if ready is not None:
            log.info("model ready: %s (%s)", ready.model_id, ready.variant)
        while True:
            with self._cond:
                while not self._queue and not self._moved and self.state != "closed":
                    if self._idle_due and any(w.pending() for w in self._idle_work):
                        break
                    if self._rung_moved():
                        break
                    expiry = self.pool.next_expiry()
                    timeout = None if expiry is None else max(0.0, expiry - self.pool.clock())
                    if timeout == 0.0:
                        break
                    self._cond.wait(timeout)
                if self.state == "closed":
                    moved = list(self._moved)
                    self._moved.clear()
                    break
                moved_reply = self._moved.popleft() if self._moved else None
                job = self._queue.popleft() if self._queue and moved_reply is None else None
                if job is not None:
                    self._hold(job)
                if job is None and moved_reply is None:
                    self._idle_cancel = CancelToken()
            if moved_reply is not None:
                try:
                    self._serve(moved_reply)
                finally:
                    with self._cond:
                        self._idle_due = True
                    self._shed_above_rung()
                continue
            if job is None:
                self.pool.expire()  # keep_alive: idle models past their time go, and free their memory
                self._shed_above_rung()
                self._run_idle_work()
                continue
            try:
                if self.max_batch > 1:
                    reply = self._start(job)
                    if reply is not None:
                        self._serve(reply)
                else:
                    self._run_job(job)
            finally:
                with self._cond:
                    self._idle_due = True
                self._shed_above_rung()  # a reply that moved down left the bigger model idle
        for reply in moved:  # the server closes: replies waiting to go on on another model end here
            reply.job.sink(Failed(ShuttingDown("The server is shutting down")))
            self._close(reply)

    def _hold(self, job: Job) -> None:
        with self._cond:
            self._held[id(job)] = job
            self._held_tokens[id(job)] = 0

    def _let_go(self, key: int) -> None:
        with self._cond:
            self._held.pop(key, None)
            self._held_tokens.pop(key, None)

    def _start_model(self) -> str | None:
        """The model loaded at start: the memory tier's pick, or the governor's rung where that is a model
        further down the ladder (its first reading already says the device is hot, or will be). A load is
        seconds of full CPU: one the governor would leave at once only heats the device."""
        first, rung = self._preload, self.gate.rung
        order = [r.model_id for r in self.ladder]  # best first
        if first in order and rung in order and order.index(rung) > order.index(first):
            return rung
        return first

    def _rung_moved(self) -> bool:
        return self.gate.rung != self._rung_seen

    def _shed_above_rung(self) -> None:
        """Unload the idle models above the governor's rung (the rule table over shed_above): the worker
        acts on the governor's decision, as it owns the models."""
        rung = self.gate.rung
        self._rung_seen = rung
        if rung is None:
            return
        governed = replace(self._governed or EngineLimits(), model_id=rung, variant=None)
        with self._cond:
            queued = [job for job in self._queue if not job.cancel.cancelled]
        wanted = {self._place(job, governed, set()).model_id for job in queued}
        busy = {model_id: view.busy for model_id, view in self.pool.loaded().items()}
        for model_id in shed_above(self.ladder, rung, busy, wanted):
            try:
                self.pool.unload(model_id, f"idle above the governor's rung ({rung})")
            except Exception:  # the worker must go on serving; keep_alive tries again later
                log.exception("unloading %s failed", model_id)

    def _run_idle_work(self) -> None:
        cancel = self._idle_cancel
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

    # -- where a job runs, and the limits its engine gets ------------------------------------------------
    def _limits_for(self, target: Target) -> EngineLimits:
        """The governor's limits on the job's own rung."""
        return replace(self._governed or EngineLimits(), model_id=target.model_id, variant=target.variant)

    def _load_limits(self, target: Target) -> EngineLimits | None:
        """What a model loaded for `target` opens with: the limits _sync_limits would apply right after, so
        its first session is built for the governor's threads and spinning (a load builds one, not two)."""
        return None if self._governed is None else self._limits_for(target)

    def _sync_limits(self, engine: Engine, target: Target) -> None:
        """Before a job (and after a handover): the engine runs with the governor's limits on the job's
        rung. Without a governor nothing is applied but a variant the rung names."""
        if self._governed is None:
            if target.variant is None or target.variant == engine.variant:
                return
            limits = EngineLimits(variant=target.variant)
        else:
            limits = self._limits_for(target)
        if self._applied.get(id(engine)) != limits:
            if self._batch is not None and self._batch.engine is engine:  # every row of the batch gets them
                self._batch_events += self._batch.apply_limits(limits)
            else:
                engine.apply_limits(limits)
            self._applied[id(engine)] = limits

    def _step_hook(self, job: Job, engine: Engine, blocked: set[str]) -> Callable[[], EngineLimits | None]:
        def hook() -> EngineLimits | None:
            governed = self.gate.before_step(job.cancel)
            if job.cancel.cancelled:
                raise Cancelled("request cancelled")
            if governed is None:
                return None
            self._governed = governed
            target = self._place(job, governed, blocked)
            limits = self._limits_for(target)
            if target.model_id != engine.model_id:
                log.info(
                    "%s: the governor moves the reply to %s (%s)", job.id, target.model_id, target.reason
                )
                return limits  # the engine hands over (a Handover event)
            if self._applied.get(id(engine)) == limits:
                return None
            self._applied[id(engine)] = limits
            log.info("%s: applying governor limits mid-reply: %s", job.id, _describe(limits))
            return limits

        return hook

    # -- one reply: start, generate, close -------------------------------------------------------------
    def _run_job(self, job: Job) -> None:
        """One reply at a time (SIMMER_MAX_BATCH=1, or an engine that cannot batch)."""
        reply = self._start(job)
        if reply is not None:
            self._generate_alone(reply)

    def _start(self, job: Job) -> _Reply | None:
        """The job's model acquired and limited, its prompt built and Started sent: its _Reply, or None
        when it ended here (its client left, or it failed: Failed sent; the worker is done with it)."""
        self._hold(job)
        key = id(job)  # what the worker holds it by (a summarized job is replaced by a copy below)
        started = time.monotonic()
        engine: Engine | None = None
        blocked: set[str] = set()  # models this job could not move to (a failed load)
        try:
            if job.cancel.cancelled:
                raise _Gone  # the client left while queued
            limits = self.gate.before_job(job.cancel, job.enqueued_at)
            if limits is not None:
                self._governed = limits
            if job.cancel.cancelled:
                raise _Gone
            target = self._place(job, self._governed, blocked)
            engine = self.pool.acquire(target.model_id, target.variant, self._load_limits(target))
            self._sync_limits(engine, target)
            self._relieve_memory(engine)
            self._shed_above_rung()
            windowed = self._prompt(engine, job)
            prompt: Prompt | None = windowed.prompt
            assert prompt is not None
            requested = job.request.payload
            if windowed.summarized:  # a reply continued on another tokenizer renders the same messages
                job = replace(job, request=job.request.with_messages(windowed.messages))
            if job.account is not None:
                job.account.started(len(prompt.ids), engine.variant)
            job.sink(
                Started(
                    len(prompt.ids), prompt.truncated, engine.variant, engine.model_id, windowed.summarized
                )
            )
            return _Reply(job, engine, windowed, requested, blocked, started, prompt, key, limits is not None)
        except _Gone:
            pass
        except SimmerError as err:
            job.sink(Failed(err))
        except Exception as err:
            log.exception("generation failed for %s", job.id)
            job.sink(Failed(err))
        self._close(_Reply(job, engine, None, job.request.payload, blocked, started, None, key))
        return None

    def _generate_alone(self, reply: _Reply) -> None:
        """The reply through engine.generate, token by token, handed over when the governor's rung moves."""
        job = reply.job
        try:
            while True:
                handover: Handover | None = None
                events = reply.engine.generate(
                    reply.prompt,
                    job.request.params,
                    cancel=job.cancel,
                    step_hook=self._step_hook(job, reply.engine, reply.blocked),
                    resume=reply.resume,
                )
                for event in events:
                    if isinstance(event, Handover):
                        handover = event
                        break
                    self._deliver(reply, event)
                if handover is None:
                    break
                # the old model's generation holds its session: gone first, so that unloading the model
                # (shed_above, memory pressure) hands its memory back now, not after the reply
                del events
                reply.engine, reply.prompt = self._hand_over(job, reply.engine, handover, reply.blocked)
                reply.resume = handover
        except SimmerError as err:
            job.sink(Failed(err))
        except Exception as err:
            log.exception("generation failed for %s", job.id)
            job.sink(Failed(err))
        finally:
            if self._metrics:
                self._metrics.add_busy(time.monotonic() - reply.started)
            self._close(reply)

    def _deliver(self, reply: _Reply, event: TokenEvent | FinishEvent) -> None:
        """One event of the reply to its client, its account and the metrics."""
        job = reply.job
        if isinstance(event, FinishEvent):
            reply.finish = event
            if reply.windowed is not None and reply.windowed.summarized:
                event = replace(event, summarized=True)
            if self._metrics:
                self._metrics.count_window(event.truncated, event.summarized)
        if job.account is not None:
            if isinstance(event, TokenEvent):
                job.account.token(event)
            else:
                job.account.finished(event)
        if isinstance(event, TokenEvent):  # counted before it is sent: tokens_ahead never lags the client
            with self._cond:
                self._held_tokens[reply.key] = self._held_tokens.get(reply.key, 0) + 1
        job.sink(event)
        if isinstance(event, TokenEvent):
            t = time.monotonic()
            if self._metrics:
                if reply.last is None:
                    self._metrics.observe_ttft(t - job.enqueued_at)
                else:
                    self._metrics.observe_inter_token(t - reply.last)
            reply.last = t

    def _close(self, reply: _Reply) -> None:
        """The worker is done with the reply: the summary of turns it dropped queued, its model released."""
        finish, windowed = reply.finish, reply.windowed
        if finish is not None and windowed is not None and finish.turns_dropped > windowed.prompt.dropped:
            self._dropped_mid_reply(reply.job, reply.requested, windowed, finish.turns_dropped)
        if reply.engine is not None:
            self.pool.release(reply.engine.model_id, reply.job.request.keep_alive_s)
        self._let_go(reply.key)
        reply.job.worker_done()

    def _fail(self, reply: _Reply, err: BaseException) -> None:
        if not isinstance(err, SimmerError):
            log.error("generation failed for %s", reply.job.id, exc_info=err)
        reply.job.sink(Failed(err))
        self._close(reply)

    # -- several replies of one model at once -----------------------------------------------------------
    def _serve(self, reply: _Reply) -> None:
        """A started reply: in a batch with the replies of its model that follow it, or alone when its
        engine cannot batch."""
        batch = _batch_decoder(reply.engine, self._rows())
        if batch is None:
            self._generate_alone(reply)
        else:
            self._run_batch(batch, reply)

    def _run_batch(self, batch: BatchDecoding, first: _Reply) -> None:
        """Up to max_batch replies of `first`'s model, one token each per forward pass, until all are done.
        Between passes: replies of the same model join from the queue (their prompt a prefill chunk at a
        time, alternating with the decode passes), the governor's step runs once for the batch and its
        limits apply to every row, cancelled rows end. A job for another model waits at the head of the
        queue until the batch is done (FIFO), and so does a reply the governor moves to another model."""
        engine = first.engine
        rows: dict[int, _Reply] = {}
        token = CancelToken()  # the governor's waits wake when any row's client leaves
        started = time.monotonic()
        self._batch, self._batch_events = batch, []
        prefill_next = True
        chunk_s = 0.0  # how long the last prefill chunk took: what the next one may take
        last_emit = time.perf_counter()
        try:
            self._join(batch, first, rows, token)
            while rows:
                self._admit(batch, rows, token)
                events = self._take_batch_events() + self._sweep(batch, rows)
                if token.cancelled:  # those rows are gone: a fresh token for the ones left
                    token = CancelToken()
                    for reply in rows.values():
                        reply.job.cancel.on_cancel(token.cancel)
                if rows:
                    try:
                        governed = self.gate.before_step(token)
                    except Cancelled:
                        governed = None  # a client left during a pause or an idle: its row ends next
                    if governed is not None:
                        events += self._govern(batch, rows, governed, token)
                if rows and not token.cancelled:
                    if batch.prefilling and (prefill_next or self._may_stall(batch, rows, chunk_s)):
                        t0 = time.monotonic()
                        events += batch.prefill()
                        chunk_s = time.monotonic() - t0
                        prefill_next = False
                        self.gate.note_pass(0)
                    else:
                        before = batch.last_pass
                        events += batch.step()
                        prefill_next = True
                        ran = batch.last_pass if batch.last_pass is not before else None
                        self.gate.note_pass(ran.replies if ran is not None else 0)
                        last_emit = self._pace(engine, batch, last_emit)
                self._dispatch(rows, events)
                if not rows:  # every row ended in this pass: the queue's next replies of the model go on here
                    self._admit(batch, rows, token)
        except Exception as err:  # the gate (device overheated, paused too long) or a bug: every row fails
            for slot, reply in list(rows.items()):
                with contextlib.suppress(Exception):
                    batch.cancel(slot)
                del rows[slot]
                self._fail(reply, err)
        finally:
            self._batch = None
            if self._metrics:
                self._metrics.add_busy(time.monotonic() - started)

    @staticmethod
    def _may_stall(batch: BatchDecoding, rows: dict[int, _Reply], chunk_s: float) -> bool:
        """Another prefill chunk before the next decode pass: while no decoding reply would have waited
        PREFILL_STALL_S for its next token by the end of it (a chunk taken to last as long as the last one).
        Prompts that arrive together (short ones, a chunk each) then get their first token before the
        running replies' next one or two, as llama-server prefills them in one pass; a long prompt's chunks
        still alternate with decode passes, so a running reply never waits more than one chunk."""
        now = time.monotonic()
        waited = [now - (rows[b].last or now) for b in batch.decoding if b in rows]
        return not waited or max(waited) + chunk_s < PREFILL_STALL_S

    def _join(self, batch: BatchDecoding, reply: _Reply, rows: dict[int, _Reply], token: CancelToken) -> None:
        """The reply takes a row (its prompt runs in later prefill chunks)."""
        try:
            slot = batch.add(
                reply.prompt, reply.job.request.params, cancel=reply.job.cancel, resume=reply.resume
            )
        except Exception as err:  # its prompt does not fit, a bad grammar: this reply alone fails
            self._fail(reply, err)
            return
        rows[slot] = reply
        reply.job.cancel.on_cancel(token.cancel)

    def _admit(self, batch: BatchDecoding, rows: dict[int, _Reply], token: CancelToken) -> None:
        """Free rows take replies of the batch's model: moved ones first, then the queue's head while it
        is placed on this model (and the governor lets new work start)."""
        engine = batch.engine
        while batch.free > 0 and len(batch.active) < self._rows():  # fewer rows under memory pressure
            reply = self._next_for(engine)
            if reply is None:
                return
            if reply.engine is not engine:  # placed elsewhere after all (the governor moved meanwhile)
                with self._cond:
                    self._moved.append(reply)
                return
            self._join(batch, reply, rows, token)
            if reply.governed:  # the gate's new limits came with the job: they apply to every row
                self._batch_events += self._govern(batch, rows, self._governed or EngineLimits(), token)

    def _next_for(self, engine: Engine) -> _Reply | None:
        """The next reply for `engine`, started: a moved one, else the queue's head when it runs there."""
        with self._cond:
            for reply in self._moved:
                if reply.engine is engine:
                    self._moved.remove(reply)
                    return reply
            if self._moved or self.gate.pauses_new:
                return None  # the moved replies go first; a paused governor holds new work
            while self._queue and self._queue[0].cancel.cancelled:
                gone = self._queue.popleft()
                gone.worker_done()  # its client left while it was queued
            if not self._queue:
                return None
            job = self._queue[0]
            if self._place(job, self._governed, set()).model_id != engine.model_id:
                return None  # another model's turn comes after this batch
            self._queue.popleft()
            self._held[id(job)] = job  # close() fails it from here on
        return self._start(job)

    def _sweep(self, batch: BatchDecoding, rows: dict[int, _Reply]) -> list[BatchEvent]:
        """Rows whose client left end now (their slot free for the next reply)."""
        return [(slot, batch.cancel(slot)) for slot, r in list(rows.items()) if r.job.cancel.cancelled]

    def _take_batch_events(self) -> list[BatchEvent]:
        events, self._batch_events = self._batch_events, []
        return events

    def _govern(
        self, batch: BatchDecoding, rows: dict[int, _Reply], governed: EngineLimits, token: CancelToken
    ) -> list[BatchEvent]:
        """The governor's new limits for every row: a row placed on another model is handed over (it goes
        on there after this batch), the others get the limits together (a variant switch re-prefills them)."""
        self._governed = governed
        engine = batch.engine
        stay: Target | None = None
        for slot, reply in list(rows.items()):
            target = self._place(reply.job, governed, reply.blocked)
            if target.model_id == engine.model_id:
                stay = stay or target
                continue
            log.info(
                "%s: the governor moves the reply to %s (%s)", reply.job.id, target.model_id, target.reason
            )
            handover = batch.hand_over(slot, self._limits_for(target))
            del rows[slot]
            reply.engine, reply.prompt = self._hand_over(reply.job, engine, handover, reply.blocked)
            reply.resume = handover
            if reply.engine is engine:  # the other model could not load: the reply stays in the batch
                stay = stay or Target(engine.model_id, target.variant, "handover")
                self._join(batch, reply, rows, token)
            else:
                with self._cond:
                    self._moved.append(reply)
        if stay is not None:
            self._sync_limits(engine, stay)
        return self._take_batch_events()

    def _pace(self, engine: Engine, batch: BatchDecoding, last_emit: float) -> float:
        """The engine's tokens/s pace holds for the whole batch: a pass of n replies makes n tokens."""
        tps = engine.tokens_per_second
        if tps and batch.last_pass is not None:
            wait = last_emit + batch.last_pass.replies / tps - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        return time.perf_counter()

    def _dispatch(self, rows: dict[int, _Reply], events: list[BatchEvent]) -> None:
        for slot, event in events:
            reply = rows.get(slot)
            if reply is None:
                continue
            if isinstance(event, RowError):
                del rows[slot]
                self._fail(reply, event.error)
                continue
            self._deliver(reply, event)
            if isinstance(event, FinishEvent):
                del rows[slot]
                self._close(reply)

    def _dropped_mid_reply(self, job: Job, messages: object, windowed: Windowed, turns: int) -> None:
        """The window dropped more turns during the reply (the context filled, or the governor lowered the
        cap): their summary is queued once the client has the whole reply, as idle work."""
        if self._window is None or not isinstance(messages, list):
            return
        try:
            self._window.dropped(messages, windowed, turns, job.request.params.cache_scope)
        except Exception:  # the reply is done and sent: a summary is optional
            log.exception("%s: queueing the summary of the dropped turns failed", job.id)

    def _hand_over(
        self, job: Job, old: Engine, handover: Handover, blocked: set[str]
    ) -> tuple[Engine, Prompt | None]:
        """Move the reply to handover.model_id: release the old model first (the planner may need its
        room), load the new one, and give it the reply. A model that cannot load leaves the reply where it
        was (and is not tried again for this job)."""
        old_name = f"{old.model_id}/{old.variant}"
        self.pool.release(old.model_id, job.request.keep_alive_s)
        try:
            engine = self.pool.acquire(
                handover.model_id,
                handover.variant,
                self._load_limits(Target(handover.model_id, handover.variant, "handover")),
            )
        except SimmerError as err:
            log.warning(
                "%s: cannot move to %s (%s); the reply stays on %s", job.id, handover.model_id, err, old_name
            )
            blocked.add(handover.model_id)
            engine = self.pool.acquire(old.model_id)
            return engine, None if engine.tokenizer_key == handover.tokenizer_key else self._continuation(
                engine, job, handover, old
            )
        self._relieve_memory(engine)
        self._shed_above_rung()  # the model the reply left, idle now, is above the rung: its memory goes
        target = self._place(job, self._governed, blocked)
        if target.model_id != engine.model_id:  # moved on again meanwhile: the next step hands over again
            target = Target(engine.model_id, handover.variant, "handover")
        self._sync_limits(engine, target)
        same = engine.tokenizer_key == handover.tokenizer_key
        prompt = None if same else self._continuation(engine, job, handover, old)
        how = (
            "same tokenizer: the KV cache rebuilt once"
            if same
            else "another tokenizer: the text so far re-tokenized"
        )
        reason = (
            f"the governor's rung ({_describe(self._governed) if self._governed else 'no limits'}); {how}"
        )
        log.info("%s: %s -> %s/%s: %s", job.id, old_name, engine.model_id, engine.variant, reason)
        job.sink(Switched(old_name, engine.model_id, engine.variant, reason, handover.generated))
        return engine, prompt

    def _rows(self) -> int:
        """Replies a batch may hold now: SIMMER_MAX_BATCH, or fewer while memory is short (pool.rows_cap)."""
        cap = self.pool.rows_cap
        return self.max_batch if cap is None else max(1, min(self.max_batch, cap))

    def _relieve_memory(self, engine: Engine) -> None:
        """Under memory pressure, first batches of fewer replies (halved when a job starts a batch, down to
        one at a time: new requests wait in the queue, running rows finish; a job joining a running batch
        changes nothing, the last halving is not in effect yet), then only the model that serves stays
        loaded: the governor's smaller rung frees the room of the bigger ones. Without pressure the rows
        come back, doubling, as far as the memory plan says they fit."""
        rows = self._rows()
        if not self.gate.memory_pressure:
            if rows < self.max_batch and self.pool.rows_fit(more := min(self.max_batch, 2 * rows)):
                self.pool.cap_rows(None if more >= self.max_batch else more, "memory pressure over")
            return
        if rows > 1:
            if self._batch is None:
                self.pool.cap_rows(rows // 2, "memory pressure")
            return
        for model_id, view in self.pool.loaded().items():
            if model_id != engine.model_id and not view.busy:  # a batch's model still serves its rows
                self.pool.unload(model_id, f"memory pressure: {engine.model_id} serves")

    @staticmethod
    def _continuation(engine: Engine, job: Job, handover: Handover, old: Engine) -> Prompt:
        """`engine`'s prompt for the reply `old` started (another tokenizer: the request rendered again). A
        prompt of token ids is the old model's: the new one reads it as the text those ids spell."""
        left = (job.request.params.max_tokens or UNBOUNDED_REPLY_TOKENS) - handover.generated
        reserve = min(max(left, 1), engine.context_length // 2) if job.request.params.truncate else 1
        request = job.request.payload
        if isinstance(request, tuple):
            request = b"".join(old.token_bytes(t) for t in request).decode("utf-8", "replace")
        return engine.continuation_prompt(
            request, handover.text, truncate=job.request.params.truncate, reserve=reserve
        )

    def _prompt(self, engine: Engine, job: Job) -> Windowed:
        truncate = job.request.params.truncate
        # Without truncation, only insist that one token fits (generation stops at the context cap with
        # finish_reason "length"); with it, make room for the answer, up to half the context.
        reserve = min(_reply_tokens(job), engine.context_length // 2) if truncate else 1
        if not isinstance(job.request.payload, list):
            return Windowed(
                engine.text_prompt(job.request.payload, truncate=truncate, reserve=reserve), False, []
            )
        tools = job.request.params.tools
        if self._window is not None:
            return self._window.window(
                engine,
                job.request.payload,
                truncate=truncate,
                reserve=reserve,
                tools=tools,
                scope=job.request.params.cache_scope,
            )
        if tools is None:  # engines without tool support keep their two-keyword signature
            prompt = engine.chat_prompt(job.request.payload, truncate=truncate, reserve=reserve)
        else:
            prompt = engine.chat_prompt(job.request.payload, truncate=truncate, reserve=reserve, tools=tools)
        return Windowed(prompt, False, job.request.payload)


class _Gone(Exception):
    """The job's client left before it started."""


@dataclass
class _Reply:
    """A started job: the engine it runs on (acquired), its prompt's window, the models it may not move to."""

    job: Job
    engine: Engine | None
    windowed: Windowed | None
    requested: list[dict] | str  # the payload as the client sent it (the summary keys on it)
    blocked: set[str]
    started: float
    prompt: Prompt | None
    key: int  # what the worker holds the job by (Worker._held)
    governed: bool = False  # the gate handed out new limits as it started
    resume: Handover | None = None  # it goes on from another model's part
    last: float | None = None  # when its last token went out
    finish: FinishEvent | None = None


def _batch_decoder(engine: Engine | None, slots: int) -> BatchDecoding | None:
    """The engine's batch decoder of `slots` rows, or None when it serves one reply at a time (an engine
    that offers none, a graph of one sequence, or one slot: memory pressure, whose decoder then goes)."""
    if engine is None:
        return None
    if slots <= 1:
        engine.shrink_batch(1)
        return None
    return engine.batch_decoder(slots)


# How long a decoding reply may wait for its next token while new prompts are prefilled first: a one-off
# pause a reader barely notices, against a newcomer's first token waiting for every running reply's pass.
PREFILL_STALL_S = 0.2
UNBOUNDED_REPLY_TOKENS = 256  # a reply without max_tokens, for estimates (the prompt's reserve uses it too)


def _reply_tokens(job: Job) -> int:
    return job.request.params.max_tokens or UNBOUNDED_REPLY_TOKENS


def _requested_model(default: str | None) -> Placer:
    """Without a ladder: the model the job asked for, on the governor's variant when that is its rung."""

    def place(job: Job, governed: EngineLimits | None, blocked: set[str]) -> Target:
        model = job.request.model or default or ""
        same = governed is not None and governed.model_id in (None, model)
        return Target(model, governed.variant if same and governed else None, "requested")

    return place


def _describe(limits: EngineLimits) -> str:
    """`threads=1 variant=q4-a8 ...`: the limits that are set, for one log line."""
    fields = {k: v for k, v in vars(limits).items() if v is not None}
    return " ".join(f"{k}={round(v, 1) if isinstance(v, float) else v}" for k, v in fields.items()) or "none"
