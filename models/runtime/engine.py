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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import Cancelled, ContextLengthExceeded, InvalidParameter, ModelNotChat, ModelNotInstalled
from models.protocol import EngineLimits, Prompt, StepHook
from models.runtime.chat import ChatTemplate, encode_chat
from models.runtime.constraint import Constraint, ConstraintVocabulary
from models.runtime.genai_config import DecoderIO, load_tokenizer
from models.runtime.sampling import Sampler, make_rng
from models.runtime.session import DecoderSession, GeneralDecoderSession, KVCache, ModelShape
from models.runtime.stops import StopMatcher
from models.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from models.runtime.tools import CallFormat, CallReader, detect_format, prepare_messages, tool_grammar
from models.types import (
    CancelToken,
    FinishEvent,
    GenerationParams,
    Timings,
    TokenEvent,
    ToolCallDelta,
    ToolUse,
    TopLogprob,
    Usage,
)

log = logging.getLogger("simmer.engine")

# A reply with no max_tokens under a sliding window (truncate) stops after this many contexts' worth of
# tokens if no EOS or stop string ends it first: Ollama's bound for open-ended generation (10 x num_ctx).
OPEN_ENDED_CONTEXTS = 10


@dataclass
class KVSlot:
    cache: Any  # KVCache, or for a foreign decoder SharedKV / GrowingKV
    variant: str
    last_used: float = field(default_factory=time.monotonic)

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


class LlamaEngine:
    """Implements models.protocol.Engine for a converted model folder."""

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
    ) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = manifest
        self.model_id = model_id or manifest.get("id", self.model_dir.name)
        self.variants = variant_order(manifest)
        if not self.variants:
            raise ModelNotInstalled(f"{self.model_id}: the manifest lists no variants")
        chosen = variant or manifest.get("default_variant") or self.variants[0]
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
        self.max_sessions = max(1, max_sessions)
        self.mask_prefetch = mask_prefetch  # constrained decoding: next mask during the forward pass
        self.max_tokens_limit: int | None = None
        self.tokens_per_second: float | None = None
        # A folder installed as is (onnxruntime-genai layout) runs on the general path; ours on the fast one.
        genai = manifest["variants"][self.variant].get("genai")
        self.io = DecoderIO.from_dict(genai) if genai else None
        if self.io is not None:
            self.tokenizer = load_tokenizer(self.model_dir, self.io)
        else:
            self.tokenizer = Tokenizer.load(self.model_dir)
        # `chat_template` (the operator's, SIMMER_CHAT_TEMPLATE) replaces the model's; None: no chat
        self.template = ChatTemplate.from_tokenizer(self.tokenizer, chat_template)
        self._sessions: dict[tuple[str, int, bool], DecoderSession | GeneralDecoderSession] = {}
        self._slots: list[KVSlot] = []
        self._session()  # load now: a broken model fails at start, not at the first request

    # -- sessions and KV slots -----------------------------------------------------------------------
    def _session(self) -> DecoderSession | GeneralDecoderSession:
        key = self.session_key()
        sess = self._sessions.pop(key, None)
        if sess is None:
            t0 = time.perf_counter()
            entry = self.manifest["variants"][self.variant]
            if self.io is not None:
                sess = GeneralDecoderSession(
                    self.model_dir / entry["file"], self.io, self.threads, spinning=key[2]
                )
            else:
                sess = DecoderSession(
                    self.model_dir / entry["file"], self.shape, self.threads, spinning=key[2]
                )
            log.info(
                "loaded %s/%s with %d threads in %.2f s",
                self.model_id,
                self.variant,
                self.threads,
                time.perf_counter() - t0,
            )
        self._sessions[key] = sess  # most recently used last
        evicted = False
        while len(self._sessions) > self.max_sessions:
            self._sessions.pop(next(iter(self._sessions)))
            evicted = True
        if evicted:
            release_freed_memory()
        return sess

    def new_cache(self, capacity: int) -> Any:
        """A KV cache of the layout the model needs (ours: one shared fp32 buffer)."""
        if self.io is None:
            return KVCache(self.shape, capacity)
        sess = self._session()
        assert isinstance(sess, GeneralDecoderSession)  # a folder's decoder I/O: the general path
        return sess.new_cache(capacity)

    def session_key(self) -> tuple[str, int, bool]:
        """Spinning thread pools decode about 40 % faster at the same CPU time per token when tokens come
        back to back, but burn the gaps of a paced stream: "auto" spins only while unpaced."""
        spinning = self.spin == "on" or (self.spin == "auto" and not self.tokens_per_second)
        return (self.variant, self.threads, spinning)

    def _slot_for(self, ids: Sequence[int]) -> tuple[KVSlot, int]:
        """The slot sharing the longest prefix with `ids` (same variant, big enough), else a free or the
        least recently used one. At least one token is always left to prefill (we need its logits)."""
        best, best_n = None, 0
        for slot in self._slots:
            if slot.variant != self.variant or slot.cache.capacity < self.context_length:
                continue
            n = min(common_prefix(slot.tokens, ids), len(ids) - 1)
            if n > best_n or best is None:
                best, best_n = slot, n
        slot_bytes = self.shape.kv_bytes_per_token() * self.context_length
        fits_another = len(self._slots) < self.prefix_slots and (len(self._slots) + 1) * slot_bytes <= max(
            self.prefix_budget_bytes, slot_bytes
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
        best.variant = self.variant
        best.last_used = time.monotonic()
        return best, best_n

    def apply_limits(self, limits: EngineLimits) -> bool:
        """Returns True when the KV contents are no longer valid for the active session (variant changed)."""
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
        return changed_variant

    def unload(self) -> None:
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
        )

    def chat_prompt(
        self, messages: list[dict], *, truncate: bool = False, reserve: int = 0, tools: ToolUse | None = None
    ) -> Prompt:
        ids = self._encode_chat(messages, tools)
        if self._fit(ids, reserve):
            return Prompt(ids)
        if not truncate:
            raise self._too_long(len(ids), reserve)
        # sliding window: keep the system message(s) and as many of the newest turns as fit
        system = [m for m in messages if m.get("role") == "system"][:1]
        rest = [m for m in messages if m not in system]
        while len(rest) > 1:
            rest = rest[1:]
            # a window should start with a user turn, as chats do
            while len(rest) > 1 and rest[0].get("role") != "user":
                rest = rest[1:]
            ids = self._encode_chat(system + rest, tools)
            if self._fit(ids, reserve):
                return Prompt(ids, truncated=True)
        # even the last turn alone is too long: keep its end
        budget = self.context_length - max(reserve, 1)
        if budget <= 0:
            raise self._too_long(len(ids), reserve)
        return Prompt(ids[-budget:], truncated=True)

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

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special, parse_special=parse_special)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.tokenizer.vocab_size:
            raise IndexError(f"token id {token_id} is outside the vocabulary ({self.tokenizer.vocab_size})")
        return self.tokenizer.token_bytes(token_id)

    def chat_text(self, messages: list[dict]) -> str:
        if self.template is None:
            raise ModelNotChat.for_model(self.model_id)
        return self.template.render(messages)

    def text_prompt(self, text: str, *, truncate: bool = False, reserve: int = 0) -> Prompt:
        ids = self.tokenizer.encode(text)
        if not ids:
            ids = [self.tokenizer.bos_id if self.tokenizer.bos_id is not None else 0]
        if self._fit(ids, reserve):
            return Prompt(ids)
        if not truncate:
            raise self._too_long(len(ids), reserve)
        return Prompt(ids[-(self.context_length - max(reserve, 1)) :], truncated=True)

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
        prompt: Prompt,
        params: GenerationParams,
        *,
        cancel: CancelToken | None = None,
        step_hook: StepHook | None = None,
    ) -> Iterator[TokenEvent | FinishEvent]:
        return _Generation(self, prompt, params, cancel or CancelToken(), step_hook).run()


class _Generation:
    """One request's state. Kept apart from the engine so the engine holds only long-lived state."""

    def __init__(
        self,
        engine: LlamaEngine,
        prompt: Prompt,
        params: GenerationParams,
        cancel: CancelToken,
        hook: StepHook | None,
    ) -> None:
        self.e = engine
        self.prompt = prompt
        self.params = params
        self.cancel = cancel
        self.hook = hook
        self.truncated = prompt.truncated
        self.timings = Timings()
        self.usage = Usage(prompt_tokens=len(prompt.ids))
        self.history: list[int] = list(prompt.ids)  # prompt + reply, append-only (the sampler's view)
        self.ctx: list[int] = list(prompt.ids)  # what the model conditions on (a window of history)
        self.sess: DecoderSession | GeneralDecoderSession | None = None
        self.slot: KVSlot | None = None
        self.pos = 0  # ctx[:pos] is in the KV slot
        self.stale = False  # the KV slot must be rebuilt from ctx (variant switch, sliding window)

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
        old = self.e.session_key()
        if self.e.apply_limits(limits):
            self.stale = True  # the KV cache was computed by other weights
        if self.e.session_key() != old:
            self.sess = self.e._session()
        if len(self.ctx) > self.e.context_length and self.params.truncate:
            self._window()

    def _window(self) -> None:
        """Context full (or the cap lowered): keep the newest half of the context, a sliding window."""
        log.info("context cap %d reached: sliding window", self.e.context_length)
        self.ctx = self.ctx[-(self.e.context_length // 2) :]
        self.truncated = True
        self.stale = True

    def _run(self, ids: Sequence[int]) -> np.ndarray:
        assert self.sess is not None and self.slot is not None
        cache = self.slot.cache
        if self.pos + len(ids) > cache.capacity:  # the cap was raised above this slot's buffer
            bigger = self.e.new_cache(max(self.e.context_length, self.pos + len(ids)))
            bigger.copy_prefix_from(cache, self.pos)
            self.slot.cache = cache = bigger
        self.sess.reset_terminate()
        try:
            logits = self.sess.run(np.asarray(ids, dtype=np.int64), cache, self.pos)
        except Exception as e:
            cache.tokens = []  # partially written: never reuse
            if self.cancel.cancelled:
                raise Cancelled("the request was cancelled") from e
            raise
        del cache.tokens[self.pos :]
        cache.tokens.extend(ids)
        self.pos += len(ids)
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
            logits = self._run(self.ctx[self.pos : self.pos + self.e.prefill_chunk])

    def run(self) -> Iterator[TokenEvent | FinishEvent]:
        e, p = self.e, self.params
        t_start = time.perf_counter()
        detok = IncrementalDetokenizer(e.tokenizer)
        stops = StopMatcher(p.stop)
        sampler = Sampler(p.sampling, make_rng(p.sampling.seed), prompt_len=len(self.prompt.ids))
        constraint: Constraint | None = None
        calling = p.tools is not None and p.tools.choice != "none"
        reader = CallReader(e.tool_format) if calling else None
        end_calls: tuple[ToolCallDelta, ...] = ()
        finish = "length"
        generated = 0
        held_text = ""
        try:
            self._checkpoint()
            constraint = e.constraint(p)
            if constraint is not None:
                constraint.prefetch()  # the first mask, during the prefill
            self.sess = e._session()
            # a long prefill chunk is stopped between graph nodes (RunOptions.terminate)
            self.cancel.on_cancel(lambda: self.sess.terminate() if self.sess else None)
            ids = self.prompt.ids
            if len(ids) >= e.context_length:
                raise ContextLengthExceeded(
                    f"This model's context is {e.context_length} tokens; the prompt has {len(ids)} tokens.",
                    param="messages",
                )
            self.slot, cached = e._slot_for(ids)
            self.pos = cached
            self.usage.cached_tokens = cached
            t0 = time.perf_counter()
            self.logits = self._sync().copy()
            self.timings.prompt_n = len(ids) - cached
            self.timings.prompt_ms = (time.perf_counter() - t0) * 1000
            max_tokens = p.max_tokens
            if max_tokens is None and p.truncate:
                # A sliding window never runs out of context: bound the open-ended reply (as Ollama does).
                max_tokens = OPEN_ENDED_CONTEXTS * e.context_length
            t_decode = time.perf_counter()
            last_emit = t_decode
            while True:
                limit = e.max_tokens_limit
                cap = min(x for x in (max_tokens, limit, 1 << 30) if x is not None)
                if generated >= cap:
                    finish = "length"
                    break
                allowed = constraint.allowed() if constraint is not None else None
                token, logprob, top = sampler.sample(self.logits, self.history, allowed)
                if token in e.tokenizer.eos_ids and (not p.ignore_eos or constraint is not None):
                    finish = "stop"
                    break
                if constraint is not None:
                    # The state moves on emitted tokens only (a variant switch re-prefills the same ones);
                    # the next mask is computed while the model runs its forward pass.
                    constraint.advance(token)
                    constraint.prefetch()
                generated += 1
                self.history.append(token)
                self.ctx.append(token)
                delta, hit = stops.feed(detok.feed(token))
                calls: tuple[ToolCallDelta, ...] = ()
                if reader is not None:
                    delta, found = reader.feed(delta)
                    calls = tuple(found)
                if generated == 1:
                    self.timings.ttft_ms = (time.perf_counter() - t_start) * 1000
                yield TokenEvent(
                    token_id=token,
                    text=delta,
                    index=generated - 1,
                    logprob=logprob if p.sampling.logprobs is not None else None,
                    top_logprobs=self._top(top) if p.sampling.logprobs else None,
                    token_text=e.tokenizer.token_text(token) if p.sampling.logprobs is not None else None,
                    elapsed_ms=(time.perf_counter() - t_start) * 1000,
                    tool_calls=calls,
                )
                if hit:
                    finish = "stop"
                    break
                if generated >= cap:
                    finish = "length"
                    break
                self._checkpoint()
                if len(self.ctx) > e.context_length:
                    if not p.truncate:
                        finish = "length"
                        break
                    self._window()
                self.logits = self._sync()  # normally just the new token; all of ctx after a switch
                if e.tokens_per_second:
                    # pacing: fewer tokens per second means less heat per second
                    wait = last_emit + 1.0 / e.tokens_per_second - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                last_emit = time.perf_counter()
            if not stops.stopped:  # bytes and text held back for a possible stop are the reply's end
                tail, _ = stops.feed(detok.flush())
                held_text = tail + stops.flush()
            if reader is not None:
                held_text, found = reader.feed(held_text)
                rest, more = reader.flush()
                held_text += rest
                end_calls = tuple(found + more)
                if reader.calls and finish == "stop":
                    finish = "tool_calls"
            self.timings.predicted_n = generated
            self.timings.predicted_ms = (time.perf_counter() - t_decode) * 1000
        except Cancelled:
            finish = "cancelled"
        finally:
            if constraint is not None:
                constraint.close()
        t = self.timings
        t.prompt_per_second = t.prompt_n / (t.prompt_ms / 1000) if t.prompt_ms > 0 else 0.0
        t.predicted_per_second = t.predicted_n / (t.predicted_ms / 1000) if t.predicted_ms > 0 else 0.0
        self.usage.completion_tokens = generated
        yield FinishEvent(
            finish_reason=finish,
            usage=self.usage,
            timings=t,
            truncated=self.truncated,
            variant=e.variant,
            text=held_text,
            tool_calls=end_calls,
        )

    def _top(self, top: Any) -> tuple[TopLogprob, ...] | None:
        if not top:
            return None
        tok = self.e.tokenizer
        return tuple(TopLogprob(tok.token_text(i), lp, list(tok.token_bytes(i))) for i, lp in top)


def load_engine(model_dir: Path, **kwargs: Any) -> LlamaEngine:
    """Open a converted model folder (its manifest.json next to the ONNX files)."""
    manifest = json.loads((Path(model_dir) / "manifest.json").read_text())
    return LlamaEngine(Path(model_dir), manifest, **kwargs)
