"""What the worker is driven through: the job the flow and the router submit, the sink its events go to, and
the protocols the worker is given (its gate, the prompt window, idle work, metrics).

The router (server/routing/), the dialects and server/api/common/ import this module, never the worker
(import-linter checks it): they submit jobs and read events, and need none of its internals. Only the wiring
(server/app.py, server/launch.py, server/api/context.py) names the `Worker` class, because it builds it or
hands it to the handlers.

The governor seam (kept small on purpose), called on the worker thread:
- `gate.before_job(cancel, enqueued_at) -> EngineLimits | None` runs before a job starts. It may hold new
  work while the governor pauses it (bounded: it raises once the job has waited too long) and returns new
  limits or None for "unchanged".
- `gate.before_step(cancel) -> EngineLimits | None` runs between every token / prefill chunk (as the
  engine's step hook). It may idle (device throttling; the pace, which nothing else waits for: a gate
  that paces holds it here, for a batch's every token), block while the running reply is paused (the
  job's CancelToken interrupts that wait when the client leaves), raise (device killed), and returns new
  limits or None.
- a batch asks two more: `gate.pauses_new` (new work waits: no reply joins the running ones) and
  `gate.note_pass(tokens)` (what each pass made, for the gate's meter and pace).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from governor.background import BackgroundWork
from models.protocol import Engine, EngineLimits
from models.types import CancelToken, ToolUse

if TYPE_CHECKING:
    from server.serving.accounting import RequestAccount
    from server.serving.ladder import Target
    from server.serving.model_pool import ModelPool
    from server.serving.request import GenerationRequest
    from server.serving.summary import Windowed


class Gate(Protocol):
    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None: ...
    def before_step(self, cancel: CancelToken) -> EngineLimits | None: ...
    def before_batch(self, cancel: CancelToken, enqueued_at: float, pass_s: float | None) -> int | None:
        """Before each batch of an embedding job (pass_s: the job's last pass, None before its first): the
        governor's pause, the device's state and the CPU budget's idle, but never new engine limits (those
        are the generation engine's; taken here, they would not reach it). Returns the governor's thread
        limit now, for the encoder's pass (None: no limit)."""
        ...

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

    def note_aside(self, wall_s: float, cpu_s: float) -> None:
        """Work between two steps that is not the engine's (an embedding slice): the pace counts its time,
        the meter leaves it out of the step's cost."""
        ...

    @property
    def rung(self) -> str | None:
        """The model of the governor's rung now (None: no ladder, no governor). Read from any thread."""
        ...

    @property
    def background(self) -> BackgroundWork:
        """Whether heavy work nobody waits for (a summary, a pull's conversion) may run now, and why."""
        ...


class NoGate:
    """The default gate: never pauses, never changes limits."""

    memory_pressure = False
    pauses_new = False
    rung = None
    background = BackgroundWork(True, "no governor")

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> None:
        return None

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        return None

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        return None

    def before_batch(self, cancel: CancelToken, enqueued_at: float, pass_s: float | None) -> int | None:
        return None

    def note_pass(self, tokens: int) -> None:
        return None

    def note_aside(self, wall_s: float, cpu_s: float) -> None:
        return None


class Window(Protocol):
    """A chat job's prompt through a sliding window that may carry a summary (server/serving/summary.py)."""

    def window(
        self,
        engine: Engine,
        messages: list[dict],
        *,
        truncate: bool,
        reserve: int,
        tools: ToolUse | None,
        scope: str = "",
    ) -> Windowed: ...

    def dropped(self, messages: list[dict], windowed: Windowed, turns: int, scope: str = "") -> None:
        """After the reply: its window dropped `turns` turns of windowed.messages, some during the reply."""
        ...


class IdleWork(Protocol):
    """Work for an idle worker (never on a reply's critical path), heavy enough to wait while the governor
    says background work waits (Gate.background)."""

    @property
    def name(self) -> str: ...  # what /v1/thermal lists while it waits

    def pending(self) -> bool: ...
    def run(self, pool: ModelPool, cancel: CancelToken) -> None:
        """On the worker thread; return soon after `cancel` fires (a job arrived)."""
        ...


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
    client: str = ""  # who sent it, for its turn beside other clients' replies (serving/turn_order.py)

    def worker_done(self) -> None:
        if self.account is not None:
            self.account.worker_done()


# (job, the governor's latest limits, models this job could not move to) -> where the job runs
Placer = Callable[[Job, EngineLimits | None, set[str]], "Target"]

# (job, where it was placed, models it could not move to, whether a model is loaded or will be before the
# placed one) -> a rung that starts the job while its model loads
StandIn = Callable[[Job, "Target", set[str], Callable[[str], bool]], "Target | None"]

UNBOUNDED_REPLY_TOKENS = 256  # a reply without max_tokens, for estimates (the prompt's reserve uses it too)


def reply_tokens(job: Job) -> int:
    """The tokens a job's reply may make: its max_tokens, or UNBOUNDED_REPLY_TOKENS without one."""
    return job.request.params.max_tokens or UNBOUNDED_REPLY_TOKENS
