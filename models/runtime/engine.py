"""The engine: one converted model, its sessions, its prefix-reuse KV slots and the limits in force.

    chat_prompt / text_prompt / continuation_prompt -> generate -> generation.Generation(...).run()
What outlives a reply lives here: the sessions per (variant, threads, spinning), the KV slots a new prompt
reuses the longest prefix of, the governor's limits, the batch decoder (models/runtime/batch.py). One reply
(prefill, decode, sampling, streaming, its handover) is models/runtime/generation.py; a batch of replies
takes the same steps per row. Everything runs on the caller's thread (the server's one worker).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from models.errors import (
    ContextLengthExceeded,
    InvalidParameter,
    ModelNotChat,
    ModelNotInstalled,
)
from models.protocol import ChatTurns, EngineLimits, Prompt, StepHook, pool_spins
from models.runtime.batch import BatchDecoder, batch_traits
from models.runtime.chat import ChatTemplate, encode_chat
from models.runtime.constraint import Constraint, ConstraintVocabulary
from models.runtime.genai_config import DecoderIO
from models.runtime.generation import Generation, KVSlot, passes_exact, positions_exact, reusable_prefix
from models.runtime.reply import ReplyState
from models.runtime.session import (
    DecoderSession,
    GeneralDecoderSession,
    KVCache,
    ModelShape,
    kv_slot_count,
)
from models.runtime.speculative import MAX_DRAFT, RowCost, Speculation
from models.runtime.text_side import TextSideMixin, read_tokenizer
from models.runtime.tokenizer import tokenizer_key
from models.runtime.tools import CallFormat, detect_format, prepare_messages, tool_grammar
from models.runtime.turns import TurnDecoder
from models.runtime.window import newest_turns, window_split
from models.types import (
    NOMINAL_VARIANT,
    CancelToken,
    FinishEvent,
    GenerationParams,
    Handover,
    TokenEvent,
    ToolUse,
)

log = logging.getLogger("simmer.engine")

# A reply under a sliding window (truncate) never runs out of context: without a bound, one that no EOS or
# stop string ends runs until its client leaves, and so does one whose max_tokens is huge (1e300 is a valid
# integer). It stops (finish_reason "length") after this many contexts' worth of tokens, whatever max_tokens
# asks: by default one context, where llama.cpp's server (context shift off) stops a reply that fills its
# context. Ollama's bound is 10 x num_ctx (SIMMER_WINDOW_REPLY_CONTEXTS=10).
WINDOW_REPLY_CONTEXTS = 1


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS after dropping a session: glibc keeps them otherwise, and a
    governor that switches variants would look like a leak (RSS only grows)."""
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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


class DecoderEngine(TextSideMixin):
    """Implements models.protocol.Engine for a converted model folder: a decoder-only transformer of any
    family the converter writes (models/convert/families/: llama, qwen2, qwen3, gemma3), or a folder
    installed as onnxruntime-genai laid it out (the general path)."""

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
        batch: str = "exact",
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
        if batch not in ("exact", "fast"):
            raise InvalidParameter(f"batch must be exact or fast, not {batch!r}", param="batch")
        # SIMMER_BATCH: "exact" batches only where a reply's text cannot depend on its neighbours (elsewhere
        # they take turns); "fast" batches wherever the graph has rows (batch_decoder)
        self.batch = batch
        self.max_draft = max(0, max_draft)
        self._row_costs: dict[tuple[str, int, bool], RowCost] = {}  # per session: what a verified row costs
        self.max_sessions = max(1, max_sessions)
        self.mask_prefetch = mask_prefetch  # constrained decoding: next mask during the forward pass
        self.max_tokens_limit: int | None = None
        self.window_reply_contexts = max(1, window_reply_contexts)
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
        self._fresh: set[tuple[str, int, bool]] = set()  # built beside the worker, not used yet
        self._unloads = 0
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
        self.session()  # load now: a broken model fails at start, not at the first request

    # -- sessions and KV slots -----------------------------------------------------------------------
    def session(self) -> DecoderSession | GeneralDecoderSession:
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
            # built beside the worker (session_build), in use from now on; the one it replaces stays until
            # retire_sessions(): its teardown here would stop the reply for as long
            self._fresh.discard(key)
        return sess

    def retire_sessions(self) -> bool:
        if not self._evict(self.max_sessions):
            return False
        release_freed_memory()
        return True

    def session_build(self, limits: EngineLimits) -> Callable[[], None] | None:
        """The session `limits` would run on (other threads, spinning or variant), as a build to run on
        another thread before they apply, so that the reply they come to never waits for it; None when that
        session exists. Nothing is applied: the engine runs on its limits until apply_limits. The build only
        adds its session (a key no running reply uses), so the worker's own use of the others goes on."""
        variant = limits.variant if limits.variant in self.variants else self.variant
        threads = limits.threads if limits.threads is not None and limits.threads >= 1 else self.threads
        key = (variant, threads, pool_spins(self.spin, limits.spin, threads))
        if key in self._sessions or len(self._sessions) > self.max_sessions:
            # built, or a replaced session is still kept (retire_sessions): the memory plan counted room for
            # one more session, not two
            return None
        unloads = self._unloads

        def build() -> None:
            t0 = time.perf_counter()
            with self.building():
                sess = self._open_session(*key)
            if self._unloads != unloads:
                return  # unloaded meanwhile: its memory goes back with it
            self._fresh.add(key)  # kept from eviction until its first use (session())
            self._sessions.setdefault(key, sess)
            log.info(
                "built %s/%s with %d threads beside the worker in %.2f s",
                self.model_id,
                variant,
                threads,
                time.perf_counter() - t0,
            )

        return build

    def _build_session(self, spinning: bool) -> DecoderSession | GeneralDecoderSession:
        return self._open_session(self.variant, self.threads, spinning)

    def _open_session(
        self, variant: str, threads: int, spinning: bool
    ) -> DecoderSession | GeneralDecoderSession:
        entry = self.manifest["variants"][variant]
        if self.io is not None:
            return GeneralDecoderSession(self.model_dir / entry["file"], self.io, threads, spinning=spinning)
        sess = DecoderSession(
            self.model_dir / entry["file"],
            self.shape,
            threads,
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
        while True:
            # one built beside the worker and not used yet stays: limits about to apply need it
            old = [k for k in self._sessions if k not in self._fresh]
            if len(old) <= max(0, keep - (len(self._sessions) - len(old))):
                return evicted
            self._sessions.pop(old[0])
            evicted = True

    def new_cache(self, capacity: int) -> Any:
        """A KV cache of the layout the model needs (ours: one shared buffer, of the graph's KV type), its
        pages written now when `kv_prefault` (see kv_zeros)."""
        if self.io is None:
            return KVCache(self.session().shape, capacity, self.kv_prefault)
        sess = self.session()
        assert isinstance(sess, GeneralDecoderSession)  # a folder's decoder I/O: the general path
        return sess.new_cache(capacity, self.kv_prefault)

    def session_key(self) -> tuple[str, int, bool]:
        """Spinning thread pools decode faster when tokens come back to back, but burn the gaps of a paced
        stream: see pool_spins."""
        spinning = pool_spins(self.spin, self.governor_spin, self.threads)
        return (self.variant, self.threads, spinning)

    @property
    def reuse_tail(self) -> int:
        """Prompt tokens a reused prefix always leaves to prefill (reusable_prefix): 1, or 2 where this
        session's one-position passes are not exact."""
        return 1 if positions_exact(self.session()) else 2

    @property
    def speculates(self) -> bool:
        """Whether requests speculate on the current variant (see speculation_for)."""
        sess = self.session()
        return (
            self.speculation != "off"
            and self.max_draft > 0
            and isinstance(sess, DecoderSession)
            and sess.rows_exact
        )

    def speculation_for(self, r: ReplyState, sess: object) -> Speculation | None:
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

    def slot_for(self, ids: Sequence[int], scope: str = "") -> tuple[KVSlot, int]:
        """The slot sharing the longest prefix with `ids` (same variant, big enough, same cache scope), else
        a free or the least recently used one; how much of it is reused: reusable_prefix."""
        sess = self.session()
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
            self.context_length, sess.shape.kv_bytes_per_token(), self.prefix_slots, self.prefix_budget_bytes
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
        self.governor_spin = limits.spin
        return changed_variant

    def batch_decoder(self, slots: int) -> BatchDecoder | None:
        """The decoder of up to `slots` replies at once, built at the first call and kept with its KV rows
        until unload(): a batch (models/runtime/batch.py) where this session's rows may share a pass, else
        replies taking turns in one-row passes of their own (models/runtime/turns.py; logged once per
        variant, with BatchTraits.why_alone's reason: a graph of one sequence, rows that this CPU's kernels
        sum differently beside others, or a lone row that would need padding: see pad_batches). With
        `batch` "fast" (SIMMER_BATCH) a graph of rows batches whatever its rows do, unpadded: a reply's text
        may then depend on the replies beside it. None for a foreign decoder (its own KV layout): its
        replies run one at a time."""
        # per session: a variant switch may bring other traits
        traits = batch_traits(self.session())
        why = traits.why_alone(self.pad_batches)
        fast = why is not None and traits.rows and self.batch == "fast"
        if why is not None and self._batch_refused != self.variant:
            self._batch_refused = self.variant
            if fast:
                log.warning("%s %s: batched anyway (SIMMER_BATCH=fast): %s", self.model_id, self.variant, why)
            else:
                log.info("%s %s: replies take turns, not a batch: %s", self.model_id, self.variant, why)
        kind = TurnDecoder if why is not None and not fast else BatchDecoder
        pad = False if fast else None  # fast: a lone reply is not padded to two rows either
        batch = self._batch
        if type(batch) is kind and batch.slots == slots and (kind is TurnDecoder or batch.pad == pad):
            return batch
        if batch is False:
            return None
        self._batch = None  # another size or kind: the old rows go before the new ones are allocated
        try:
            self._batch = (
                TurnDecoder(self, slots) if kind is TurnDecoder else BatchDecoder(self, slots, pad=pad)
            )
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
        self._unloads += 1  # a session being built beside the worker is dropped when done
        self._fresh.clear()
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
        ids = self.chat_ids(messages, tools)
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
            lambda start: self.chat_ids(system + turns[start:], tools),
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

    def chat_ids(self, messages: list[dict], tools: ToolUse | None = None) -> list[int]:
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
        return Generation(self, prompt, params, cancel or CancelToken(), step_hook, resume).run()


def load_engine(model_dir: Path, **kwargs: Any) -> DecoderEngine:
    """Open a converted model folder (its manifest.json next to the ONNX files)."""
    manifest = json.loads((Path(model_dir) / "manifest.json").read_text())
    return DecoderEngine(Path(model_dir), manifest, **kwargs)
