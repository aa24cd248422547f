"""Several replies on one engine where a batch's rows cannot be trusted: they take turns.

Where a pass of several rows gives a row other logits than the row alone (BatchTraits.rows_alike False:
AVX2's int8 kernels), where a lone row would have to run padded (one_row_exact False, pad_batches off), or
where the graph runs one sequence at a time (converted before batches), the engine offers no batch
decoder; without this module its replies ran one after another, and a short request waited behind every
long reply queued before it. A TurnDecoder is driven exactly as a BatchDecoder (models.protocol
BatchDecoding: add, prefill, step, cancel, hand_over, apply_limits), so the server's batch loop
(joining, prefill chunks between passes, cancellation, the governor's step per pass, memory shrink) runs
turns unchanged. The one difference is step(): instead of one pass over every decoding row, it runs each
decoding row's own one-row pass in turn, one token per reply per round.

The same text as alone. A reply's row is a [1, ...] view of the decoder's KV buffer (BatchKV.rows[b], the
layout a batch's prefill already runs alone), and its decode pass is Generation.forward of its one last
token: the pass the one-reply engine (engine.generate, Generation._sync) runs for every plain decode step,
on the same session, at the same position, with the same keys before it. So a reply's tokens and
logprobs are bit for bit its text alone with speculation off, whatever takes turns beside it, on every
CPU (no measurement of what rows do is needed: no pass has more than one row). Speculation is off in
turns, as in a batch: a verification pass is exact only up to summation order (DecoderSession.rows_exact)
and its draft lengths follow measured pass costs, so a speculating reply's logprobs are not one fixed
sequence even alone; where the session speculates (rows_exact: not q4-a8, whose int8 activations round
the verification rows otherwise) a reply alone and the same reply in turns agree token for token and in
logprobs up to summation order, not bit for bit.

Fairness. A round gives every decoding reply one token (a prompt's prefill chunk runs between rounds,
server/serving/batch_loop.py), so a new reply's first token waits for at most its prefill chunks and one
round: one token of each running reply. Which waiting reply takes a free slot rotates over clients
(server/serving/turn_order.py).

A foreign decoder (a folder onnxruntime-genai laid out) keeps its own KV layout: no turns there (one reply
at a time, as before).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from models.errors import Cancelled
from models.runtime.batch import BatchDecoder
from models.types import BatchEvent, PassStats

if TYPE_CHECKING:
    from models.runtime.engine import DecoderEngine


class TurnDecoder(BatchDecoder):
    """Up to `slots` replies of one engine, each advancing in its own one-row passes, one token each per
    round (see the module docstring)."""

    passes_rows = False  # no pass feeds more than one row: any graph that runs one sequence will do

    def __init__(self, engine: DecoderEngine, slots: int = 4) -> None:
        super().__init__(engine, slots, pad=False)

    def step(self) -> list[BatchEvent]:
        """One round: each decoding reply, lowest slot first, feeds its last token in a one-row pass of its
        own and gets its next token (or finish). A reply whose client left, even during another's pass,
        finishes before its own pass, without one."""
        events = self._sweep()
        live = self.decoding
        if not live:
            return events
        t0 = time.perf_counter()
        ran = 0
        for b in live:
            row = self.rows[b]
            if row is None or not row.decoding:  # ended earlier in this round (cannot today: kept safe)
                continue
            gen = row.gen
            if gen.cancel.cancelled:
                events.append(self._finish(b, "cancelled"))
                continue
            gen.sess = self.e.session()
            try:
                # Generation._sync's plain decode step: the one token left, one position, this row alone
                gen.logits = gen.forward(gen.ctx[gen.pos : gen.pos + 1])
            except Cancelled:
                events.append(self._finish(b, "cancelled"))
                continue
            except Exception as err:  # this reply fails, the others take their turns
                events.append(self._fail(b, err))
                continue
            ran += 1
            events.extend(self._emit(b))
        # a round of n replies made n tokens in n passes of one row (the cost meter's key)
        self.last_pass = PassStats(ran, ran, time.perf_counter() - t0)
        return events
