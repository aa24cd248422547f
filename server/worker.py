"""One thread owns the engine: it loads it, builds prompts and generates, one job at a time, FIFO.

The event loop never touches the engine. It submits a `Job` (cheap: no tokenizing, so a full queue is
rejected before any real work) and reads the job's events from an asyncio.Queue that the worker fills
through `loop.call_soon_threadsafe`. Events, in order:
  Started(prompt_tokens, truncated)  -> TokenEvent* -> FinishEvent
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
  asked for it (`governor_events: true`) forward it as SSE `event: governor`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from models.errors import Cancelled, SimmerError
from models.protocol import Engine, EngineLimits, Prompt
from models.types import CancelToken, FinishEvent, GenerationParams, TokenEvent
from server.errors import ModelLoading, ServerBusy, ShuttingDown

log = logging.getLogger("simmer.server")


class Gate(Protocol):
    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None: ...
    def before_step(self, cancel: CancelToken) -> EngineLimits | None: ...


class NoGate:
    """The default gate: never pauses, never changes limits."""

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        return None

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        return None


class WorkerMetrics(Protocol):
    def observe_ttft(self, seconds: float) -> None: ...
    def observe_inter_token(self, seconds: float) -> None: ...
    def add_busy(self, seconds: float) -> None: ...
    def add_tokens(self, prompt: int, completion: int) -> None: ...


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    truncated: bool
    variant: str | None = None


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
    # The request's keep_alive (server/keep_alive.py: seconds, inf = for ever, 0 = unload after it; None =
    # the server's default). Parsed and carried; the model pool acts on it (the worker does not yet).
    keep_alive_s: float | None = None


State = Literal["loading", "ready", "failed", "closed"]


class Worker:
    def __init__(
        self,
        load: Callable[[], Engine],
        *,
        max_queue: int,
        gate: Gate | None = None,
        metrics: WorkerMetrics | None = None,
        keep_alive_s: float = 0.0,
    ) -> None:
        self._load = load
        self.max_queue = max_queue
        self.gate: Gate = gate or NoGate()
        self._metrics = metrics
        self._keep_alive_s = keep_alive_s
        self.engine: Engine | None = None
        self.state: State = "loading"
        self.load_error: BaseException | None = None
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._current: Job | None = None
        # What /api/ps shows: is the model in memory (False after a keep_alive unload), idle since when.
        self.resident = False
        self.idle_since: float | None = None  # monotonic; None while a job runs
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
            self._cond.notify()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return self._waiting()

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def keep_alive_s(self) -> float:
        """Idle seconds before the model is unloaded (0: never)."""
        return self._keep_alive_s

    def publish_governor(self, state: Mapping[str, Any]) -> None:
        with self._cond:
            jobs = list(self._queue) + ([self._current] if self._current else [])
        for job in jobs:
            job.sink(GovernorState(dict(state)))

    def close(self) -> None:
        """Stop taking work; fail every open job with server_shutting_down and cancel it. Any thread."""
        with self._cond:
            self.state = "closed"
            jobs = list(self._queue) + ([self._current] if self._current else [])
            self._queue.clear()
            self._cond.notify_all()
        for job in jobs:
            job.sink(Failed(ShuttingDown("The server is shutting down")))
            job.cancel.cancel()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- worker thread ------------------------------------------------------------------------

    def _waiting(self) -> int:
        # Cancelled jobs still in the deque (client left while queued) do not hold a slot.
        return sum(1 for job in self._queue if not job.cancel.cancelled)

    def _run(self) -> None:
        try:
            engine = self._load()
        except BaseException as err:  # the worker must report, not die silently
            log.exception("model load failed")
            with self._cond:
                self.load_error = err
                if self.state != "closed":
                    self.state = "failed"
            return
        with self._cond:
            self.engine = engine
            self.resident = True
            if self.state == "loading":
                self.state = "ready"
        log.info("model ready: %s (%s)", engine.model_id, engine.variant)
        unloaded = False
        while True:
            with self._cond:
                idle_since = self.idle_since = time.monotonic()
                while not self._queue and self.state != "closed":
                    timeout = None
                    if self._keep_alive_s > 0 and not unloaded:
                        timeout = max(0.0, idle_since + self._keep_alive_s - time.monotonic())
                        if timeout == 0.0:
                            break
                    self._cond.wait(timeout)
                if self.state == "closed":
                    return
                job = self._queue.popleft() if self._queue else None
                self._current = job
                if job is not None:
                    self.idle_since = None
            if job is None:
                # Idle past keep_alive: free the sessions; the next generate() loads again.
                engine.unload()
                unloaded = True
                self.resident = False
                log.info("model unloaded after %.0f s idle", self._keep_alive_s)
                continue
            unloaded = False
            self.resident = True
            try:
                self._run_job(engine, job)
            finally:
                with self._cond:
                    self._current = None

    def _step_hook(self, job: Job) -> Callable[[], EngineLimits | None]:
        def hook() -> EngineLimits | None:
            limits = self.gate.before_step(job.cancel)
            if job.cancel.cancelled:
                raise Cancelled("request cancelled")
            if limits is not None:
                log.info("%s: applying governor limits mid-reply: %s", job.id, _describe(limits))
            return limits

        return hook

    def _run_job(self, engine: Engine, job: Job) -> None:
        if job.cancel.cancelled:
            return  # the client left while queued
        started = time.monotonic()
        try:
            limits = self.gate.before_job(job.cancel, job.enqueued_at)
            if job.cancel.cancelled:
                return
            if limits is not None:
                log.info("%s: applying governor limits: %s", job.id, _describe(limits))
                engine.apply_limits(limits)
            prompt = self._prompt(engine, job)
            job.sink(Started(len(prompt.ids), prompt.truncated, engine.variant))
            last = None
            for event in engine.generate(
                prompt, job.params, cancel=job.cancel, step_hook=self._step_hook(job)
            ):
                job.sink(event)
                if isinstance(event, TokenEvent) and self._metrics:
                    t = time.monotonic()
                    if last is None:
                        self._metrics.observe_ttft(t - job.enqueued_at)
                    else:
                        self._metrics.observe_inter_token(t - last)
                    last = t
                elif isinstance(event, FinishEvent) and self._metrics:
                    self._metrics.add_tokens(event.usage.prompt_tokens, event.usage.completion_tokens)
        except SimmerError as err:
            job.sink(Failed(err))
        except Exception as err:
            log.exception("generation failed for %s", job.id)
            job.sink(Failed(err))
        finally:
            if self._metrics:
                self._metrics.add_busy(time.monotonic() - started)

    @staticmethod
    def _prompt(engine: Engine, job: Job) -> Prompt:
        truncate = job.params.truncate
        # Without truncation, only insist that one token fits (generation stops at the context cap with
        # finish_reason "length"); with it, make room for the answer, up to half the context.
        reserve = min(job.params.max_tokens or 256, engine.context_length // 2) if truncate else 1
        if isinstance(job.payload, list):
            tools = job.params.tools
            if tools is None:  # engines without tool support keep their two-keyword signature
                return engine.chat_prompt(job.payload, truncate=truncate, reserve=reserve)
            return engine.chat_prompt(job.payload, truncate=truncate, reserve=reserve, tools=tools)
        return engine.text_prompt(job.payload, truncate=truncate, reserve=reserve)


def _describe(limits: EngineLimits) -> str:
    """`threads=1 variant=q4-a8 ...`: the limits that are set, for one log line."""
    fields = {k: v for k, v in vars(limits).items() if v is not None}
    return " ".join(f"{k}={round(v, 1) if isinstance(v, float) else v}" for k, v in fields.items()) or "none"
