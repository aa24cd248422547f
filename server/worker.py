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
- `worker.publish_governor(state)` (any thread) sends a JSON-able state to every open job; streams that
  asked for it (`governor_events: true`) forward it as SSE `event: governor`. It also wakes an idle worker
  to look at the governor's rung (`gate.rung`): once it moved below a loaded bigger model, that model is
  unloaded when idle (`shed_above`, server/ladder.py), not at the end of its keep_alive.

Which model a job runs on is placed per job and again at every changed limit (`place`, server/ladder.py):
the governor's rung, never above the model the client asked for, skipping rungs that cannot serve it. When
the rung moves to another model mid-reply, the engine ends its part with a Handover and the worker hands the
reply to the new model (`Switched` goes to the stream), which continues it without losing or repeating text.

While the queue is empty the worker runs `idle work` (add_idle_work): jobs that wait for an idle worker
(a summary written off the critical path); a submitted job cancels them between their steps.
A job's `account` (server/accounting.py) hears what the engine did and, exactly once, that the worker is
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
from models.protocol import Engine, EngineLimits, Prompt
from models.types import CancelToken, FinishEvent, GenerationParams, Handover, TokenEvent, ToolUse
from server.ladder import Target, shed_above
from server.model_pool import ModelPool
from server.refusals import ModelLoading, ServerBusy, ShuttingDown
from server.summary import Windowed

if TYPE_CHECKING:
    from server.accounting import RequestAccount

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
    def rung(self) -> str | None:
        """The model of the governor's rung now (None: no ladder, no governor). Read from any thread."""
        ...


class NoGate:
    """The default gate: never pauses, never changes limits."""

    memory_pressure = False
    rung = None

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> None:
        return None

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        return None

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        return None


class Window(Protocol):
    """A chat job's prompt through a sliding window that may carry a summary (server/summary.py)."""

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


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    truncated: bool
    variant: str | None = None
    model_id: str | None = None  # the model that runs it (None: the requested one)
    summarized: bool = False  # the window's dropped turns are in the prompt as a summary note


@dataclass(frozen=True)
class Switched:
    """The reply moved to another model mid-way (the governor's rung moved)."""

    old: str  # model/variant
    model_id: str
    variant: str
    reason: str
    tokens: int  # generated before the switch


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class GovernorState:
    state: Mapping[str, Any]


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
    kind: Literal["chat", "text"]
    payload: list[dict] | str  # chat messages, or the completion prompt
    params: GenerationParams
    sink: Sink
    cancel: CancelToken = field(default_factory=CancelToken)
    governor_events: bool = False
    enqueued_at: float = field(default_factory=time.monotonic)
    model: str | None = None  # the id the client asked for (None: the default model)
    keep_alive_s: float | None = None  # how long its model stays loaded after it (None: the default)
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
    ) -> None:
        self.pool = pool
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
        self._current: Job | None = None
        self._current_tokens = 0  # tokens the running job generated so far (tokens_ahead)
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
            current, done = self._current, self._current_tokens
        return queued + (max(0, _reply_tokens(current) - done) if current is not None else 0)

    @property
    def busy(self) -> bool:
        return self._current is not None

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
            jobs = list(self._queue) + ([self._current] if self._current else [])
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
            jobs = queued + ([self._current] if self._current else [])
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
            if self._preload is not None:
                engine = self.pool.acquire(self._preload)
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
                while not self._queue and self.state != "closed":
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
                    return
                job = self._queue.popleft() if self._queue else None
                self._current = job
                self._current_tokens = 0
                if job is None:
                    self._idle_cancel = CancelToken()
            if job is None:
                self.pool.expire()  # keep_alive: idle models past their time go, and free their memory
                self._shed_above_rung()
                self._run_idle_work()
                continue
            try:
                self._run_job(job)
            finally:
                with self._cond:
                    self._current = None
                    self._idle_due = True
                self._shed_above_rung()  # a reply that moved down left the bigger model idle

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

    def _run_job(self, job: Job) -> None:
        started = time.monotonic()
        engine: Engine | None = None
        blocked: set[str] = set()  # models this job could not move to (a failed load)
        account = job.account
        try:
            if job.cancel.cancelled:
                return  # the client left while queued
            limits = self.gate.before_job(job.cancel, job.enqueued_at)
            if limits is not None:
                self._governed = limits
            if job.cancel.cancelled:
                return
            target = self._place(job, self._governed, blocked)
            engine = self.pool.acquire(target.model_id, target.variant, self._load_limits(target))
            self._sync_limits(engine, target)
            self._relieve_memory(engine)
            self._shed_above_rung()
            windowed = self._prompt(engine, job)
            prompt: Prompt | None = windowed.prompt
            assert prompt is not None
            summarized = windowed.summarized
            requested = job.payload
            if summarized:  # a reply continued on another tokenizer renders the same messages, note included
                job = replace(job, payload=windowed.messages)
            if account is not None:
                account.started(len(prompt.ids), engine.variant)
            job.sink(Started(len(prompt.ids), prompt.truncated, engine.variant, engine.model_id, summarized))
            resume: Handover | None = None
            last = None
            finish: FinishEvent | None = None
            while True:
                handover: Handover | None = None
                events = engine.generate(
                    prompt,
                    job.params,
                    cancel=job.cancel,
                    step_hook=self._step_hook(job, engine, blocked),
                    resume=resume,
                )
                for event in events:
                    if isinstance(event, Handover):
                        handover = event
                        break
                    if isinstance(event, FinishEvent):
                        finish = event
                        if summarized:
                            event = replace(event, summarized=True)
                        if self._metrics:
                            self._metrics.count_window(event.truncated, event.summarized)
                    if account is not None:
                        if isinstance(event, TokenEvent):
                            account.token(event)
                        elif isinstance(event, FinishEvent):
                            account.finished(event)
                    job.sink(event)
                    if isinstance(event, TokenEvent):
                        self._current_tokens += 1
                    if isinstance(event, TokenEvent) and self._metrics:
                        t = time.monotonic()
                        if last is None:
                            self._metrics.observe_ttft(t - job.enqueued_at)
                        else:
                            self._metrics.observe_inter_token(t - last)
                        last = t
                if handover is None:
                    break
                # the old model's generation holds its session: gone first, so that unloading the model
                # (shed_above, memory pressure) hands its memory back now, not after the reply
                del events
                engine, prompt = self._hand_over(job, engine, handover, blocked)
                resume = handover
            if finish is not None and finish.turns_dropped > windowed.prompt.dropped:
                self._dropped_mid_reply(job, requested, windowed, finish.turns_dropped)
        except SimmerError as err:
            job.sink(Failed(err))
        except Exception as err:
            log.exception("generation failed for %s", job.id)
            job.sink(Failed(err))
        finally:
            if engine is not None:
                self.pool.release(engine.model_id, job.keep_alive_s)
            if self._metrics:
                self._metrics.add_busy(time.monotonic() - started)
            job.worker_done()

    def _dropped_mid_reply(self, job: Job, messages: object, windowed: Windowed, turns: int) -> None:
        """The window dropped more turns during the reply (the context filled, or the governor lowered the
        cap): their summary is queued once the client has the whole reply, as idle work."""
        if self._window is None or not isinstance(messages, list):
            return
        try:
            self._window.dropped(messages, windowed, turns)
        except Exception:  # the reply is done and sent: a summary is optional
            log.exception("%s: queueing the summary of the dropped turns failed", job.id)

    def _hand_over(
        self, job: Job, old: Engine, handover: Handover, blocked: set[str]
    ) -> tuple[Engine, Prompt | None]:
        """Move the reply to handover.model_id: release the old model first (the planner may need its
        room), load the new one, and give it the reply. A model that cannot load leaves the reply where it
        was (and is not tried again for this job)."""
        old_name = f"{old.model_id}/{old.variant}"
        self.pool.release(old.model_id, job.keep_alive_s)
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
                engine, job, handover
            )
        self._relieve_memory(engine)
        self._shed_above_rung()  # the model the reply left, idle now, is above the rung: its memory goes
        target = self._place(job, self._governed, blocked)
        if target.model_id != engine.model_id:  # moved on again meanwhile: the next step hands over again
            target = Target(engine.model_id, handover.variant, "handover")
        self._sync_limits(engine, target)
        same = engine.tokenizer_key == handover.tokenizer_key
        prompt = None if same else self._continuation(engine, job, handover)
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

    def _relieve_memory(self, engine: Engine) -> None:
        """Under memory pressure only the model that serves stays loaded: the governor's smaller rung
        frees the room of the bigger ones (idle: the worker runs one job at a time)."""
        if not self.gate.memory_pressure:
            return
        for model_id in self.pool.loaded():
            if model_id != engine.model_id:
                self.pool.unload(model_id, f"memory pressure: {engine.model_id} serves")

    @staticmethod
    def _continuation(engine: Engine, job: Job, handover: Handover) -> Prompt:
        left = (job.params.max_tokens or UNBOUNDED_REPLY_TOKENS) - handover.generated
        reserve = min(max(left, 1), engine.context_length // 2) if job.params.truncate else 1
        return engine.continuation_prompt(
            job.payload, handover.text, truncate=job.params.truncate, reserve=reserve
        )

    def _prompt(self, engine: Engine, job: Job) -> Windowed:
        truncate = job.params.truncate
        # Without truncation, only insist that one token fits (generation stops at the context cap with
        # finish_reason "length"); with it, make room for the answer, up to half the context.
        reserve = min(_reply_tokens(job), engine.context_length // 2) if truncate else 1
        if not isinstance(job.payload, list):
            return Windowed(engine.text_prompt(job.payload, truncate=truncate, reserve=reserve), False, [])
        tools = job.params.tools
        if self._window is not None:
            return self._window.window(engine, job.payload, truncate=truncate, reserve=reserve, tools=tools)
        if tools is None:  # engines without tool support keep their two-keyword signature
            prompt = engine.chat_prompt(job.payload, truncate=truncate, reserve=reserve)
        else:
            prompt = engine.chat_prompt(job.payload, truncate=truncate, reserve=reserve, tools=tools)
        return Windowed(prompt, False, job.payload)


UNBOUNDED_REPLY_TOKENS = 256  # a reply without max_tokens, for estimates (the prompt's reserve uses it too)


def _reply_tokens(job: Job) -> int:
    return job.params.max_tokens or UNBOUNDED_REPLY_TOKENS


def _requested_model(default: str | None) -> Placer:
    """Without a ladder: the model the job asked for, on the governor's variant when that is its rung."""

    def place(job: Job, governed: EngineLimits | None, blocked: set[str]) -> Target:
        model = job.model or default or ""
        same = governed is not None and governed.model_id in (None, model)
        return Target(model, governed.variant if same and governed else None, "requested")

    return place


def _describe(limits: EngineLimits) -> str:
    """`threads=1 variant=q4-a8 ...`: the limits that are set, for one log line."""
    fields = {k: v for k, v in vars(limits).items() if v is not None}
    return " ".join(f"{k}={round(v, 1) if isinstance(v, float) else v}" for k, v in fields.items()) or "none"
