"""Connections that never finish a request do not take the server down.

uvicorn closes an idle keep-alive connection after a few seconds, but nothing else: a client that sends its
headers a byte at a time, or a chunked body that never ends, holds its socket for ever. A few hundred of them
use up the process's file descriptors (a phone allows 1,024); accept() then fails, asyncio logs that with a
traceback thousands of times a second, and /health stops answering. So, for every connection:
- the request head must be complete within `header_timeout_s` of the connection (or of the previous
  response, on a keep-alive connection), else the connection is closed;
- the body must be complete within `body_timeout_s` of the head, unless the reply has started;
- at most `max_connections` are open. A new connection beyond that closes the oldest unfinished one: one
  still sending its request head after HEAD_GRACE_S, else one that has sent nothing for SILENT_GRACE_S
  since it was opened or since its last reply (silence costs nothing to start again: 300 idle connections
  reset an honest upload of a slow client), else one still sending its body before any reply (a request
  that costs more to start again), else the oldest. Those are slow clients', not requests at work, and a
  fresh request such as /health gets the grace to send its first bytes and its head: so it gets in.
  When every connection is at work, the new one is closed.
  The cap is derived from the open-file limit (fd_budget), keeping a reserve of descriptors; asyncio accepts
  a limited burst of connections in one go (uvicorn's backlog), so it cannot overrun the limit before the
  cap sees them, while the kernel still queues LISTEN_QUEUE.
And the asyncio log line for a failed accept() is written at most once per LOG_EVERY_S, with a count.

The guard lives in a subclass of uvicorn's h11 protocol (`guarded_protocol`), handed to uvicorn.Config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("simmer.server")

LISTEN_QUEUE = 2048  # the kernel's queue of connections not yet accepted
LOG_EVERY_S = 10.0
HEAD_GRACE_S = 1.0  # a new connection's time to send its request head before it may make room for others
SILENT_GRACE_S = 0.1  # a new connection's time to send its first byte (a local client sends it at once)
ACCEPT_FAILED = "socket.accept() out of system resource"


@dataclass(frozen=True)
class FdBudget:
    cap: int  # connections open at most
    burst: int  # connections asyncio accepts in one go (uvicorn's backlog) before any connection_made runs


def fd_budget(max_connections: int | None, soft_limit: int | None = None) -> FdBudget:
    """What the open-file limit allows. asyncio accepts a burst of sockets before the cap sees any of them,
    and a closed socket is released a turn of the event loop later: a few bursts of descriptors are kept
    apart for that, and 64 for model files, logs and a pull's pipes. The burst grows with the limit (more
    accepted per turn of the loop: a flood queued in the kernel drains faster)."""
    if soft_limit is None:
        soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit == resource.RLIM_INFINITY:
        soft_limit = 65536
    burst = min(128, max(8, soft_limit // 16))
    cap = max_connections if max_connections is not None else max(16, soft_limit - (4 * burst + 64))
    return FdBudget(cap=max(1, cap), burst=burst)


class ConnectionGuard:
    """The open connections of one server, the unfinished ones among them by phase (oldest first: still
    sending a request head, or a body before any reply), and the limits. Used from the event loop only."""

    def __init__(self, *, cap: int, header_timeout_s: float, body_timeout_s: float) -> None:
        self.cap = cap
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.open: set[GuardedH11] = set()
        # phase ("header", "body") -> its connections and when each entered it, the oldest first
        self.unfinished: dict[str, dict[GuardedH11, float]] = {"header": {}, "body": {}}
        # waiting for a head and not one byte of it yet, oldest first: since when
        self.silent: dict[GuardedH11, float] = {}
        self.closed = {"evicted": 0, "refused": 0, "header_timeout": 0, "body_timeout": 0}
        self._reported = dict(self.closed)
        self._reported_at = 0.0

    def admit(self, conn: GuardedH11) -> bool:
        """Room for `conn` (making it by closing the oldest unfinished connection)?"""
        if len(self.open) >= self.cap:
            victim = self._victim(time.monotonic())
            if victim is None:
                self.count("refused")
                return False
            self.forget(victim)
            victim.close_quietly()
            self.count("evicted")
        self.open.add(conn)
        return True

    def _victim(self, now: float) -> GuardedH11 | None:
        """The connection to close for a new one (the module docstring's order); None: refuse the new one
        (every open connection is at work)."""
        heads, bodies = self.unfinished["header"], self.unfinished["body"]
        oldest_head = next(iter(heads.items()), None)
        if oldest_head is not None and now - oldest_head[1] >= HEAD_GRACE_S:
            return oldest_head[0]
        oldest_silent = next(iter(self.silent.items()), None)
        if oldest_silent is not None and now - oldest_silent[1] >= SILENT_GRACE_S:
            return oldest_silent[0]
        return next(iter(bodies), None) or (oldest_head[0] if oldest_head else None)

    def forget(self, conn: GuardedH11) -> None:
        self.open.discard(conn)
        self.forget_unfinished(conn)

    def forget_unfinished(self, conn: GuardedH11) -> None:
        for phase in self.unfinished.values():
            phase.pop(conn, None)
        self.silent.pop(conn, None)

    def count(self, reason: str) -> None:
        self.closed[reason] += 1
        now = time.monotonic()
        if now - self._reported_at >= LOG_EVERY_S:
            news = {k: v - self._reported[k] for k, v in self.closed.items() if v != self._reported[k]}
            self._reported, self._reported_at = dict(self.closed), now
            log.warning(
                "closed unfinished or surplus connections (%s; %d open, cap %d)",
                ", ".join(f"{k} {v}" for k, v in news.items()),
                len(self.open),
                self.cap,
            )


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the guard's timeouts and cap (see the module docstring)."""

    guard: ConnectionGuard  # set on the subclass guarded_protocol() makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = ""  # "header" or "body": what the running deadline waits for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            self.close_quietly()
            return
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        self._cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.guard.silent.pop(self, None)
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def close_quietly(self) -> None:
        self._cancel()
        if not self.transport.is_closing():
            self.transport.close()

    # -- where the connection is, and what it may still take --------------------------------------------
    def _track(self) -> None:
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # waiting for a request head (a new connection, or a keep-alive one)
            self._unfinished("header", self.guard.header_timeout_s)
        elif state is h11.SEND_BODY and not (self.cycle is not None and self.cycle.response_started):
            self._unfinished("body", self.guard.body_timeout_s)
        else:  # at work: the request is in (or its reply under way)
            self.guard.forget_unfinished(self)
            self._cancel()

    def _unfinished(self, phase: str, seconds: float) -> None:
        if self._phase != phase:
            self.guard.forget_unfinished(self)  # a new phase: at the back of its line
            if phase == "header" and not self.conn.trailing_data[0]:
                self.guard.silent[self] = time.monotonic()  # nothing of the next head has come yet
        self.guard.unfinished[phase].setdefault(self, time.monotonic())
        self._arm(phase, seconds)

    def _arm(self, phase: str, seconds: float) -> None:
        if self._phase == phase and self._deadline is not None:
            return  # the deadline runs from the start of the phase, not from the last byte
        self._cancel()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, ""

    def _expired(self, phase: str) -> None:
        self._deadline, self._phase = None, ""
        if self.transport.is_closing():
            return
        if phase == "body" and self.cycle is not None and self.cycle.response_started:
            return  # the reply is under way: the rest of the body is not needed for it
        self.guard.count(f"{phase}_timeout")
        self.guard.forget(self)
        self.transport.close()


def widen_listen_queue(listeners: list[Any]) -> None:
    """The kernel's queue of connections not yet accepted, LISTEN_QUEUE long, on sockets that listen with
    the accept burst as backlog (listen() again on a listening socket only changes the queue's length)."""
    for listener in listeners:
        with socket.socket(fileno=os.dup(listener.fileno())) as sock:
            sock.listen(LISTEN_QUEUE)


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11]:
    """The protocol class for uvicorn.Config(http=...), bound to one server's guard."""
    return type("GuardedH11", (GuardedH11,), {"guard": guard})


def rate_limited_exception_handler() -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event-loop exception handler that writes a failed accept() once per LOG_EVERY_S (with how many
    there were) and passes everything else to asyncio's default handler."""
    state = {"at": -LOG_EVERY_S, "since": 0}

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        state["since"] += 1
        now = time.monotonic()
        if now - state["at"] < LOG_EVERY_S:
            return
        log.error(
            "accept() failed %d time(s) in the last %.0f s: %s (the open-file limit is too low for the "
            "connections; SIMMER_MAX_CONNECTIONS caps them)",
            state["since"],
            LOG_EVERY_S,
            context.get("exception"),
        )
        state["at"], state["since"] = now, 0

    return handle
