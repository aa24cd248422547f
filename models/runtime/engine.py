"""The generation engine: prompt building, prefix KV reuse, chunked prefill, decode, sampling, streaming.

The whole path reads top to bottom, gpt-fast style:
    chat_prompt -> generate: pick a KV slot (longest common prefix) -> prefill the rest in chunks ->
    decode one token at a time -> sample -> detokenize -> stop matcher -> TokenEvent ... FinishEvent
Everything runs on the caller's thread (the server's one worker). Between prefill chunks and between decode
tokens the engine checks the cancel token and calls the step hook, which may block (a governor pause) or
return new limits (threads, variant, context cap, max tokens, pace): a new variant means another session
and a re-prefill of the token history, so the reply continues coherently.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.errors import (
    Cancelled,
    ContextLengthExceeded,
    InvalidParameter,
    ModelNotChat,
    ModelNotInstalled,
    SimmerError,
)
from models.protocol import ChatTurns, EngineLimits, Prompt, StepHook, pool_spins
from models.runtime.chat import ChatTemplate, encode_chat
from models.runtime.constraint import Constraint, ConstraintVocabulary
from models.runtime.genai_config import DecoderIO
from models.runtime.reply import ReplyState
from models.runtime.session import (
    DecoderSession,
    GeneralDecoderSession,
    KVCache,
    ModelShape,
    cold_pass,
    exact_prefix,
    kv_slot_count,
    new_run_options,
    note_write,
    prefill_end,
)
from models.runtime.speculative import MAX_DRAFT, RowCost, Speculation
from models.runtime.text_side import TextSideMixin, read_tokenizer
from models.runtime.tokenizer import tokenizer_key
from models.runtime.tools import CallFormat, CallReader, detect_format, prepare_messages, tool_grammar
from models.runtime.window import newest_turns, window_split
from models.types import (
    NOMINAL_VARIANT,
    CancelToken,
    FinishEvent,
    FinishReason,
    GenerationParams,
    Handover,
    TokenEvent,
    ToolCallDelta,
    ToolUse,
    TopLogprob,
)

if TYPE_CHECKING:
    from models.runtime.batch import BatchDecoder

log = logging.getLogger("simmer.engine")

# A reply under a sliding window (truncate) never runs out of context: without a bound, one that no EOS or
# stop string ends runs until its client leaves, and so does one whose max_tokens is huge (1e300 is a valid
# integer). It stops (finish_reason "length") after this many contexts' worth of tokens, whatever max_tokens
# asks: by default one context, where llama.cpp's server (context shift off) stops a reply that fills its
# context. Ollama's bound is 10 x num_ctx (SIMMER_WINDOW_REPLY_CONTEXTS=10).
WINDOW_REPLY_CONTEXTS = 1


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


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS after dropping a session: glibc keeps them otherwise, and a
    governor that switches variants would look like a leak (RSS only grows)."""
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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


def variant_order(manifest: dict[str, Any]) -> list[str]:
    """Installed variants, best quality first (then cheaper first)."""
    entries = manifest.get("variants", {})

    def key(name: str) -> tuple[float, float]:
        e = entries[name]
        return (
            -e.get("quality", {}).get("top1_agreement", 0.0),
            e.get("speed", {}).get("cpu_s_per_token", 1.0),
        )

    return sorted(entries, key=key)


def nominal_variant(manifest: dict[str, Any]) -> str | None:
    """The variant a model opens on unless told otherwise: the manifest's own choice, else q4-a8 when it
    has one (installs from before the store kept the converter's choice), else the best quality."""
    names = variant_order(manifest)
    chosen = manifest.get("default_variant")
    if chosen in names:
        return chosen
    return NOMINAL_VARIANT if NOMINAL_VARIANT in names else (names[0] if names else None)


class LlamaEngine(TextSideMixin):
    """Implements models.protocol.Engine for a converted model folder."""

    # Batch only where it costs a reply nothing: where a lone row sums as a batch's rows do (q4-a8's int8
    # kernels on AVX-512 VNNI). Elsewhere (q4's fp32 activations; q4-a8 on AVX2) a reply alone would
    # have to run padded to two rows to give the same text as batched, and that pass costs 2.3x a one-row
    # pass (SmolLM2 q4 over HTTP, 20.5 against 46-52 tok/s), so such a session serves one reply at a time
    # unless this is set. Where rows are not even alike (BatchTraits.rows_alike) padding cannot help: one
    # reply at a time whatever this says.
    pad_batches = False

    def __init__(
        self,
        model_dir: Path,
        manifest: dict[str, Any],
        *,
        model_id: str | None = None,
        variant: str | None = None,
        threads: int = 2,
        context_length: int = 2048,
        prefill_chunk: int = 256,
        prefix_slots: int = 1,
        prefix_budget_bytes: int = 256 << 20,
        spin: str = "auto",
        max_sessions: int = 1,
        chat_template: str | None = None,
        mask_prefetch: bool = True,
        speculation: str = "auto",
        max_draft: int = MAX_DRAFT,
        window_reply_contexts: int = WINDOW_REPLY_CONTEXTS,
        kv_prefault: bool = False,
        limits: EngineLimits | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.kv_prefault = kv_prefault
        self.manifest = manifest
        self.model_id = model_id or manifest.get("id", self.model_dir.name)
        self.variants = variant_order(manifest)
        if not self.variants:
            raise ModelNotInstalled(f"{self.model_id}: the manifest lists no variants")
        chosen = variant or nominal_variant(manifest) or self.variants[0]
        if chosen not in self.variants:
            raise InvalidParameter(
                f"variant {chosen!r} is not installed for {self.model_id} "
                f"(installed: {', '.join(self.variants)})",
                param="variant",
            )
        self.variant = chosen
        arch = manifest["architecture"]
        self.shape = ModelShape(arch["n_layers"], arch["n_kv_heads"], arch["head_dim"], arch["vocab"])
        self.vocab_size: int = arch["vocab"]
        self.max_context = int(manifest.get("context_length", arch.get("context_length", context_length)))
        self.configured_context = min(context_length, self.max_context)
        self.context_length = self.configured_context
        self.threads = max(1, threads)
        self.prefill_chunk = max(1, prefill_chunk)
        self.prefix_slots = max(1, prefix_slots)
        self.prefix_budget_bytes = prefix_budget_bytes
        if spin not in ("auto", "on", "off"):
            raise InvalidParameter(f"spin must be auto, on or off, not {spin!r}", param="spin")
        self.spin = spin
        if speculation not in ("auto", "off"):
            raise InvalidParameter(
                f"speculation must be auto or off, not {speculation!r}", param="speculation"
            )
        self.speculation = speculation
        self.max_draft = max(0, max_draft)
        self._row_costs: dict[tuple[str, int, bool], RowCost] = {}  # per session: what a verified row costs
        self.max_sessions = max(1, max_sessions)
        self.mask_prefetch = mask_prefetch  # constrained decoding: next mask during the forward pass
        self.max_tokens_limit: int | None = None
        self.window_reply_contexts = max(1, window_reply_contexts)
        self.tokens_per_second: float | None = None
        self.governor_spin: bool | None = None  # the governor's word on spinning (EngineLimits.spin)
        # A folder installed as is (onnxruntime-genai layout) runs on the general path; ours on the fast one.
        genai = manifest["variants"][self.variant].get("genai")
        self.io = DecoderIO.from_dict(genai) if genai else None
        self.tokenizer = read_tokenizer(self.model_dir, self.io)
        self.tokenizer_key = tokenizer_key(self.model_dir)
        self.positions_run = (
            0  # token positions fed through the model (prefill and decode), for tests/metrics
        )
        # `chat_template` (the operator's, SIMMER_CHAT_TEMPLATE) replaces the model's; None: no chat
        self.template = ChatTemplate.from_tokenizer(self.tokenizer, chat_template)
        self._sessions: dict[tuple[str, int, bool], DecoderSession | GeneralDecoderSession] = {}
        # Wraps every session built once the engine is open (another thread count, spinning or variant, or
        # after unload()): seconds of full CPU, like a load, that the server's governor must not take for
        # paced work (server/serving/model_pool.py sets it).
        self.building: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        self._slots: list[KVSlot] = []
        # the batch decoder (batch_decoder): None until asked for, False when this graph cannot batch
        self._batch: BatchDecoder | bool | None = None
        self._batch_refused: str | None = None  # the variant whose batch decoder was refused (logged once)
        if limits is not None:  # the governor's (threads, spinning): the one session built is the one it runs
            self.apply_limits(limits)
        self._session()  # load now: a broken model fails at start, not at the first request

    # -- sessions and KV slots -----------------------------------------------------------------------
    def _session(self) -> DecoderSession | GeneralDecoderSession:
        """The session for the current (variant, threads, spinning), built when missing. A caller that holds
        the session it ran before (a reply whose limits changed) drops it first, so that an evicted session
        is gone when the freed heap is handed back."""
        key = self.session_key()
        sess = self._sessions.pop(key, None)
        if sess is None:
            # Room first, then the new one: built beside the session it replaces, the packed weights were
            # held twice at the peak (SmolLM2: 96 MB more; a 1.5B model's packed weights are a GB), and
            # freed after the heap was last handed back, glibc kept them for good.
            if self._evict(self.max_sessions - 1):
                release_freed_memory()
            t0 = time.perf_counter()
            with self.building():
                sess = self._build_session(key[2])
            if isinstance(sess, DecoderSession) and not sess.passes_exact:
                log.info(
                    "%s/%s: passes of several positions differ by their number on this CPU: prefixes "
                    "are reused a whole prefill chunk at a time (a reply's text must not depend on "
                    "what was cached)",
                    self.model_id,
                    self.variant,
                )
            log.info(
                "loaded %s/%s with %d threads in %.2f s",
                self.model_id,
                self.variant,
                self.threads,
                time.perf_counter() - t0,
            )
            self._sessions[key] = sess
            # building a session (graph optimization, weight packing) leaves freed heap with glibc too:
            # ~5 MB for Gemma 3 270M q4-a8, ~18 MB with the tokenizer of converter 8 before it
            release_freed_memory()
        else:
            self._sessions[key] = sess  # most recently used last
        return sess

    def _build_session(self, spinning: bool) -> DecoderSession | GeneralDecoderSession:
        entry = self.manifest["variants"][self.variant]
        if self.io is not None:
            return GeneralDecoderSession(
                self.model_dir / entry["file"], self.io, self.threads, spinning=spinning
            )
        sess = DecoderSession(
            self.model_dir / entry["file"],
            self.shape,
            self.threads,
            spinning=spinning,
            copied_at_load=entry.get("copied_at_load") or (),
        )
        if self.speculation != "off":
            sess.rows_exact  # noqa: B018 (the probe runs at load, not in a request)
        sess.positions_exact  # noqa: B018 (likewise)
        return sess

    def _evict(self, keep: int) -> bool:
        """Drop the least recently used sessions down to `keep`; True if any went."""
        evicted = False
        while len(self._sessions) > max(0, keep):
            self._sessions.pop(next(iter(self._sessions)))
            evicted = True
        return evicted

    def new_cache(self, capacity: int) -> Any:
        """A KV cache of the layout the model needs (ours: one shared fp32 buffer), its pages written now
        when `kv_prefault` (see kv_zeros)."""
        if self.io is None:
            return KVCache(self.shape, capacity, self.kv_prefault)
        sess = self._session()
        assert isinstance(sess, GeneralDecoderSession)  # a folder's decoder I/O: the general path
        return sess.new_cache(capacity, self.kv_prefault)

    def session_key(self) -> tuple[str, int, bool]:
        """Spinning thread pools decode faster when tokens come back to back, but burn the gaps of a paced
        stream: see pool_spins."""
        spinning = pool_spins(self.spin, self.governor_spin, self.tokens_per_second, self.threads)
        return (self.variant, self.threads, spinning)

    @property
    def reuse_tail(self) -> int:
        """Prompt tokens a reused prefix always leaves to prefill (reusable_prefix): 1, or 2 where this
        session's one-position passes are not exact."""
        return 1 if positions_exact(self._session()) else 2

    @property
    def speculates(self) -> bool:
        """Whether requests speculate on the current variant (see _speculation)."""
        sess = self._session()
        return (
            self.speculation != "off"
            and self.max_draft > 0
            and isinstance(sess, DecoderSession)
            and sess.rows_exact
        )

    def _speculation(self, r: ReplyState, sess: object) -> Speculation | None:
        """Prompt-lookup speculation for one generation (models/runtime/speculative.py), greedy or
        sampled, on our own graphs where a verification pass is exact (DecoderSession.rows_exact), so the
        reply is the one plain decoding gives (for a sampled reply: the same seed's).
        Constrained replies (a grammar, tools) decode plainly too. Not for correctness: a verification
        pass gives raw rows and the loop masks each one with the grammar's state after the tokens before
        it, as plain decoding does; but llguidance advances only on emitted tokens, so a draft cannot be
        checked against the grammar before it is verified, and the drafter (copying the prompt) proposes
        mostly tokens the mask forbids in JSON/tool-call replies. Left off until measured."""
        if self.speculation == "off" or self.max_draft == 0:
            return None
        if r.constraint is not None or r.reader is not None:
            return None
        if not isinstance(sess, DecoderSession) or not sess.rows_exact:
            return None
        cost = self._row_costs.setdefault(self.session_key(), RowCost())
        return Speculation(r.sampler, cost, max_draft=self.max_draft)

    def _slot_for(self, ids: Sequence[int], scope: str = "") -> tuple[KVSlot, int]:
        """The slot sharing the longest prefix with `ids` (same variant, big enough, same cache scope), else
        a free or the least recently used one; how much of it is reused: reusable_prefix."""
        sess = self._session()
        exact, whole = positions_exact(sess), passes_exact(sess)
        best, best_n = None, 0
        for slot in self._slots:
            if slot.variant != self.variant or slot.cache.capacity < self.context_length:
                continue
            if slot.scope != scope:
                continue
            n = reusable_prefix(slot.cache, ids, exact, whole, self.prefill_chunk)
            if n > best_n or best is None:
                best, best_n = slot, n
        fits_another = len(self._slots) < kv_slot_count(
            self.context_length, self.shape.kv_bytes_per_token(), self.prefix_slots, self.prefix_budget_bytes
        )
        if best is None or (best_n == 0 and fits_another):
            if fits_another:
                best = KVSlot(self.new_cache(self.context_length), self.variant)
                self._slots.append(best)
            else:
                best = min(self._slots, key=lambda s: s.last_used)
                if best.cache.capacity < self.context_length:
                    self._slots.remove(best)
                    best = KVSlot(self.new_cache(self.context_length), self.variant)
                    self._slots.append(best)
            best_n = 0
        if best.scope != scope:  # another client's prompt: nothing of it is read, and it is forgotten
            best.cache.tokens = []
            best.scope = scope
        best.variant = self.variant
        best.last_used = time.monotonic()
        return best, best_n

    def apply_limits(self, limits: EngineLimits) -> bool:
        """Returns True when the KV contents are no longer valid for the active session (variant changed).
        `limits.model_id` is not the engine's to act on (a generation hands over when it names another)."""
        changed_variant = False
        if limits.threads is not None and limits.threads >= 1:
            self.threads = limits.threads
        if limits.variant is not None and limits.variant != self.variant:
            if limits.variant not in self.variants:
                log.warning(
                    "governor asked for variant %s, not installed; keeping %s", limits.variant, self.variant
                )
            else:
                self.variant = limits.variant
                changed_variant = True
        self.context_length = min(self.configured_context, limits.context_cap or self.configured_context)
        self.max_tokens_limit = limits.max_tokens
        self.tokens_per_second = limits.tokens_per_second
        self.governor_spin = limits.spin
        return changed_variant

    def batch_decoder(self, slots: int) -> BatchDecoder | None:
        """The decoder of up to `slots` replies at once (models/runtime/batch.py), built at the first call
        and kept with its KV rows until unload(); None when its replies run one at a time (logged once per
        variant, with BatchTraits.why_alone's reason: a graph of one sequence, rows that this CPU's kernels
        sum differently beside others, or a lone row that would need padding: see pad_batches)."""
        from models.runtime.batch import (
            BatchDecoder,  # batch.py builds on this module
            batch_traits,
        )

        # per session: a variant switch may bring other traits
        why = batch_traits(self._session()).why_alone(self.pad_batches)
        if why is not None:
            if self._batch_refused != self.variant:
                self._batch_refused = self.variant
                log.info("%s %s: one reply at a time: %s", self.model_id, self.variant, why)
            return None
        if isinstance(self._batch, BatchDecoder) and self._batch.slots == slots:
            return self._batch
        if self._batch is False:
            return None
        self._batch = None  # another size: the old rows go before the new ones are allocated
        try:
            self._batch = BatchDecoder(self, slots)
        except InvalidParameter:
            self._batch = False
            return None
        return self._batch

    def shrink_batch(self, slots: int) -> bool:
        """Drop the batch decoder when it holds rows for more than `slots` replies and none runs (memory
        pressure: server/serving/model_pool.py cap_rows): its KV rows go back now, and batch_decoder builds
        one of the size asked at the next batch. True if it went."""
        batch = self._batch
        if not isinstance(batch, bool) and batch is not None and batch.slots > slots and not batch.active:
            self._batch = None
            del batch
            release_freed_memory()
            return True
        return False

    def unload(self) -> None:
        self._batch = None
        self._sessions.clear()
        self._slots.clear()
        release_freed_memory()

    def reset_cache(self) -> None:
        """Forget the prefix-reuse KV contents (keeps the buffers)."""
        for slot in self._slots:
            slot.cache.tokens = []

    # -- prompts -------------------------------------------------------------------------------------
    def _fit(self, ids: list[int], reserve: int) -> bool:
        return len(ids) + max(reserve, 1) <= self.context_length

    def _too_long(self, n: int, reserve: int) -> ContextLengthExceeded:
        return ContextLengthExceeded(
            f"This model's context is {self.context_length} tokens; the prompt has {n} tokens"
            + (f" and {reserve} more were asked for the reply" if reserve else "")
            + ". Shorten the prompt, lower max_tokens, or set truncate=true.",
            param="messages",
            context_length=self.context_length,
            prompt_tokens=n,
        )

    def chat_prompt(
        self, messages: list[dict], *, truncate: bool = False, reserve: int = 0, tools: ToolUse | None = None
    ) -> Prompt:
        ids = self._encode_chat(messages, tools)
        chat = ChatTurns(messages, tools)
        if self._fit(ids, reserve):
            return Prompt(ids, chat=chat)
        if not truncate:
            raise self._too_long(len(ids), reserve)
        # sliding window: keep the system message(s) and as many of the newest turns as fit
        system, turns = window_split(messages)
        best, failed = newest_turns(
            turns,
            1,
            lambda start: self._encode_chat(system + turns[start:], tools),
            lambda candidate: self._fit(candidate, reserve),
        )
        if best is not None:
            return Prompt(best[1], truncated=True, dropped=best[0], chat=chat)
        # even the last turn alone is too long: keep its end
        ids = failed or ids
        budget = self.context_length - max(reserve, 1)
        if budget <= 0:
            raise self._too_long(len(ids), reserve)
        return Prompt(ids[-budget:], truncated=True, dropped=len(turns), chat=chat)

    @property
    def can_chat(self) -> bool:
        """False for a model without a chat template: /v1/chat/completions answers model_not_chat."""
        return self.template is not None

    def _encode_chat(self, messages: list[dict], tools: ToolUse | None = None) -> list[int]:
        if self.template is None:
            raise ModelNotChat.for_model(self.model_id)
        messages, shown = prepare_messages(messages, tools, self.tool_format)
        if shown is None:
            return encode_chat(self.template, self.tokenizer, messages)
        return encode_chat(self.template, self.tokenizer, messages, tools=shown)

    @cached_property
    def tool_format(self) -> CallFormat:
        """How this model calls tools (models/runtime/tools.py), read from its chat template."""
        return detect_format(self.template.source if self.template else None)

    def text_prompt(self, text: str | Sequence[int], *, truncate: bool = False, reserve: int = 0) -> Prompt:
        if isinstance(text, str):
            ids = self.tokenizer.encode(text)
        else:
            ids = list(text)
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidParameter(
                    f"prompt[{bad}]: {ids[bad]} is not a token id of this model's vocabulary "
                    f"(0..{self.vocab_size - 1})",
                    param=f"prompt[{bad}]",
                )
        if not ids:
            ids = [self.tokenizer.bos_id if self.tokenizer.bos_id is not None else 0]
        if self._fit(ids, reserve):
            return Prompt(ids)
        if not truncate:
            raise self._too_long(len(ids), reserve)
        return Prompt(ids[-(self.context_length - max(reserve, 1)) :], truncated=True)

    def continuation_prompt(
        self, request: list[dict] | str, reply: str, *, truncate: bool = False, reserve: int = 0
    ) -> Prompt:
        """This model's prompt for `request` followed by the reply so far, tokenized as one text (the
        reply's text is literal: a special token's text in it stays text). Keeps the end when it does not
        fit: the reply must go on, so a continuation never fails for length (truncate or not)."""
        if isinstance(request, list):
            if self.template is None:
                raise ModelNotChat.for_model(self.model_id)
            text, literal = self.template.render_marked(request)
            full = text + reply
            ids = self.tokenizer.encode(
                full, add_special_tokens=False, literal_spans=[*literal, (len(text), len(full))]
            )
            bos = self.tokenizer.bos_id
            if self.tokenizer.add_bos and bos is not None and ids[:1] != [bos]:
                ids.insert(0, bos)
            head = len(encode_chat(self.template, self.tokenizer, request))
        else:
            ids = self.tokenizer.encode(
                request + reply, literal_spans=[(len(request), len(request) + len(reply))]
            )
            head = len(self.tokenizer.encode(request))
        reply_tokens = max(0, len(ids) - head)
        room = self.context_length - max(reserve, 1)
        if len(ids) <= room:
            return Prompt(ids, reply_tokens=reply_tokens)
        return Prompt(ids[-max(1, room) :], truncated=True, reply_tokens=min(reply_tokens, max(1, room)))

    # -- generation ----------------------------------------------------------------------------------
    def constraint(self, params: GenerationParams) -> Constraint | None:
        """The grammar state a reply starts with (None: unconstrained). The tokenizer's llguidance
        vocabulary is built on first use (about a second per 50k tokens) and kept."""
        grammar = params.grammar
        if params.tools is not None:
            if grammar is not None:
                raise InvalidParameter("a grammar and tools cannot be used together", param="tools")
            grammar = tool_grammar(params.tools, self.tool_format)
        if grammar is None:
            return None
        return Constraint(
            grammar, ConstraintVocabulary.for_tokenizer(self.tokenizer), prefetch=self.mask_prefetch
        )

    def generate(
        self,
        prompt: Prompt | None,
        params: GenerationParams,
        *,
        cancel: CancelToken | None = None,
        step_hook: StepHook | None = None,
        resume: Handover | None = None,
    ) -> Iterator[TokenEvent | FinishEvent | Handover]:
        return _Generation(self, prompt, params, cancel or CancelToken(), step_hook, resume).run()


def _terminator(options: Any) -> Callable[[], None]:
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


class _Generation:
    """One request's state on one engine. Kept apart from the engine so the engine holds only long-lived
    state; what outlives this engine (a reply handed to another model) is in `self.r` (ReplyState)."""

    def __init__(
        self,
        engine: LlamaEngine,
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
            self.sess = None  # not held while the engine evicts it and builds the next one (_session)
            self.sess = self.e._session()
        if len(self.ctx) > self.e.context_length and self.params.truncate:
            self._window()

    def _window(self) -> None:
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
                    lambda start: e._encode_chat(system + turns[start:], w.tools),
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

    def _run(self, ids: Sequence[int], keep: int = 1) -> np.ndarray:
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
            logits = self._run(self.ctx[self.pos : end])

    def _advance(self, token: int, left: int) -> np.ndarray:
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
        logits = self._run([self.ctx[self.pos], *draft], keep=len(draft) + 1)
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
            self._window()
        self.slot, cached = e._slot_for(self.ctx, self.params.cache_scope)
        self.pos = cached
        t0 = time.perf_counter()
        self.logits = self._sync().copy()
        if not self.resumed:
            r.usage.cached_tokens = cached
            r.timings.prompt_n = len(self.ctx) - cached
            r.timings.prompt_ms = (time.perf_counter() - t0) * 1000

    def _start_constraint(self) -> None:
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
            self._start_constraint()
            self.sess = e._session()
            self.spec = e._speculation(r, self.sess)
            # A long prefill chunk is stopped between graph nodes (RunOptions.terminate). The options are
            # this generation's own: the token may be cancelled long after it ended (a client that leaves
            # late), and a flag on the shared session would then stop whichever request runs at that moment.
            # The token holds the options alone, not this generation: the generation (its session, its KV)
            # must go when it ends, although the token lives on (the reply moved to another model).
            self.cancel.on_cancel(_terminator(self.run_options))
            self._prefill()
            self._start_decode()
            last_emit = self.t_decode
            while True:
                event, ends = self._next_token()
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
                    self._window()
                # normally just the new token (and a draft); all of ctx after a switch
                self.logits = self._advance(self.ctx[-1], self._cap() - r.generated)
                if e.tokens_per_second:
                    # pacing: fewer tokens per second means less heat per second
                    wait = last_emit + 1.0 / e.tokens_per_second - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                last_emit = time.perf_counter()
            finish, held_text, end_calls = self._flush(finish)
        except Cancelled:
            finish = "cancelled"
        except _Full:
            finish = "length"
        except _Switch as switch:
            handed_over = True  # the grammar goes on with the next model
            self._end_speculation()  # before the next model runs: drafting starts afresh there
            yield self._handover(switch.limits)
            return
        finally:
            if r.constraint is not None and not handed_over:
                r.constraint.close()
            self._end_speculation()
        yield self._finish_event(finish, held_text, end_calls)

    # -- one token at a time: the steps run() takes, which a batch of replies (batch.py) takes per row ------
    def _start_decode(self) -> None:
        """After the prefill: the reply's bound (the sliding window adds WINDOW_REPLY_CONTEXTS, as a window
        never runs out of context) and the start of its decode time."""
        e, p = self.e, self.params
        max_tokens = p.max_tokens
        if p.truncate:
            bound = e.window_reply_contexts * e.context_length
            max_tokens = bound if max_tokens is None else min(max_tokens, bound)
        self.max_tokens = max_tokens
        self.t_decode = time.perf_counter()

    def _cap(self) -> int:
        return min(x for x in (self.max_tokens, self.e.max_tokens_limit, 1 << 30) if x is not None)

    def _next_token(self) -> tuple[TokenEvent | None, FinishReason | None]:
        """Sample the next token from self.logits and account for it: (its event, or None when the reply
        ends before one; the finish reason when the reply ends here, else None). The token is appended to
        ctx, so the next forward pass feeds ctx[-1]."""
        e, p, r = self.e, self.params, self.r
        cap = self._cap()
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

    def _flush(self, finish: FinishReason) -> tuple[FinishReason, str, tuple[ToolCallDelta, ...]]:
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

    def _handover(self, limits: EngineLimits) -> Handover:
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

    def _finish_event(
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

    def _end_speculation(self) -> None:
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


def load_engine(model_dir: Path, **kwargs: Any) -> LlamaEngine:
    """Open a converted model folder (its manifest.json next to the ONNX files)."""
    manifest = json.loads((Path(model_dir) / "manifest.json").read_text())
    return LlamaEngine(Path(model_dir), manifest, **kwargs)
