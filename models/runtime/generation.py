"""One reply on one engine: a prompt, or a reply another model started, through prefill, decode, sampling and
streaming, to its finish or its handover.

The path reads top to bottom, gpt-fast style:
    run: pick a KV slot (longest common prefix) -> prefill the rest in chunks -> decode one token at a time
    -> sample -> detokenize -> stop matcher -> TokenEvent ... FinishEvent
Between prefill chunks and between decode tokens the reply checks the cancel token and calls the step hook,
which may block (a governor pause), idle (the governor's pace: the gate, server/serving/governor_gate.py, is
the one place that sleeps to hold it; the reply itself never waits) or return new limits (threads,
variant, context cap, max tokens, spinning): a new variant means another session and a re-prefill of the
token history, so the reply continues coherently.
The engine (models/runtime/engine.py) holds what outlives a reply: the model, its sessions, its KV slots and
limits. A batch of replies (models/runtime/batch.py) takes the same steps per row (`forward`, `next_token`,
`slide_window`, `flush`, `finish_event`, `handover`); replies taking turns (models/runtime/turns.py) take
run()'s own decode step too (`advance`, speculation included, and `end_speculation`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from models.errors import Cancelled, ContextLengthExceeded, SimmerError
from models.protocol import EngineLimits, Prompt, StepHook
from models.runtime.constraint import ConstraintVocabulary
from models.runtime.reply import ReplyState
from models.runtime.session import (
    DecoderSession,
    GeneralDecoderSession,
    cold_pass,
    exact_prefix,
    new_run_options,
    note_write,
    prefill_end,
)
from models.runtime.speculative import Speculation
from models.runtime.tools import CallReader
from models.runtime.window import newest_turns, window_split
from models.types import (
    CancelToken,
    FinishEvent,
    FinishReason,
    GenerationParams,
    Handover,
    TokenEvent,
    ToolCallDelta,
    TopLogprob,
)

if TYPE_CHECKING:
    from models.runtime.engine import DecoderEngine

log = logging.getLogger("simmer.engine")


@dataclass
class KVSlot:
    cache: Any  # KVCache, or for a foreign decoder SharedKV / GrowingKV
    variant: str
    last_used: float = field(default_factory=time.monotonic)
    # Whose prompt the KV holds (GenerationParams.cache_scope): a prefix is reused only within its scope, so
    # neither cached_tokens nor the prefill time tells one client how much of another's prompt it guessed.
    scope: str = ""

    @property
    def tokens(self) -> list[int]:
        return self.cache.tokens


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable_prefix(
    cache: Any, ids: Sequence[int], positions_exact: bool, passes_exact: bool, chunk: int
) -> int:
    """How much of `cache` a prompt `ids` reuses: the prefix they share, leaving at least one token to
    prefill (its logits are the first token's). Where a one-position pass is not exact (a session's
    positions_exact), only keys a cold prefill would write count (exact_prefix) and two tokens are left, so
    the last prefill pass is one of several positions, as a cold prefill's is. Where passes of several
    positions depend on their number (session.Exactness.passes: ARM's kernels), whole prefill chunks of
    `chunk` positions (session.cold_pass): the warm prefill then runs from a chunk's start the passes a
    cold prefill runs from there."""
    n = common_prefix(cache.tokens, ids)
    if positions_exact and passes_exact:
        return max(0, min(n, len(ids) - 1))
    n = max(0, min(n, exact_prefix(cache), len(ids) - (1 if positions_exact else 2)))
    return n if passes_exact else n - n % chunk


def positions_exact(sess: object) -> bool:
    """Whether a session's one-position passes give what a pass of several does (session.py)."""
    return bool(getattr(sess, "positions_exact", True))


def passes_exact(sess: object) -> bool:
    """Whether a session's passes of several positions give the same whatever their number (session.py)."""
    return bool(getattr(sess, "passes_exact", True))


def terminator(options: Any) -> Callable[[], None]:
    """A cancel callback that stops a run in progress through its RunOptions."""

    def terminate() -> None:
        options.terminate = True

    return terminate


class _Full(Exception):
    """A reply handed to a model whose context it no longer fits, without truncation: it ends (length)."""


class _Switch(Exception):
    """Raised at a checkpoint when the step hook names another model."""

    def __init__(self, limits: EngineLimits) -> None:
        super().__init__(limits.model_id)
        self.limits = limits


class Generation:
    """One request's state on one engine. Kept apart from the engine so the engine holds only long-lived
    state; what outlives this engine (a reply handed to another model) is in `self.r` (ReplyState)."""

    def __init__(
        self,
        engine: DecoderEngine,
        prompt: Prompt | None,
        params: GenerationParams,
        cancel: CancelToken,
        hook: StepHook | None,
        resume: Handover | None = None,
    ) -> None:
        self.e = engine
        self.params = params
        self.cancel = cancel
        self.hook = hook
        self.resumed = resume is not None
        if resume is None:
            if prompt is None:
                raise ValueError("generate() needs a prompt or a Handover to resume")
            self.r = ReplyState.start(
                params,
                engine.tokenizer,
                engine.tokenizer_key,
                prompt.ids,
                prompt.truncated,
                prompt.chat,
                prompt.dropped,
            )
        else:
            self.r = resume.state
            if self.r.tokenizer_key != engine.tokenizer_key:
                if prompt is None:
                    raise ValueError("a reply from another vocabulary resumes from a continuation_prompt()")
                self.r.retokenized(engine.tokenizer, engine.tokenizer_key, prompt.ids, prompt.reply_tokens)
                self.r.truncated = self.r.truncated or prompt.truncated
        self.sess: DecoderSession | GeneralDecoderSession | None = None
        self.run_options = new_run_options()
        self.slot: KVSlot | None = None
        self.pos = 0  # ctx[:pos] is in the KV slot
        self.stale = False  # the KV slot must be rebuilt from ctx (variant switch, sliding window)
        # Speculation lives with this generation, not the ReplyState: a reply handed to another model
        # starts drafting afresh there (its own session, rows, costs; maybe another vocabulary).
        self.spec: Speculation | None = None
        self.max_tokens = params.max_tokens  # the reply's bound (run() adds the sliding window's)
        self.t_decode = time.perf_counter()  # when this engine's decode began (after the prefill)

    @property
    def ctx(self) -> list[int]:
        return self.r.ctx

    # step hook + cancel, between every chunk and token
    def _checkpoint(self) -> None:
        if self.cancel.cancelled:
            raise Cancelled("the request was cancelled")
        if self.hook is None:
            return
        limits = self.hook()
        if self.cancel.cancelled:
            raise Cancelled("the request was cancelled")
        if limits is None:
            return
        if limits.model_id is not None and limits.model_id != self.e.model_id:
            raise _Switch(limits)
        old = self.e.session_key()
        if self.e.apply_limits(limits):
            self.stale = True  # the KV cache was computed by other weights
        if self.e.session_key() != old:
            self.sess = None  # not held while the engine evicts it and builds the next one (session)
            self.sess = self.e.session()
        if len(self.ctx) > self.e.context_length and self.params.truncate:
            self.slide_window()

    def slide_window(self) -> None:
        """Context full (or the cap lowered): a sliding window. A chat prompt drops whole turns from the
        front, as the request's window does (chat_prompt): the system message and the newest turns that fit
        with the reply so far and room for the rest of it (up to half the context, so the window does not
        slide again at once). When no whole turn can go (a raw text, one huge turn, a reply that leaves no
        room for its question), keep the newest half of the context, tokens. The KV is rebuilt from the new
        context (stale); the reply's text, ids and sampler go on untouched."""
        e, r = self.e, self.r
        w = r.window
        if w is not None:
            system, turns = window_split(w.messages)
            reply = self.ctx[w.head :]
            left = (
                min(x for x in (self.max_tokens, e.max_tokens_limit, 1 << 30) if x is not None) - r.generated
            )
            room = e.context_length - min(max(left, 1), e.context_length // 2) - len(reply)
            try:
                best, _ = newest_turns(
                    turns,
                    w.dropped + 1,
                    lambda start: e.chat_ids(system + turns[start:], w.tools),
                    lambda candidate: len(candidate) <= room,
                )
            except SimmerError:  # a template that refuses the shorter history: the reply must go on
                best = None
            if best is not None:
                start, ids = best
                log.info(
                    "context cap %d reached: sliding window, %d more turns dropped",
                    e.context_length,
                    start - w.dropped,
                )
                r.ctx = [*ids, *reply]
                w.dropped, w.head = start, len(ids)
                r.turns_dropped = start
                r.truncated = True
                self.stale = True
                return
        log.info("context cap %d reached: sliding window (tokens)", e.context_length)
        r.ctx = self.ctx[-(e.context_length // 2) :]
        r.window = None  # a message cut mid-way: the context's turns can no longer be told apart
        r.truncated = True
        self.stale = True

    def forward(self, ids: Sequence[int], keep: int = 1) -> np.ndarray:
        assert self.sess is not None and self.slot is not None
        cache = self.slot.cache
        if self.pos + len(ids) > cache.capacity:  # the cap was raised above this slot's buffer
            bigger = self.e.new_cache(max(self.e.context_length, self.pos + len(ids)))
            bigger.copy_prefix_from(cache, self.pos)
            self.slot.cache = cache = bigger
        chunk, sess = self.e.prefill_chunk, self.sess
        note_write(
            cache,
            self.pos,
            len(ids),
            cold_pass(self.pos, len(ids), chunk, positions_exact(sess), passes_exact(sess)),
        )
        try:
            fed = np.asarray(ids, dtype=np.int64)
            if keep > 1:  # a verification pass: a row of logits per fed token
                logits = self.sess.run_last(  # type: ignore[union-attr]
                    fed, cache, self.pos, keep, self.run_options
                )
            else:
                logits = self.sess.run(fed, cache, self.pos, self.run_options)
        except Exception as e:
            cache.tokens = []  # partially written: never reuse
            if self.cancel.cancelled:
                raise Cancelled("the request was cancelled") from e
            raise
        del cache.tokens[self.pos :]
        cache.tokens.extend(ids)
        self.pos += len(ids)
        self.e.positions_run += len(ids)
        return logits

    def _sync(self) -> np.ndarray:
        """Bring the KV slot up to all of ctx, in prefill chunks, and return the last position's logits.
        Between chunks the step hook runs; a variant switch there restarts from position 0."""
        logits = None
        first = True
        while True:
            if self.stale:
                assert self.slot is not None
                self.stale = False
                self.pos = 0
                self.slot.cache.tokens = []
                self.slot.variant = self.e.variant
            if self.pos >= len(self.ctx) and logits is not None:
                return logits
            if not first:
                self._checkpoint()
                if self.stale:
                    continue
            first = False
            end = prefill_end(self.pos, len(self.ctx), self.e.prefill_chunk, positions_exact(self.sess))
            logits = self.forward(self.ctx[self.pos : end])

    def advance(self, token: int, left: int) -> np.ndarray:
        """The logits after `token` (just appended to ctx). Speculating, a verified drafted token's row is
        already there; otherwise the token is fed with a new draft of at most left - 1 tokens, in one pass.
        Positions past a rejected draft token are overwritten by the next pass (no copy)."""
        spec = self.spec
        if spec is None:
            return self._sync()
        row = None if self.stale else spec.next_row(token)
        if row is not None:
            self.pos += 1  # its keys and values were written by the verification pass
            return row
        assert self.slot is not None
        del self.slot.cache.tokens[self.pos :]  # the rejected draft tokens
        if self.stale or len(self.ctx) - self.pos != 1 or not getattr(self.sess, "rows_exact", False):
            spec.drop()
            return self._sync()
        room = min(self.e.context_length, self.slot.cache.capacity) - len(self.ctx)
        draft = spec.draft(self.r.history, min(room, left - 1))
        t0 = time.perf_counter()
        logits = self.forward([self.ctx[self.pos], *draft], keep=len(draft) + 1)
        spec.verified(draft, logits, time.perf_counter() - t0)
        if not draft:
            return logits
        self.pos -= len(draft)  # only the fed token is part of the reply yet
        return logits[0]

    def _prefill(self) -> None:
        """The prompt, or after a handover the reply's context so far (the KV cache built once for it)."""
        e, r = self.e, self.r
        if not self.resumed and len(self.ctx) >= e.context_length:
            raise ContextLengthExceeded(
                f"This model's context is {e.context_length} tokens; the prompt has {len(self.ctx)} tokens.",
                param="messages",
                context_length=e.context_length,
                prompt_tokens=len(self.ctx),
            )
        while self.resumed and len(self.ctx) >= e.context_length:  # a smaller model took the reply over
            if not self.params.truncate:
                raise _Full
            self.slide_window()
        self.slot, cached = e.slot_for(self.ctx, self.params.cache_scope)
        self.pos = cached
        t0 = time.perf_counter()
        self.logits = self._sync().copy()
        if not self.resumed:
            r.usage.cached_tokens = cached
            r.timings.prompt_n = len(self.ctx) - cached
            r.timings.prompt_ms = (time.perf_counter() - t0) * 1000

    def start_constraint(self) -> None:
        """The reply's grammar and tool-call reader: made by the engine that starts the reply, kept across
        a handover (they read text and bytes), the grammar's state re-spelled over a new vocabulary."""
        e, p, r = self.e, self.params, self.r
        if not self.resumed:
            r.constraint = e.constraint(p)
            calling = p.tools is not None and p.tools.choice != "none"
            r.reader = CallReader(e.tool_format, p.tools) if calling else None
        elif r.constraint is not None and r.constraint.vocab.tokenizer is not e.tokenizer:
            r.constraint = r.constraint.rebind(ConstraintVocabulary.for_tokenizer(e.tokenizer))
        if r.constraint is not None:
            r.constraint.prefetch()  # the first mask, during the prefill

    def run(self) -> Iterator[TokenEvent | FinishEvent | Handover]:
        e, p, r = self.e, self.params, self.r
        handed_over = False
        finish: FinishReason = "length"
        held_text, end_calls = "", ()
        self.t_decode = time.perf_counter()
        try:
            self._checkpoint()
            self.start_constraint()
            self.sess = e.session()
            self.spec = e.speculation_for(r, self.sess)
            # A long prefill chunk is stopped between graph nodes (RunOptions.terminate). The options are
            # this generation's own: the token may be cancelled long after it ended (a client that leaves
            # late), and a flag on the shared session would then stop whichever request runs at that moment.
            # The token holds the options alone, not this generation: the generation (its session, its KV)
            # must go when it ends, although the token lives on (the reply moved to another model).
            self.cancel.on_cancel(terminator(self.run_options))
            self._prefill()
            self.start_decode()
            while True:
                event, ends = self.next_token()
                if event is not None:
                    yield event
                if ends is not None:
                    finish = ends
                    break
                self._checkpoint()
                if len(self.ctx) > e.context_length:
                    if not p.truncate:
                        finish = "length"
                        break
                    self.slide_window()
                # normally just the new token (and a draft); all of ctx after a switch
                self.logits = self.advance(self.ctx[-1], self.cap() - r.generated)
            finish, held_text, end_calls = self.flush(finish)
        except Cancelled:
            finish = "cancelled"
        except _Full:
            finish = "length"
        except _Switch as switch:
            handed_over = True  # the grammar goes on with the next model
            self.end_speculation()  # before the next model runs: drafting starts afresh there
            yield self.handover(switch.limits)
            return
        finally:
            if r.constraint is not None and not handed_over:
                r.constraint.close()
            self.end_speculation()
        yield self.finish_event(finish, held_text, end_calls)

    # -- one token at a time: the steps run() takes, which a batch of replies (batch.py) takes per row ------
    def start_decode(self) -> None:
        """After the prefill: the reply's bound (the sliding window adds WINDOW_REPLY_CONTEXTS, as a window
        never runs out of context) and the start of its decode time."""
        e, p = self.e, self.params
        max_tokens = p.max_tokens
        if p.truncate:
            bound = e.window_reply_contexts * e.context_length
            max_tokens = bound if max_tokens is None else min(max_tokens, bound)
        self.max_tokens = max_tokens
        self.t_decode = time.perf_counter()

    def cap(self) -> int:
        """The most tokens the reply may make now (its bound, and the governor's)."""
        return min(x for x in (self.max_tokens, self.e.max_tokens_limit, 1 << 30) if x is not None)

    def next_token(self) -> tuple[TokenEvent | None, FinishReason | None]:
        """Sample the next token from self.logits and account for it: (its event, or None when the reply
        ends before one; the finish reason when the reply ends here, else None). The token is appended to
        ctx, so the next forward pass feeds ctx[-1]."""
        e, p, r = self.e, self.params, self.r
        cap = self.cap()
        if r.generated >= cap:
            return None, "length"
        constraint, reader = r.constraint, r.reader
        allowed = constraint.allowed() if constraint is not None else None
        token, logprob, top = (self.spec or r.sampler).sample(self.logits, r.history, allowed)
        if token in e.tokenizer.eos_ids and (not p.ignore_eos or constraint is not None):
            return None, "stop"
        if constraint is not None:
            # The state moves on emitted tokens only (a variant switch re-prefills the same ones);
            # the next mask is computed while the model runs its forward pass.
            constraint.advance(token)
            constraint.prefetch()
        r.generated += 1
        r.usage.by_model[e.model_id] = r.usage.by_model.get(e.model_id, 0) + 1
        r.history.append(token)
        self.ctx.append(token)
        piece = r.detok.feed(token)
        r.text.append(piece)
        delta, hit = r.stops.feed(piece)
        calls: tuple[ToolCallDelta, ...] = ()
        if reader is not None:
            delta, found = reader.feed(delta)
            calls = tuple(found)
        if r.generated == 1:
            r.timings.ttft_ms = (time.perf_counter() - r.t_start) * 1000
        event = TokenEvent(
            token_id=token,
            text=delta,
            index=r.generated - 1,
            logprob=logprob if p.sampling.logprobs is not None else None,
            top_logprobs=self._top(top) if p.sampling.logprobs else None,
            token_text=e.tokenizer.token_text(token) if p.sampling.logprobs is not None else None,
            elapsed_ms=(time.perf_counter() - r.t_start) * 1000,
            tool_calls=calls,
        )
        if hit:
            return event, "stop"
        if r.generated >= cap:
            return event, "length"
        return event, None

    def flush(self, finish: FinishReason) -> tuple[FinishReason, str, tuple[ToolCallDelta, ...]]:
        """A reply that ended (not cancelled): (its finish reason, the text held back for a possible stop
        or as part of a character, the tool calls the reader completes at the end)."""
        r = self.r
        held_text = ""
        end_calls: tuple[ToolCallDelta, ...] = ()
        if not r.stops.stopped:  # bytes and text held back for a possible stop are the reply's end
            tail, _ = r.stops.feed(r.detok.flush())
            held_text = tail + r.stops.flush()
        if r.reader is not None:
            held_text, found = r.reader.feed(held_text)
            rest, more = r.reader.flush(complete=finish == "stop")
            held_text += rest
            end_calls = tuple(found + more)
            if r.reader.calls and finish == "stop":
                finish = "tool_calls"
        return finish, held_text, end_calls

    def handover(self, limits: EngineLimits) -> Handover:
        """The reply, to go on on the model `limits` names (its grammar goes with it, not closed)."""
        r = self.r
        r.decode_s += time.perf_counter() - self.t_decode
        return Handover(
            model_id=limits.model_id or "",
            variant=limits.variant,
            tokenizer_key=r.tokenizer_key,
            text=r.reply_text,
            generated=r.generated,
            state=r,
        )

    def finish_event(
        self, finish: FinishReason, held_text: str = "", end_calls: tuple[ToolCallDelta, ...] = ()
    ) -> FinishEvent:
        e, r = self.e, self.r
        t = r.timings
        t.predicted_n = r.generated
        t.predicted_ms = (r.decode_s + time.perf_counter() - self.t_decode) * 1000
        t.prompt_per_second = t.prompt_n / (t.prompt_ms / 1000) if t.prompt_ms > 0 else 0.0
        t.predicted_per_second = t.predicted_n / (t.predicted_ms / 1000) if t.predicted_ms > 0 else 0.0
        r.usage.completion_tokens = r.generated
        return FinishEvent(
            finish_reason=finish,
            usage=r.usage,
            timings=t,
            truncated=r.truncated,
            turns_dropped=r.turns_dropped,
            variant=e.variant,
            text=held_text,
            tool_calls=end_calls,
            model_id=e.model_id,
        )

    def end_speculation(self) -> None:
        """Count the drafts into the reply's timings (summed over the models a reply went through) and drop
        verified tokens past the reply's end from the slot, so it holds what a plain decode leaves."""
        if self.spec is None:
            return
        t = self.r.timings
        t.draft_n += self.spec.drafted
        t.draft_n_accepted += self.spec.accepted
        self.spec = None
        if self.slot is not None:
            del self.slot.cache.tokens[self.pos :]

    def _top(self, top: Any) -> tuple[TopLogprob, ...] | None:
        if not top:
            return None
        tok = self.e.tokenizer
        return tuple(TopLogprob(tok.token_text(i), lp, list(tok.token_bytes(i))) for i, lp in top)
