"""What one completion request really used, written once: its log line and its share of /metrics.

Two parties each know half of it. The worker thread sees what the engine did: prompt tokens, tokens
produced, the variant, the time to the first token. The route sees how the request ended for its client
(finished, an error code, client_gone, server_shutting_down) and how many tokens went out. The record is
written when both halves are in, from one set of numbers, so the token totals of /metrics always equal the
sum of the log lines, whatever ended the request. Neither half carries any prompt or completion text.

Every job ends on the worker side exactly once: after generating (whatever happened), or when it leaves the
queue unstarted (withdrawn by its route, or dropped by Worker.close). A job served upstream
(server/routing/) has the relay for its worker: the relay feeds the same half and ends it. When one side
passes a job to the other before its first token (the router's fallback and reroute), the side that lets go
either does not end the half, or announces the hand-over first (`handing_over`), so the half ends once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from models.types import FinishEvent, TokenEvent
from server.logs import RequestRecord

if TYPE_CHECKING:
    from server.serving.request import GenerationRequest


class RequestAccount:
    def __init__(
        self,
        *,
        id: str,
        endpoint: str,
        model: str,
        stream: bool,
        emit: Callable[[RequestRecord], None],
        route: Callable[[], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.id = id
        self.endpoint = endpoint
        self.model = model
        self.stream = stream
        self._emit = emit
        self._route = route  # where it was served, read when the record is written
        self._clock = clock
        self._started_at = clock()
        self._lock = threading.Lock()
        # the worker's half
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.variant: str | None = None
        self._first_ms: float | None = None  # TokenEvent.elapsed_ms of the first and the latest token
        self._last_ms: float | None = None
        self._finish: FinishEvent | None = None
        self._worker_done = False
        self._handovers = 0
        # the route's half
        self._outcome: str | None = None
        self._sent = 0
        self._written = False

    @classmethod
    def for_request(
        cls,
        request: GenerationRequest,
        *,
        id: str,
        model: str,
        emit: Callable[[RequestRecord], None],
        route: Callable[[], str | None] | None = None,
    ) -> RequestAccount:
        """The account of one request: its endpoint and whether it streams come from the request."""
        return cls(
            id=id, endpoint=request.endpoint, model=model, stream=request.show.stream, emit=emit, route=route
        )

    # -- the worker thread ----------------------------------------------------------------------------------
    def started(self, prompt_tokens: int, variant: str | None) -> None:
        self.prompt_tokens = prompt_tokens
        self.variant = variant

    def token(self, event: TokenEvent) -> None:
        self.completion_tokens += 1
        if self._first_ms is None:
            self._first_ms = event.elapsed_ms
        self._last_ms = event.elapsed_ms

    def finished(self, event: FinishEvent) -> None:
        self._finish = event
        self.prompt_tokens = event.usage.prompt_tokens
        self.completion_tokens = event.usage.completion_tokens
        self.variant = event.variant or self.variant

    def handing_over(self) -> None:
        """The serving side lets go of the job before it started and another takes it: the next
        worker_done (the old side's) does not end the worker's half; the new side's will."""
        with self._lock:
            self._handovers += 1

    def worker_done(self) -> None:
        with self._lock:
            if self._handovers:
                self._handovers -= 1
                return
            if self._worker_done:
                return
            self._worker_done = True
            ready = self._outcome is not None
        if ready:
            self._write()

    # -- the route ------------------------------------------------------------------------------------------
    def route_done(self, outcome: str, sent_tokens: int) -> None:
        """How the request ended for its client. The first call counts (a safety net may call again)."""
        with self._lock:
            if self._outcome is not None:
                return
            self._outcome = outcome
            self._sent = sent_tokens
            ready = self._worker_done
        if ready:
            self._write()

    @property
    def route_ended(self) -> bool:
        return self._outcome is not None

    def _write(self) -> None:
        with self._lock:
            if self._written:
                return
            self._written = True
        self._emit(self.record())

    def record(self) -> RequestRecord:
        finish = self._finish
        if finish is not None:
            ttft_ms = finish.timings.ttft_ms
            tok_s = finish.timings.predicted_per_second
        else:  # interrupted: measure from the tokens that did come
            ttft_ms = self._first_ms or 0.0
            span_ms = (self._last_ms or 0.0) - (self._first_ms or 0.0)
            tok_s = (self.completion_tokens - 1) / (span_ms / 1000) if span_ms > 0 else 0.0
        return RequestRecord(
            id=self.id,
            endpoint=self.endpoint,
            # the model that finished the reply (the governor may have moved it to another mid-way)
            model=(finish.model_id if finish is not None else None) or self.model,
            variant=self.variant,
            stream=self.stream,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            sent_tokens=self._sent,
            ttft_ms=ttft_ms,
            tokens_per_s=tok_s,
            outcome=self._outcome or "unknown",
            duration_ms=(self._clock() - self._started_at) * 1000,
            route=self._route() if self._route else None,
        )
