"""The passes that generate started replies (worker thread): one reply through engine.generate, or up to
max_batch replies of one model at once, one token each per pass: decoded together in one forward pass (a
batch), or taking turns in one-row passes of their own where a batch's rows cannot share a pass (the engine
offers either through the same BatchDecoding protocol, and this loop drives both alike).

Between a batch's passes replies of its model join (their prompt a prefill chunk at a time), the governor's
step runs once for the batch (its idle holds the pace for the whole batch: the loop never sleeps itself) and
its limits apply to every row, cancelled rows end. Where a reply runs and
with what limits is server/serving/placement.py's; the queue it draws from is the worker's (`Lineup`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Protocol

from models.errors import Cancelled, SimmerError
from models.protocol import BatchDecoding, Engine, EngineLimits
from models.types import BatchEvent, CancelToken, FinishEvent, Handover, RowError
from server.serving.contracts import Gate
from server.serving.events import Failed
from server.serving.ladder import Target
from server.serving.placement import Placement
from server.serving.reply import Reply

log = logging.getLogger("simmer.server")

# How long a decoding reply may wait for its next token while new prompts are prefilled first: a one-off
# pause a reader barely notices, against a newcomer's first token waiting for every running reply's pass.
PREFILL_STALL_S = 0.2


class Lineup(Protocol):
    """The worker's side of a batch: where the next replies come from and where moved ones wait."""

    def next_for(self, engine: Engine) -> Reply | None:
        """The next reply for `engine`, started: a moved one, else the queue's next (by client) when it runs
        there."""
        ...

    def move(self, reply: Reply) -> None:
        """The reply goes on on another model once the running batch is done."""
        ...

    def between_passes(self) -> None:
        """The worker's chores between two passes: an engine built beside it goes into the pool, and jobs
        whose model is not loaded start waiting for its load (serving/load_waits.py)."""
        ...

    def between_tokens(self) -> None:
        """Other work that waits, in a slice about as long as one of the running replies' passes (an
        embedding job's next rows)."""
        ...


class BatchLoop:
    def __init__(self, placement: Placement, gate: Gate, lineup: Lineup) -> None:
        self.placement = placement
        self.gate = gate
        self.lineup = lineup

    def serve(self, reply: Reply) -> None:
        """A started reply: in a batch with the replies of its model that follow it, or alone when its
        engine cannot batch."""
        try:
            batch = batch_decoder(reply.engine, self.placement.rows())
        except Exception as err:  # a decoder that cannot be built fails this reply, never the worker thread
            reply.fail(err)
            return
        if batch is None:
            self.generate_alone(reply)
        else:
            self.run_batch(batch, reply)

    def generate_alone(self, reply: Reply) -> None:
        """The reply through engine.generate, token by token, handed over when the governor's rung moves."""
        job, placement, metrics = reply.job, self.placement, reply.desk.metrics
        try:
            while True:
                handover: Handover | None = None
                events = reply.engine.generate(
                    reply.prompt,
                    job.request.params,
                    cancel=job.cancel,
                    step_hook=placement.step_hook(job, reply.engine, reply.blocked),
                    resume=reply.resume,
                )
                for event in events:
                    if isinstance(event, Handover):
                        handover = event
                        break
                    reply.deliver(event)
                    self.lineup.between_passes()
                    self.lineup.between_tokens()
                if handover is None:
                    break
                # the old model's generation holds its session: gone first, so that unloading the model
                # (shed_above, memory pressure) hands its memory back now, not after the reply
                del events
                reply.engine, reply.prompt = placement.hand_over(job, reply.engine, handover, reply.blocked)
                reply.resume = handover
        except SimmerError as err:
            job.sink(Failed(err))
        except Exception as err:
            log.exception("generation failed for %s", job.id)
            job.sink(Failed(err))
        finally:
            if metrics:
                metrics.add_busy(time.monotonic() - reply.started)
            reply.close()

    def run_batch(self, batch: BatchDecoding, first: Reply) -> None:
        """Up to max_batch replies of `first`'s model, one token each per forward pass, until all are done.
        Between passes: replies of the same model join from the queue (their prompt a prefill chunk at a
        time, alternating with the decode passes), the governor's step runs once for the batch and its
        limits apply to every row, cancelled rows end. A job for another model waits at the head of the
        queue until the batch is done (FIFO), and so does a reply the governor moves to another model."""
        placement, metrics = self.placement, first.desk.metrics
        rows: dict[int, Reply] = {}
        token = CancelToken()  # the governor's waits wake when any row's client leaves
        started = time.monotonic()
        placement.batch, placement.batch_events = batch, []
        prefill_next = True
        chunk_s = 0.0  # how long the last prefill chunk took: what the next one may take
        try:
            self._join(batch, first, rows, token)
            while rows:
                self.lineup.between_passes()
                self.lineup.between_tokens()
                self._admit(batch, rows, token)
                events = placement.take_batch_events() + self._sweep(batch, rows)
                if token.cancelled:  # those rows are gone: a fresh token for the ones left
                    token = CancelToken()
                    for reply in rows.values():
                        reply.job.cancel.on_cancel(token.cancel)
                if rows:
                    try:
                        governed = self.gate.before_step(token)
                    except Cancelled:
                        governed = None  # a client left during a pause or an idle: its row ends next
                    if (
                        governed is not None
                        or self._stand_ins_over(rows)
                        or placement.held_back(batch.engine)
                    ):
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
                        # the gate paces the batch at its next step: this pass made one token a reply
                        self.gate.note_pass(ran.replies if ran is not None else 0)
                self._dispatch(rows, events)
                if not rows:  # every row ended in this pass: the queue's next replies of the model go on here
                    self._admit(batch, rows, token)
        except Exception as err:  # the gate (device overheated, paused too long) or a bug: every row fails
            for slot, reply in list(rows.items()):
                with contextlib.suppress(Exception):
                    batch.cancel(slot)
                del rows[slot]
                reply.fail(err)
        finally:
            placement.batch = None
            if metrics:
                metrics.add_busy(time.monotonic() - started)

    @staticmethod
    def _may_stall(batch: BatchDecoding, rows: dict[int, Reply], chunk_s: float) -> bool:
        """Another prefill chunk before the next decode pass: while no decoding reply would have waited
        PREFILL_STALL_S for its next token by the end of it (a chunk taken to last as long as the last one).
        Prompts that arrive together (short ones, a chunk each) then get their first token before the
        running replies' next one or two, as llama-server prefills them in one pass; a long prompt's chunks
        still alternate with decode passes, so a running reply never waits more than one chunk."""
        now = time.monotonic()
        waited = [now - (rows[b].last or now) for b in batch.decoding if b in rows]
        return not waited or max(waited) + chunk_s < PREFILL_STALL_S

    def _join(self, batch: BatchDecoding, reply: Reply, rows: dict[int, Reply], token: CancelToken) -> None:
        """The reply takes a row (its prompt runs in later prefill chunks)."""
        try:
            slot = batch.add(
                reply.prompt, reply.job.request.params, cancel=reply.job.cancel, resume=reply.resume
            )
        except Exception as err:  # its prompt does not fit, a bad grammar: this reply alone fails
            reply.fail(err)
            return
        rows[slot] = reply
        reply.job.cancel.on_cancel(token.cancel)

    def _admit(self, batch: BatchDecoding, rows: dict[int, Reply], token: CancelToken) -> None:
        """Free rows take replies of the batch's model: moved ones first, then the queue's next (the client
        with the fewest replies running first) while it is placed on this model (and the governor lets new
        work start)."""
        engine, placement = batch.engine, self.placement
        while batch.free > 0 and len(batch.active) < placement.rows():  # fewer rows under memory pressure
            reply = self.lineup.next_for(engine)
            if reply is None:
                return
            if reply.engine is not engine:  # placed elsewhere after all (the governor moved meanwhile)
                self.lineup.move(reply)
                return
            self._join(batch, reply, rows, token)
            if reply.governed:  # the gate's new limits came with the job: they apply to every row
                placement.batch_events += self._govern(
                    batch, rows, placement.governed or EngineLimits(), token
                )

    @staticmethod
    def _sweep(batch: BatchDecoding, rows: dict[int, Reply]) -> list[BatchEvent]:
        """Rows whose client left end now (their slot free for the next reply)."""
        return [(slot, batch.cancel(slot)) for slot, r in list(rows.items()) if r.job.cancel.cancelled]

    def _stand_ins_over(self, rows: dict[int, Reply]) -> bool:
        """A row runs on a stand-in whose awaited model is loaded now (placement.stand_in_over)."""
        over = self.placement.stand_in_over
        return any(over(r.job, r.engine, r.blocked) for r in rows.values() if r.engine is not None)

    def _govern(
        self, batch: BatchDecoding, rows: dict[int, Reply], governed: EngineLimits | None, token: CancelToken
    ) -> list[BatchEvent]:
        """The governor's new limits for every row (None: unchanged, a stand-in's model is loaded): a row
        placed on another model is handed over (it goes on there after this batch), the others get the
        limits together (a variant switch re-prefills them)."""
        placement = self.placement
        if governed is not None:
            placement.governed = governed
        engine = batch.engine
        stay: Target | None = None
        for slot, reply in list(rows.items()):
            target = placement.placed(reply.job, placement.governed, reply.blocked)
            if target.model_id == engine.model_id:
                stay = stay or target
                continue
            log.info(
                "%s: the governor moves the reply to %s (%s)", reply.job.id, target.model_id, target.reason
            )
            handover = batch.hand_over(slot, placement.limits_for(target))
            del rows[slot]
            reply.engine, reply.prompt = placement.hand_over(reply.job, engine, handover, reply.blocked)
            reply.resume = handover
            if reply.engine is engine:  # the other model could not load: the reply stays in the batch
                stay = stay or Target(engine.model_id, target.variant, "handover")
                self._join(batch, reply, rows, token)
            else:
                self.lineup.move(reply)
        if stay is not None:
            placement.sync_limits(engine, stay)
        return placement.take_batch_events()

    @staticmethod
    def _dispatch(rows: dict[int, Reply], events: list[BatchEvent]) -> None:
        for slot, event in events:
            reply = rows.get(slot)
            if reply is None:
                continue
            if isinstance(event, RowError):
                del rows[slot]
                reply.fail(event.error)
                continue
            reply.deliver(event)
            if isinstance(event, FinishEvent):
                del rows[slot]
                reply.close()


def batch_decoder(engine: Engine | None, slots: int) -> BatchDecoding | None:
    """The engine's batch decoder of `slots` rows, or None when it serves one reply at a time (an engine
    that offers none, a graph of one sequence, or one slot: memory pressure, whose decoder then goes)."""
    if engine is None:
        return None
    if slots <= 1:
        engine.shrink_batch(1)
        return None
    return engine.batch_decoder(slots)
