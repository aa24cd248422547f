"""One reply's life on the worker thread, after it started: it delivers its events, closes (its model
released, the summary of the turns it dropped queued, the worker done with its job) and fails itself.

Whether it runs alone or in a batch (server/serving/batch_loop.py) and on which model
(server/serving/placement.py) is decided elsewhere; every way a reply ends goes through `close` once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from models.errors import SimmerError
from models.protocol import Engine, Prompt
from models.types import FinishEvent, Handover, TokenEvent
from server.serving.contracts import Job, Window, WorkerMetrics
from server.serving.events import Failed
from server.serving.model_pool import ModelPool
from server.serving.summary import Windowed

log = logging.getLogger("simmer.server")


class Gone(Exception):
    """The job's client left before it started."""


class Held:
    """The jobs the worker runs now (several in a batch), by id(job), and the tokens each made so far (what
    tokens_ahead subtracts). It shares the worker's lock: a job leaves the queue and is held in one step."""

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._jobs: dict[int, Job] = {}
        self._tokens: dict[int, int] = {}

    def hold(self, job: Job) -> None:
        with self._lock:
            self._jobs[id(job)] = job
            self._tokens[id(job)] = 0

    def let_go(self, key: int) -> None:
        with self._lock:
            self._jobs.pop(key, None)
            self._tokens.pop(key, None)

    def count_token(self, key: int) -> None:
        with self._lock:
            self._tokens[key] = self._tokens.get(key, 0) + 1

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def made(self) -> list[tuple[Job, int]]:
        """Each held job with the tokens it made so far."""
        with self._lock:
            return [(job, self._tokens.get(key, 0)) for key, job in self._jobs.items()]

    def __bool__(self) -> bool:
        return bool(self._jobs)


@dataclass
class Desk:
    """What every reply of a worker shares: where it counts its tokens, the pool its model goes back to,
    the metrics it feeds and the window that summarizes the turns it dropped."""

    held: Held
    pool: ModelPool
    metrics: WorkerMetrics | None = None
    window: Window | None = None


@dataclass
class Reply:
    """A started job: the engine it runs on (acquired), its prompt's window, the models it may not move to."""

    job: Job
    engine: Engine | None
    windowed: Windowed | None
    requested: list[dict] | str | tuple[int, ...]  # the payload as the client sent it (summaries key on it)
    blocked: set[str]
    started: float
    prompt: Prompt | None
    key: int  # what the worker holds the job by (Held)
    desk: Desk
    governed: bool = False  # the gate handed out new limits as it started
    resume: Handover | None = None  # it goes on from another model's part
    last: float | None = None  # when its last token went out
    finish: FinishEvent | None = None

    def deliver(self, event: TokenEvent | FinishEvent) -> None:
        """One event of the reply to its client, its account and the metrics."""
        job, metrics = self.job, self.desk.metrics
        if isinstance(event, FinishEvent):
            self.finish = event
            if self.windowed is not None and self.windowed.summarized:
                event = replace(event, summarized=True)
            if metrics:
                metrics.count_window(event.truncated, event.summarized)
        if job.account is not None:
            if isinstance(event, TokenEvent):
                job.account.token(event)
            else:
                job.account.finished(event)
        if isinstance(event, TokenEvent):  # counted before it is sent: tokens_ahead never lags the client
            self.desk.held.count_token(self.key)
        job.sink(event)
        if isinstance(event, TokenEvent):
            t = time.monotonic()
            if metrics:
                if self.last is None:
                    metrics.observe_ttft(t - job.enqueued_at)
                else:
                    metrics.observe_inter_token(t - self.last)
            self.last = t

    def close(self) -> None:
        """The worker is done with the reply: the summary of turns it dropped queued, its model released."""
        finish, windowed = self.finish, self.windowed
        if finish is not None and windowed is not None and finish.turns_dropped > windowed.prompt.dropped:
            self._dropped_mid_reply(windowed, finish.turns_dropped)
        if self.engine is not None:
            self.desk.pool.release(self.engine.model_id, self.job.request.keep_alive_s)
        self.desk.held.let_go(self.key)
        self.job.worker_done()

    def fail(self, err: BaseException) -> None:
        if not isinstance(err, SimmerError):
            log.error("generation failed for %s", self.job.id, exc_info=err)
        self.job.sink(Failed(err))
        self.close()

    def _dropped_mid_reply(self, windowed: Windowed, turns: int) -> None:
        """The window dropped more turns during the reply (the context filled, or the governor lowered the
        cap): their summary is queued once the client has the whole reply, as idle work."""
        window, messages = self.desk.window, self.requested
        if window is None or not isinstance(messages, list):
            return
        try:
            window.dropped(messages, windowed, turns, self.job.request.params.cache_scope)
        except Exception:  # the reply is done and sent: a summary is optional
            log.exception("%s: queueing the summary of the dropped turns failed", self.job.id)
