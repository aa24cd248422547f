"""Several replies on one engine at once: up to `slots` rows advanced one token each per forward pass.

The worker thread owns a BatchDecoder per engine and drives it:
    add(prompt, params) -> slot          a reply takes a row (its prompt is not run yet)
    prefill()                            one prefill chunk of one waiting row; its first token when done
    step()                               one forward pass: the next token of every decoding row
    cancel(slot) / hand_over(slot, lim)  the row is free at once
    apply_limits(limits)                 the governor's limits for the whole batch, between passes
Each call returns the events it produced as (slot, TokenEvent | FinishEvent | RowError); a FinishEvent or a
RowError frees the slot.
The caller interleaves prefill() and step() as it likes (a long prompt is prefilled a chunk at a time
between decode passes, so running replies keep streaming); step() never sleeps: the governor's gate paces
the passes (server/serving/governor_gate.py: a pass of n replies makes n tokens).

How it runs. The KV buffer is one array per layer of [slots, kv_heads, context, head_dim]: row b is a
reply's cache. A prefill chunk runs one row alone, through a [1, ...] view of it (the graph's batch 1, as
the one-reply engine runs it). A decode pass feeds rows 0..n-1 at once: input_ids [n, 1], an attention
mask whose row b has as many ones as that row's length, so GroupQueryAttention takes each row's own past
length and position (seqlens_k) over the shared buffer; logits [n, 1, vocab]. Rows in that range that do
not decode now (free, or waiting for their prefill) ride along with a throwaway token written just past
their valid keys, where their next write goes anyway (a free row keeps its keys for prefix reuse, so its
throwaway token attends to them: one row's attention more, until a reply takes the row). Empty rows are
handed out lowest first, so n stays small. A row's memory comes in when a reply first takes it
(BatchKV.map_row), and a row already in is taken before a new one unless the engine keeps more prefix
caches than rows are in: one client at a time holds one row, not `slots` of them.

Per reply, everything is the one-reply engine's own code (generation.Generation): sampling and its seeded RNG,
stops, logprobs, grammars and tool calls (a grammar's next mask is computed during the pass), the bound on a
windowed reply, the finish and its timings. Speculative decoding is off in a batch (a verification pass
feeds several positions of one row; the rows of a pass all feed one).

The same text whatever runs beside it: a row's logits must not depend on how many rows its pass has.
What a CPU's kernels do is measured per session at load (batch_traits), never assumed from the CPU's name.
On AVX-512 VNNI with onnxruntime 1.32 (SmolLM2): with int8 activations (q4-a8) MatMulNBits gives each row
the same sums whatever the number of rows, one included, so a reply is the same alone or beside 1, 2 or 3
others at no cost; with fp32 activations (q4's MatMulNBits, fp32 MatMul) a one-row pass sums in another
order than the rows of a larger one (~7e-5 apart in the logits; passes of two or more rows agree bitwise),
so there a reply decoding alone is padded to two rows. `pad` None (the default) decides per session from
that measurement, True or False force it. Measured against the unpadded pass, interleaved, the padded pass
costs a lone reply 2.3x on q4, so the engine offers no batch decoder for such a session
(DecoderEngine.batch_decoder, unless its pad_batches is set): its replies take turns
(models/runtime/turns.py: one-row passes of their own). On AVX2
(measured under qemu-x86_64 -cpu Haswell) q4's lone row is not exact either and f32's is, while q4-a8's
int8 kernels round a lone row otherwise: on the tiny test model within summation order, on SmolLM2 0.42
apart in the logits, rows not even alike (BatchTraits.rows_alike). Where rows are not alike the engine
offers turns whatever pad_batches says (unless SIMMER_BATCH=fast), and a batch decoder built directly (not
through the engine) decodes replies whose text depends on what runs beside them.
A prefill chunk runs its row alone whatever else is active, so it is the same too; and
its text does not depend on how much of its prompt a free row held (prefix reuse), as for the one-reply
engine: a prefill never runs a pass of one position, and reuses only keys a cold prefill would write
(session.Exactness; a row's decoded keys only where one-position rows are exact in any pass).
(What a probe of q4-a8 saw, logits 0.4-0.9 apart, is between a one-position
pass and the rows of a pass of several positions of one sequence: the same MatMulNBits rows, but
GroupQueryAttention's prompt path against its token path, amplified by the int8 activations. A batch of
one-position rows never mixes the two.)

A mid-reply variant switch (the governor's ladder, apply_limits) moves every active reply of the batch
together: one session runs the batch, and every row's keys were computed by the old weights, so each row
goes back to prefill its context so far on the new variant (a chunk per prefill() call, as a new prompt),
then decodes on. A switch to another model hands one reply over alone (hand_over: its Handover, for the
other model's decoder.add(resume=...)); the others stay. The sliding window is per reply: a row whose
context fills (or whose cap the governor lowers) slides its window as the one-reply engine does and
prefills the new context. Free rows keep their keys for prefix reuse (a new reply takes the free row
sharing the longest prefix with its prompt, within its cache scope: another client's cache is never reused).

(~670 lines: the rows' shared KV buffer and the passes that read it are one layout; the probe of what a
batch's rows do on this CPU is in batch_traits below, public, because the server asks it too.)
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from models.errors import Cancelled, ContextLengthExceeded, InvalidParameter
from models.protocol import EngineLimits, Prompt
from models.runtime.generation import (
    Generation,
    KVSlot,
    passes_exact,
    positions_exact,
    reusable_prefix,
    terminator,
)
from models.runtime.sampling import validate
from models.runtime.session import (
    KEEP_INPUT,
    ROWS_ATOL,
    DecoderSession,
    KVCache,
    ModelShape,
    kv_slot_count,
    kv_zeros,
    note_write,
    prefill_end,
)
from models.types import (
    BatchEvent,
    CancelToken,
    FinishEvent,
    FinishReason,
    GenerationParams,
    Handover,
    PassStats,
    RowError,
)

if TYPE_CHECKING:
    from models.runtime.engine import DecoderEngine

PAD_ROWS = 2  # the fewest rows a padded pass runs: any two or more sum in the same order


class BatchKV:
    """Per-layer keys and values [rows, kv_heads, capacity, head_dim]; `rows[b]` is row b as a KVCache of
    its own (a [1, ...] view, no copy) and `first(n)` rows 0..n-1 as OrtValues for a decode pass.

    A row's pages come in when a reply first takes it (map_row), not when the batch is built: one client
    keeps one row resident, not `rows` of them (a phone's memory; the planner still budgets them all, so
    a load that fits keeps fitting). With `prefault` map_row writes the row's pages at once, as kv_zeros
    does for a whole buffer: a reply never faults them in mid-reply."""

    def __init__(self, shape: ModelShape, rows: int, capacity: int, prefault: bool = False) -> None:
        self.shape = shape
        self.capacity = capacity
        self.prefault = prefault
        dims = (rows, shape.n_kv_heads, capacity, shape.head_dim)
        self.arrays = [
            (kv_zeros(dims, shape.kv_dtype, False), kv_zeros(dims, shape.kv_dtype, False))
            for _ in range(shape.n_layers)
        ]
        self.mapped = [False] * rows  # a reply took the row once: its pages are (or come) in
        self.rows = [_RowKV(self, b) for b in range(rows)]
        self._first: dict[int, list[tuple[ort.OrtValue, ort.OrtValue]]] = {}

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.arrays)

    def map_row(self, b: int) -> None:
        """Row b is taken by a reply: with `prefault`, its pages are written now (a throwaway key a pass
        may have put in a free row is past its valid keys, and a prefill overwrites it)."""
        if self.mapped[b]:
            return
        if self.prefault:
            for k, v in self.arrays:
                k[b].fill(0)  # the write is the point: a read would map the shared zero page
                v[b].fill(0)
        self.mapped[b] = True

    def first(self, n: int) -> list[tuple[ort.OrtValue, ort.OrtValue]]:
        if n not in self._first:
            self._first[n] = [
                (ort.OrtValue.ortvalue_from_numpy(k[:n]), ort.OrtValue.ortvalue_from_numpy(v[:n]))
                for k, v in self.arrays
            ]
        return self._first[n]


class _RowKV(KVCache):
    """One row of a BatchKV, seen as the one-reply engine's KVCache."""

    def __init__(self, kv: BatchKV, b: int) -> None:  # no super().__init__: the buffers are the batch's
        self.shape = kv.shape
        self.capacity = kv.capacity
        self.arrays = [(k[b : b + 1], v[b : b + 1]) for k, v in kv.arrays]
        self.ortvalues = [
            (ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v)) for k, v in self.arrays
        ]
        self.tokens = []
        self.exact = 0


class BatchPass:
    """Decode passes over rows 0..n-1 of a BatchKV on one session: the KV, the logits and
    num_logits_to_keep stay bound (one binding per n), a pass binds only input_ids and the mask."""

    def __init__(self, sess: DecoderSession, kv: BatchKV) -> None:
        self.sess = sess
        self.kv = kv
        self.logits = np.zeros((len(kv.rows), 1, sess.shape.vocab), np.float32)
        self._keep = ort.OrtValue.ortvalue_from_numpy(np.array(1, np.int64))
        self._bindings: dict[int, ort.IOBinding] = {}
        self._positions = np.arange(kv.capacity, dtype=np.int64)
        self.run_options = ort.RunOptions()  # the batch's own: one reply's cancel never stops a pass

    def _binding(self, n: int) -> ort.IOBinding:
        if n not in self._bindings:
            b = self.sess.sess.io_binding()
            for i, (k, v) in enumerate(self.kv.first(n)):
                b.bind_ortvalue_input(f"past_key_values.{i}.key", k)
                b.bind_ortvalue_input(f"past_key_values.{i}.value", v)
                b.bind_ortvalue_output(f"present.{i}.key", k)
                b.bind_ortvalue_output(f"present.{i}.value", v)
            b.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(self.logits[:n]))
            if self.sess.multi_logits:
                b.bind_ortvalue_input(KEEP_INPUT, self._keep)
            self._bindings[n] = b
        return self._bindings[n]

    def run(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Feed ids[b] at position lengths[b] - 1 of row b (its keys up to there are valid); returns the
        rows' logits [n, vocab], a view into a buffer the next pass reuses."""
        n = len(ids)
        if int(lengths.max()) > self.kv.capacity or int(lengths.min()) < 1:
            raise ValueError(f"row lengths {lengths.tolist()} outside 1..{self.kv.capacity}")
        b = self._binding(n)
        b.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64).reshape(n, 1))
        mask = (self._positions[: int(lengths.max())] < lengths[:, None]).astype(np.int64)
        b.bind_cpu_input("attention_mask", mask)
        self.sess.sess.run_with_iobinding(b, self.run_options)
        return self.logits[:n, 0]


@dataclass(frozen=True)
class BatchTraits:
    """What a session's graph and this CPU's kernels do with a batch, measured once per session
    (batch_traits).
    `rows`: the graph runs the rows of a batch as separate sequences (our graphs from converter 11 on; older
    ones and foreign decoders run batch 1 only). A property of the file: converting again gives it.
    `rows_alike`: a row's logits in a pass of two rows are the ones it gets alone, up to summation order
    (ROWS_ATOL) and with the same argmax, so what runs beside a reply cannot change its text beyond that.
    A property of the CPU's kernels: on AVX-512 VNNI every variant measured has it; on AVX2 SmolLM2's
    q4-a8 rows are 0.42 apart (the int8 kernels of one row and of several round differently, and 30
    layers amplify it), which no conversion changes.
    `one_row_exact`: a pass of one row gives bitwise the logits that row gets in a pass of several, so a
    reply alone needs no padding to be the same as batched."""

    rows: bool
    rows_alike: bool = False
    one_row_exact: bool = False

    def why_alone(self, pad: bool) -> str | None:
        """Why an engine does not batch such a session's replies, which take turns instead (None: it
        batches them); `pad`: a lone reply may decode padded to two rows (DecoderEngine.pad_batches)."""
        if not self.rows:
            return "its graph runs one sequence at a time (converted before batches, or not by simmer)"
        if not self.rows_alike:
            return (
                "this CPU's kernels give a row of a batch other logits than the row alone (measured at "
                "load): batched, a reply's text would depend on the replies beside it"
            )
        if not (self.one_row_exact or pad):
            return (
                "this CPU's kernels sum a lone row otherwise than a batch's rows (measured at load): a reply "
                "alone would decode padded to two rows to stay the same text, at about twice the cost"
            )
        return None


_TRAITS: weakref.WeakKeyDictionary[DecoderSession, BatchTraits] = weakref.WeakKeyDictionary()


def batch_traits(sess: object) -> BatchTraits:
    """measure_batch_traits, once per session."""
    if not isinstance(sess, DecoderSession):
        return BatchTraits(rows=False)
    if sess not in _TRAITS:
        _TRAITS[sess] = measure_batch_traits(sess)
    return _TRAITS[sess]


def measure_batch_traits(sess: DecoderSession) -> BatchTraits:
    """Four probe passes on a throwaway two-row cache (at load, not in a request): the two-row pass must
    run (`rows`), its row 1 must give what its token gives fed alone up to summation order (`rows_alike`),
    and the one-row pass of row 0 must equal row 0 of the two-row pass bit for bit (`one_row_exact`).
    Measured with onnxruntime 1.32 on x86 (1 and 2 threads, rows of 45 to 1200 positions): on AVX-512
    VNNI q4-a8's int8 kernels give a row the same sums whatever the number of rows, one included, and q4's
    fp32 ones do not (~7e-5 apart in the logits); on AVX2 neither does, f32's fp32 MatMul does."""
    probe = [(j * 7919 + 11) % sess.shape.vocab for j in range(4)]
    alone = KVCache(sess.shape, 4)
    sess.run(np.array(probe[:2]), alone, 0)
    want = sess.run(np.array(probe[2:3]), alone, 2).copy()
    kv = BatchKV(sess.shape, 2, 4)
    for row in kv.rows:
        sess.run(np.array(probe[:2]), row, 0)
    sess.unbind()  # the probe caches go
    try:
        pas = BatchPass(sess, kv)
        two = pas.run(np.array([probe[2], probe[2]]), np.array([3, 3])).copy()
        one = pas.run(np.array([probe[2]]), np.array([3]))  # the same keys written again
    except Exception:  # a graph of batch 1 refuses the pass (onnxruntime says why)
        return BatchTraits(rows=False)
    alike = bool(np.abs(two[1] - want).max() <= ROWS_ATOL) and int(two[1].argmax()) == int(want.argmax())
    return BatchTraits(rows=True, rows_alike=alike, one_row_exact=bool(np.array_equal(one[0], two[0])))


@dataclass
class _Row:
    gen: Generation
    decoding: bool = False  # ctx[-1] is a sampled token the next pass feeds; else a prefill is due
    started: bool = False  # its first prefill ended (the reply's prompt timings are taken)
    t_prefill: float | None = None
    order: int = 0  # add() order: prefills are served first come, first served


@dataclass
class _Free:
    """What a free row still holds for prefix reuse."""

    variant: str | None = None
    scope: str | None = None  # GenerationParams.cache_scope
    last_used: float = field(default_factory=time.monotonic)


class BatchDecoder:
    """Up to `slots` replies of one engine decoding together (see the module docstring)."""

    # A decode pass feeds several rows at once: a graph of one sequence cannot run it (a decoder whose
    # passes each feed one row, models/runtime/turns.py, says False).
    passes_rows = True

    def __init__(self, engine: DecoderEngine, slots: int = 4, *, pad: bool | None = None) -> None:
        if slots < 1:
            raise InvalidParameter(f"slots must be at least 1, not {slots}", param="slots")
        if engine.io is not None or (self.passes_rows and not batch_traits(engine.session()).rows):
            why = BatchTraits(rows=False).why_alone(pad=True)
            raise InvalidParameter(
                f"{engine.model_id}: {why}: convert it again to serve several replies at once", param="model"
            )
        self.e = engine
        self.slots = slots
        self.pad = pad
        # a padded pass of one reply needs a second row, so one slot still has two (its pages are mapped
        # only where written: a throwaway key a pass)
        rows = slots if pad is False else max(slots, PAD_ROWS)
        # the configured context: the governor's cap only ever lowers it (DecoderEngine.apply_limits)
        # the session's shape: its KV type is the graph's
        self.kv = BatchKV(engine.session().shape, rows, engine.configured_context, engine.kv_prefault)
        self.rows: list[_Row | None] = [None] * rows
        self.free_rows = [_Free() for _ in range(rows)]
        self._pass: BatchPass | None = None
        self._added = 0
        self.last_pass: PassStats | None = None

    # -- what the scheduler reads ----------------------------------------------------------------------
    @property
    def engine(self) -> DecoderEngine:
        return self.e

    @property
    def active(self) -> list[int]:
        return [b for b, row in enumerate(self.rows) if row is not None]

    @property
    def free(self) -> int:
        return self.slots - len(self.active)

    @property
    def prefilling(self) -> list[int]:
        """Rows waiting for a prefill chunk, first come first."""
        waiting = [(row.order, b) for b, row in enumerate(self.rows) if row is not None and not row.decoding]
        return [b for _, b in sorted(waiting)]

    @property
    def decoding(self) -> list[int]:
        return [b for b, row in enumerate(self.rows) if row is not None and row.decoding]

    # -- a reply joins -----------------------------------------------------------------------------------
    def add(
        self,
        prompt: Prompt | None,
        params: GenerationParams,
        *,
        cancel: CancelToken | None = None,
        resume: Handover | None = None,
    ) -> int:
        """Take a row for a reply and return its slot; its prompt runs in later prefill() calls. Raises
        what generate() would before its first token (ContextLengthExceeded, a bad grammar) and
        InvalidParameter when every slot is taken (the caller checks `free` first)."""
        e = self.e
        if self.free <= 0:
            raise InvalidParameter(f"all {self.slots} slots are taken", param="slots")
        validate(params.sampling, e.vocab_size)
        gen = Generation(e, prompt, params, cancel or CancelToken(), None, resume)
        if resume is None and len(gen.ctx) >= e.context_length:
            raise ContextLengthExceeded(
                f"This model's context is {e.context_length} tokens; the prompt has {len(gen.ctx)} tokens.",
                param="messages",
                context_length=e.context_length,
                prompt_tokens=len(gen.ctx),
            )
        gen.start_constraint()
        gen.sess = e.session()
        gen.cancel.on_cancel(terminator(gen.run_options))  # a prefill chunk in progress stops at once
        scope = params.cache_scope
        slot, cached = self._row_for(gen.ctx, scope)
        self.kv.map_row(slot)
        gen.slot = KVSlot(self.kv.rows[slot], e.variant, scope=scope)
        gen.pos = cached
        self.free_rows[slot] = _Free(e.variant, scope)
        self._added += 1
        self.rows[slot] = _Row(gen, order=self._added)
        if not gen.resumed:
            gen.r.usage.cached_tokens = cached
            gen.r.timings.prompt_n = len(gen.ctx) - cached
        return slot

    def _row_for(self, ids: list[int], scope: str) -> tuple[int, int]:
        """The free row sharing the longest prefix with `ids` (computed by this variant, in `scope`). Else a
        row no reply has taken yet while fewer rows are mapped than the one-reply engine keeps prefix
        caches (SIMMER_PREFIX_CACHE_SLOTS and its budget), else a mapped one: the rows resident are the
        replies at once, or the conversations kept, whichever is more. Then an empty row, else the least
        recently used; lowest first on ties, so passes stay narrow. How much of it is reused: the one-reply
        engine's rule (reusable_prefix)."""
        sess = self.e.session()
        exact, whole = positions_exact(sess), passes_exact(sess)
        e = self.e
        keep = kv_slot_count(
            self.kv.capacity, sess.shape.kv_bytes_per_token(), e.prefix_slots, e.prefix_budget_bytes
        )
        spread = sum(self.kv.mapped) < keep  # room for another conversation's keys: a new row
        best: tuple[int, bool, bool, float, int] | None = None
        chosen = -1
        for b in range(self.slots):
            if self.rows[b] is not None:
                continue
            free, tokens = self.free_rows[b], self.kv.rows[b].tokens
            n = 0
            if free.variant == self.e.variant and free.scope == scope:
                n = reusable_prefix(self.kv.rows[b], ids, exact, whole, e.prefill_chunk)
            key = (n, self.kv.mapped[b] != spread, not tokens, -free.last_used, -b)
            if best is None or key > best:
                best, chosen = key, b
        assert best is not None
        return chosen, best[0]

    # -- prefill: one chunk per call --------------------------------------------------------------------
    def prefill(self, slot: int | None = None) -> list[BatchEvent]:
        """One prefill chunk of `slot` (by default the row waiting longest). When its prompt (or its
        context after a switch or a window) is in, the next token is sampled and returned at once."""
        events = self._sweep()
        waiting = self.prefilling
        if slot is None:
            if not waiting:
                return events
            slot = waiting[0]
        elif slot not in waiting:
            raise ValueError(f"slot {slot} is not waiting for a prefill")
        row = self.rows[slot]
        assert row is not None
        gen, e = row.gen, self.e
        while gen.resumed and not row.started and len(gen.ctx) >= e.context_length:
            # a smaller model took the reply over: it slides its window, or ends
            if not gen.params.truncate:
                return [*events, self._finish(slot, "length")]
            gen.slide_window()
        if gen.stale:  # other weights (a variant switch) or a new window: the context from position 0
            gen.stale = False
            gen.pos = 0
            self.kv.rows[slot].tokens = []
            self.free_rows[slot].variant = e.variant
        gen.sess = e.session()
        if row.t_prefill is None:
            row.t_prefill = time.perf_counter()
        try:
            end = prefill_end(gen.pos, len(gen.ctx), e.prefill_chunk, positions_exact(gen.sess))
            logits = gen.forward(gen.ctx[gen.pos : end])
        except Cancelled:
            return [*events, self._finish(slot, "cancelled")]
        except Exception as err:  # this reply fails, the others go on
            return [*events, self._fail(slot, err)]
        if gen.pos < len(gen.ctx):
            return events
        if not row.started:
            row.started = True
            if not gen.resumed:
                gen.r.timings.prompt_ms = (time.perf_counter() - row.t_prefill) * 1000
            gen.start_decode()
        gen.logits = logits
        return [*events, *self._emit(slot)]

    def _sweep(self) -> list[BatchEvent]:
        """Replies whose cancel token fired (their client left) finish now, whatever they were doing."""
        return [
            self._finish(b, "cancelled")
            for b, row in enumerate(self.rows)
            if row is not None and row.gen.cancel.cancelled
        ]

    # -- decode: one pass for every decoding row --------------------------------------------------------
    def step(self) -> list[BatchEvent]:
        """One forward pass feeding every decoding row its last token; each row's next token (or finish).
        Rows whose cancel token fired finish first, without a pass."""
        events = self._sweep()
        live = self.decoding
        if not live:
            return events
        n = live[-1] + 1
        if n < PAD_ROWS and self.pads:
            n = PAD_ROWS
        ids = np.zeros(n, np.int64)
        lengths = np.ones(n, np.int64)
        sess = self.e.session()
        # a row's decoded keys are a cold prefill's only where neither the pass's width nor its one
        # position nor a pass's size changes a sum (else prefix reuse stops before them)
        exact = positions_exact(sess) and passes_exact(sess) and batch_traits(sess).one_row_exact
        for b in range(n):
            row = self.rows[b]
            decodes = row is not None and row.decoding
            if row is not None and row.decoding:
                ids[b] = row.gen.ctx[row.gen.pos]
                lengths[b] = row.gen.pos + 1
            else:  # a throwaway token just past the row's valid keys, where its next write goes anyway
                lengths[b] = self._filled(b) + 1
            note_write(self.kv.rows[b], int(lengths[b]) - 1, 1, exact and decodes)
        t0 = time.perf_counter()
        try:
            logits = self._batch_pass().run(ids, lengths)
        except Exception as err:  # reported per reply; the rows are free again
            return [*events, *(self._fail(b, err) for b in live)]
        self.last_pass = PassStats(len(live), n, time.perf_counter() - t0)
        self.e.positions_run += len(live)
        for b in live:
            row = self.rows[b]
            assert row is not None
            gen = row.gen
            tokens = self.kv.rows[b].tokens
            del tokens[gen.pos :]
            tokens.append(gen.ctx[gen.pos])
            gen.pos += 1
            gen.logits = logits[b]
            events.extend(self._emit(b))
        return events

    def _filled(self, b: int) -> int:
        """Where a row that does not decode now takes a throwaway key: just past its valid ones (a prefill
        overwrites it next; a free row's cached prefix stays whole), the last one trimmed when full."""
        row = self.rows[b]
        if row is not None:
            return min(row.gen.pos, self.kv.capacity - 1)
        tokens = self.kv.rows[b].tokens
        del tokens[self.kv.capacity - 1 :]
        return len(tokens)

    @property
    def pads(self) -> bool:
        """Whether a reply decoding alone runs in a pass of two rows (see the module docstring)."""
        if self.pad is not None:
            return self.pad
        return not batch_traits(self.e.session()).one_row_exact

    def _batch_pass(self) -> BatchPass:
        sess = self.e.session()
        if self._pass is None or self._pass.sess is not sess:
            assert isinstance(sess, DecoderSession)
            self._pass = BatchPass(sess, self.kv)
        return self._pass

    # -- per reply ---------------------------------------------------------------------------------------
    def _emit(self, slot: int) -> list[BatchEvent]:
        """The row's next token from its logits: its event, and its finish when the reply ends here."""
        row = self.rows[slot]
        assert row is not None
        gen = row.gen
        try:
            event, ends = gen.next_token()
        except Exception as err:  # this reply fails, the others go on
            return [self._fail(slot, err)]
        events: list[BatchEvent] = [] if event is None else [(slot, event)]
        if ends is None and len(gen.ctx) > self.e.context_length:
            if not gen.params.truncate:
                ends = "length"
            else:
                gen.slide_window()  # stale: the row prefills its new context, then decodes on
        if ends is not None:
            events.append(self._finish(slot, ends))
        else:
            row.decoding = not gen.stale
        return events

    def _finish(self, slot: int, finish: FinishReason) -> BatchEvent:
        row = self.rows[slot]
        assert row is not None
        gen = row.gen
        held, calls = "", ()
        if finish != "cancelled":
            finish, held, calls = gen.flush(finish)
        if gen.r.constraint is not None:
            gen.r.constraint.close()
        self._release(slot)
        return slot, gen.finish_event(finish, held, calls)

    def _held(self, slot: int) -> _Row:
        row = self.rows[slot] if 0 <= slot < self.slots else None
        if row is None:
            raise ValueError(f"slot {slot} holds no reply")
        return row

    def cancel(self, slot: int) -> FinishEvent:
        """End a reply now (its client left): its FinishEvent ("cancelled"); the slot is free at once."""
        self._held(slot)
        event = self._finish(slot, "cancelled")[1]
        assert isinstance(event, FinishEvent)
        return event

    def hand_over(self, slot: int, limits: EngineLimits) -> Handover:
        """The reply of `slot`, to go on on the model `limits` names (decoder.add(resume=...) there); the
        slot is free at once, the others decode on."""
        handover = self._held(slot).gen.handover(limits)
        self._release(slot)
        return handover

    def _release(self, slot: int) -> None:
        """The row is free; its keys up to its position stay for prefix reuse."""
        row = self.rows[slot]
        assert row is not None
        del self.kv.rows[slot].tokens[row.gen.pos :]
        self.free_rows[slot].last_used = time.monotonic()
        self.rows[slot] = None
        self._idle()

    def _idle(self) -> None:
        """With no reply left, the decoder holds no session: one the engine drops (an unload, an eviction)
        is freed at once, not at the next batch."""
        if not self.active:
            self._pass = None

    def _fail(self, slot: int, error: Exception) -> BatchEvent:
        """A reply that failed: its slot is free, its keys (maybe partly written) never reused."""
        row = self.rows[slot]
        if row is not None and row.gen.r.constraint is not None:
            row.gen.r.constraint.close()
        self.kv.rows[slot].tokens = []
        self.rows[slot] = None
        self._idle()
        return slot, RowError(error)

    # -- the governor ------------------------------------------------------------------------------------
    def apply_limits(self, limits: EngineLimits) -> list[BatchEvent]:
        """Threads, variant, context cap, max tokens, spinning for the whole batch (between passes), as the
        one-reply engine applies them between tokens. A new variant sends every active row back to prefill
        its context on it. A context cap below a reply's context slides its window (truncate) or ends it
        (length), as at the reply's next token. `limits.model_id` is not the batch's to act on: hand those
        replies over (hand_over)."""
        e = self.e
        self._pass = None  # bound to the session now running: another one may run from here
        old = e.session_key()
        changed = e.apply_limits(limits)
        if e.session_key() != old:
            for row in self.rows:  # not held while the engine evicts it (a prefill takes the new one)
                if row is not None:
                    row.gen.sess = None
        if changed:
            for b, row in enumerate(self.rows):
                if row is not None:
                    row.gen.stale = True
                    row.decoding = False
                else:
                    self.kv.rows[b].tokens = []  # other weights' keys: no prefix to reuse
        events: list[BatchEvent] = []
        for b, row in enumerate(self.rows):
            if row is None or len(row.gen.ctx) <= e.context_length:
                continue
            if row.gen.params.truncate:
                row.gen.slide_window()
                row.decoding = False
            elif row.decoding:
                events.append(self._finish(b, "length"))
        return events

    def reset_cache(self) -> None:
        """Forget what the free rows hold for prefix reuse (keeps the buffers)."""
        for b, row in enumerate(self.rows):
            if row is None:
                self.kv.rows[b].tokens = []

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes
