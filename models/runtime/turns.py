"""Several replies on one engine where a batch's rows cannot be trusted: they take turns.

Where a pass of several rows gives a row other logits than the row alone (BatchTraits.rows_alike False:
AVX2's int8 kernels), where a lone row would have to run padded (one_row_exact False, pad_batches off), or
where the graph runs one sequence at a time (converted before batches), the engine offers no batch
decoder; without this module its replies ran one after another, and a short request waited behind every
long reply queued before it. A TurnDecoder is driven exactly as a BatchDecoder (models.protocol
BatchDecoding: add, prefill, step, cancel, hand_over, apply_limits), so the server's batch loop
(joining, prefill chunks between passes, cancellation, the governor's step per pass, memory shrink) runs
turns unchanged. The difference is step(): instead of one pass over every decoding row, each decoding
reply takes its own decode step in turn, one token per reply per round.

The same text as alone. A reply's row is a [1, ...] view of the decoder's KV buffer (BatchKV.rows[b], the
layout a batch's prefill already runs alone), and its decode step is the one-reply engine's own
(Generation.advance, what engine.generate runs for every token after the first): its last token in a pass
of one row, on the same session, at the same position, over the same keys; where the session speculates
(DecoderSession.rows_exact), with a draft to verify, as alone. So without speculation a reply's tokens and
logprobs are bit for bit its text alone, whatever takes turns beside it, on every CPU (no pass has two
rows: nothing of what a batch's rows do on this CPU matters). With speculation the reply runs the same
steps it runs alone, but a speculating reply is not one fixed sequence even alone: its draft lengths
follow measured pass costs, and a verification row equals the plain one only up to summation order
(rows_exact), so there turns and alone agree as two lone runs agree (the tokens; the logprobs up to
summation order). Where a verification pass is not exact (rows_exact False: SmolLM2's q4-a8, whose int8
activations round its rows otherwise), nothing speculates, alone or in turns: bit for bit again.

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
from models.protocol import EngineLimits, Prompt
from models.runtime.batch import BatchDecoder
from models.types import BatchEvent, CancelToken, FinishReason, GenerationParams, Handover, PassStats

if TYPE_CHECKING:
    from models.runtime.engine import DecoderEngine


class TurnDecoder(BatchDecoder):
    """Up to `slots` replies of one engine, each advancing in its own one-row passes, one token each per
    round (see the module docstring)."""

    passes_rows = False  # no pass feeds more than one row: any graph that runs one sequence will do

    def __init__(self, engine: DecoderEngine, slots: int = 4) -> None:
        super().__init__(engine, slots, pad=False)

    def add(
        self,
        prompt: Prompt | None,
        params: GenerationParams,
        *,
        cancel: CancelToken | None = None,
        resume: Handover | None = None,
    ) -> int:
        """Take a row for a reply (BatchDecoder.add); it speculates as it would alone (speculation_for)."""
        slot = super().add(prompt, params, cancel=cancel, resume=resume)
        gen = self._held(slot).gen
        gen.spec = self.e.speculation_for(gen.r, gen.sess)
        return slot

    def prefill(self, slot: int | None = None) -> list[BatchEvent]:
        """One prefill chunk (BatchDecoder.prefill). A row that waits for one rebuilds its keys (a new
        prompt, a variant switch, a slid window): rows verified before are not its logits any more, as a
        reply alone drops them when it goes stale (Generation.advance)."""
        for row in self.rows:
            if row is not None and not row.decoding and row.gen.spec is not None:
                row.gen.spec.drop()
        return super().prefill(slot)

    def step(self) -> list[BatchEvent]:
        """One round: each decoding reply, lowest slot first, takes the decode step it takes alone
        (Generation.advance: its last token in a one-row pass of its own, with a draft to verify when it
        speculates, or no pass at all when its token was a verified draft) and gets its next token (or
        finish). A reply whose client left, even during another's pass, finishes before its own pass."""
        events = self._sweep()
        live = self.decoding
        if not live:
            return events
        t0 = time.perf_counter()
        ran = 0
        for b in live:
            row = self.rows[b]
            assert row is not None  # a reply ends only in its own turn
            gen = row.gen
            if gen.cancel.cancelled:
                events.append(self._finish(b, "cancelled"))
                continue
            gen.sess = self.e.session()
            try:
                gen.logits = gen.advance(gen.ctx[-1], gen.cap() - gen.r.generated)
            except Cancelled:
                events.append(self._finish(b, "cancelled"))
                continue
            except Exception as err:  # this reply fails, the others take their turns
                events.append(self._fail(b, err))
                continue
            if gen.spec is not None:  # another reply's pass or prefill chunk comes before its next token
                gen.spec.keep_rows()
            ran += 1
            events.extend(self._emit(b))
        # a round of n replies made n tokens (the cost meter's key), in n passes of one row or fewer
        self.last_pass = PassStats(ran, ran, time.perf_counter() - t0)
        return events

    def hand_over(self, slot: int, limits: EngineLimits) -> Handover:
        """BatchDecoder.hand_over, its drafts counted first (drafting starts afresh on the next model)."""
        self._held(slot).gen.end_speculation()
        return super().hand_over(slot, limits)

    def _finish(self, slot: int, finish: FinishReason) -> BatchEvent:
        """BatchDecoder's finish, the reply's drafts counted into its timings first, as alone."""
        row = self.rows[slot]
        if row is not None:
            row.gen.end_speculation()
        return super()._finish(slot, finish)
