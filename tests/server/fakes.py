"""Engines for server tests, through the real seam (models.protocol.Engine), no patching.

- `ScriptedEngine`: a deterministic stand-in. Prompts tokenize one character per token; the reply is the
  words of a fixed text, one word per token, with a configurable time per token.
- `RecordingEngine`: wraps ANY engine (scripted or real) and records each generate() call using only what
  the contract exposes, so the same assertions hold against the real ONNX engine.
- `FakeGovernor`: a gate through the real seam that publishes one state change mid-reply.
- `PaceGate`: a gate that holds a tokens/s pace as the governor's gate does (the tests slow the tiny model
  so: nothing else paces a reply).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from governor.background import BackgroundWork
from models.errors import Cancelled, ContextLengthExceeded
from models.protocol import BatchDecoding, Engine, EngineLimits, Prompt, StepHook
from models.types import (
    CancelToken,
    FinishEvent,
    GenerationParams,
    Handover,
    Timings,
    TokenEvent,
    ToolUse,
    TopLogprob,
    Usage,
)
from server.serving.contracts import Gate, NoGate
from server.serving.governor_gate import pace_idle

REPLY = "The quick brown fox jumps over the lazy dog and keeps running through the quiet field."


class ScriptedEngine:
    def __init__(
        self,
        *,
        model_id: str = "scripted-test",
        variant: str = "q4",
        context_length: int = 512,
        token_delay_s: float = 0.0,
        reply: str = REPLY,
        reply_tokens: int | None = None,
        can_chat: bool = True,
        tokenizer_key: str = "chars",
    ) -> None:
        self.model_id = model_id
        self.variant = variant
        self.variants: Sequence[str] = (variant,)
        self.context_length = context_length
        self.threads = 1
        self.can_chat = can_chat
        self.tokenizer_key = tokenizer_key
        self.model_dir: Path | None = None  # no folder: the catalog knows it by what it says of itself
        self.manifest: Mapping[str, Any] | None = None
        self.vocab_size = 0x110000  # prompt ids are code points; reply ids (1000 + n) stay below it
        self.token_delay_s = token_delay_s
        self._words = re.findall(r"\s*\S+", reply)
        # Tokens before "EOS" (finish_reason stop); the reply's words are cycled to reach it.
        self.reply_tokens = len(self._words) if reply_tokens is None else reply_tokens
        self._last_prompt: list[int] = []
        self.applied_limits: list[EngineLimits] = []
        self.last_tools: ToolUse | None = None

    # ---- prompts: one character per token --------------------------------------------------------

    @staticmethod
    def _render(messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def _fit(self, ids: list[int], reserve: int, truncate: bool) -> Prompt:
        room = self.context_length - reserve
        if len(ids) <= room:
            return Prompt(ids)
        if not truncate:
            raise ContextLengthExceeded(
                f"The prompt is {len(ids)} tokens; with {reserve} reserved it exceeds the context of "
                f"{self.context_length} tokens",
                param="messages",
                context_length=self.context_length,
                prompt_tokens=len(ids),
            )
        return Prompt(ids[len(ids) - room :], truncated=True)

    def chat_prompt(
        self, messages: list[dict], *, truncate: bool = False, reserve: int = 0, tools: ToolUse | None = None
    ) -> Prompt:
        self.last_tools = tools
        ids = [ord(c) for c in self._render(messages)]
        if truncate and len(ids) + reserve > self.context_length:
            # Sliding window: keep system messages, drop the oldest other turns while it does not fit.
            kept = list(messages)
            while len(kept) > 1 and len(self._render(kept)) + reserve > self.context_length:
                drop = next((i for i, m in enumerate(kept) if m["role"] != "system"), None)
                if drop is None or drop == len(kept) - 1:
                    break
                kept.pop(drop)
            prompt = self._fit([ord(c) for c in self._render(kept)], reserve, truncate)
            return Prompt(prompt.ids, truncated=True)
        return self._fit(ids, reserve, truncate)

    def text_prompt(self, text: str | Sequence[int], *, truncate: bool = False, reserve: int = 0) -> Prompt:
        return self._fit([ord(c) for c in text] if isinstance(text, str) else list(text), reserve, truncate)

    # ---- the tokenizer side: code points are the ids --------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} is outside the vocabulary")
        # A surrogate code point stands for bytes that are no UTF-8 text (a partial character's piece).
        return chr(token_id).encode("utf-8", "surrogatepass")

    def chat_text(self, messages: list[dict]) -> str:
        return self._render(messages)

    def continuation_prompt(
        self, request: list[dict] | str, reply: str, *, truncate: bool = False, reserve: int = 0
    ) -> Prompt:
        head = self._render(request) if isinstance(request, list) else request
        ids = [ord(c) for c in head + reply]
        return Prompt(ids[-max(1, self.context_length - reserve) :], reply_tokens=len(reply))

    # ---- generation ------------------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        params: GenerationParams,
        *,
        cancel: CancelToken | None = None,
        step_hook: StepHook | None = None,
        resume: Handover | None = None,
    ) -> Iterator[TokenEvent | FinishEvent | Handover]:
        """One word per token. A step hook naming another model ends with a Handover; `resume` goes on
        from another engine's (its words counted, its text kept)."""
        cancel = cancel or CancelToken()
        if prompt is None:
            assert resume is not None and resume.tokenizer_key == self.tokenizer_key
            prompt = Prompt(list(resume.state["prompt"]))
        wake = threading.Event()
        cancel.on_cancel(wake.set)  # so a per-token wait ends at once on cancel
        cached = 0
        for a, b in zip(prompt.ids, self._last_prompt, strict=False):
            if a != b:
                break
            cached += 1
        self._last_prompt = list(prompt.ids)
        t0 = time.perf_counter()
        max_tokens = params.max_tokens
        room = self.context_length - len(prompt.ids)
        text = resume.text if resume else ""
        n = resume.generated if resume else 0
        by_model = dict(resume.state["by_model"]) if resume else {}
        first_at = None
        reason = "stop"
        final_text = ""
        while True:
            try:
                limits = step_hook() if step_hook else None
            except Cancelled:
                reason = "cancelled"
                break
            if limits is not None and limits.model_id not in (None, self.model_id):
                state = {"prompt": list(prompt.ids), "by_model": by_model}
                yield Handover(limits.model_id, limits.variant, self.tokenizer_key, text, n, state)
                return
            if limits is not None:
                self.applied_limits.append(limits)
                if limits.max_tokens is not None:
                    max_tokens = min(max_tokens or limits.max_tokens, limits.max_tokens)
            if cancel.cancelled:
                reason = "cancelled"
                break
            if n >= self.reply_tokens:
                reason = "stop"
                break
            if (max_tokens is not None and n >= max_tokens) or n >= room:
                reason = "length"
                break
            if self.token_delay_s > 0 and wake.wait(self.token_delay_s):
                reason = "cancelled"
                break
            word = self._words[n % len(self._words)]
            hit = next((s for s in params.stop if s in text + word), None)
            if hit is not None:
                # Emit only the text before the stop string.
                final_text = (text + word)[: (text + word).index(hit)][len(text) :]
                reason = "stop"
                break
            text += word
            first_at = first_at or time.perf_counter()
            yield self._token(n, word, params, (time.perf_counter() - t0) * 1000)
            n += 1
            by_model[self.model_id] = by_model.get(self.model_id, 0) + 1
        elapsed = time.perf_counter() - t0
        first = (first_at - t0) if first_at else elapsed
        decode_s = max(elapsed - first, 1e-9)
        timings = Timings(
            prompt_n=len(prompt.ids) - cached,
            prompt_ms=first * 1000,
            prompt_per_second=(len(prompt.ids) - cached) / max(first, 1e-9),
            predicted_n=n,
            predicted_ms=decode_s * 1000,
            predicted_per_second=n / decode_s if n > 1 else 0.0,
            ttft_ms=first * 1000,
        )
        yield FinishEvent(
            finish_reason=reason,  # type: ignore[arg-type]
            usage=Usage(
                prompt_tokens=len(prompt.ids), completion_tokens=n, cached_tokens=cached, by_model=by_model
            ),
            timings=timings,
            truncated=prompt.truncated,
            variant=self.variant,
            text=final_text,
            model_id=self.model_id,
        )

    def _token(self, n: int, word: str, params: GenerationParams, elapsed_ms: float) -> TokenEvent:
        k = params.sampling.logprobs
        if k is None:
            return TokenEvent(token_id=1000 + n, text=word, index=n, elapsed_ms=elapsed_ms)
        alternatives = [word, *(w for w in self._words if w != word)][:k]
        tops = tuple(
            TopLogprob(token=w, logprob=-0.1 - i, bytes=list(w.encode())) for i, w in enumerate(alternatives)
        )
        return TokenEvent(
            token_id=1000 + n, text=word, index=n, logprob=-0.1, top_logprobs=tops, elapsed_ms=elapsed_ms
        )

    def apply_limits(self, limits: EngineLimits) -> None:
        self.applied_limits.append(limits)

    def session_build(self, limits: EngineLimits) -> Callable[[], None] | None:
        return None  # no sessions to build

    def retire_sessions(self) -> bool:
        return False

    def unload(self) -> None:
        self._last_prompt = []

    def batch_decoder(self, slots: int) -> BatchDecoding | None:
        return None  # one reply at a time

    def shrink_batch(self, slots: int) -> bool:
        return False


@dataclass
class FakeGeneration:
    params: GenerationParams
    prompt: Prompt
    tokens: int = 0
    tokens_at_cancel: int | None = None
    finish: FinishEvent | None = None
    error: BaseException | None = None
    resumed: bool = False  # another engine's reply continued here
    handover: Handover | None = None  # handed on to another model


@dataclass
class RecordingEngine:
    """Delegates to `inner`; records each generation. `fail_after_tokens` injects an engine failure."""

    inner: Engine
    fail_after_tokens: int | None = None
    generations: list[FakeGeneration] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def model_id(self) -> str:
        return self.inner.model_id

    @property
    def variant(self) -> str:
        return self.inner.variant

    @property
    def variants(self) -> Sequence[str]:
        return self.inner.variants

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    @property
    def threads(self) -> int:
        return self.inner.threads

    @property
    def can_chat(self) -> bool:
        return self.inner.can_chat

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def tokenizer_key(self) -> str:
        return self.inner.tokenizer_key

    @property
    def model_dir(self) -> Path | None:
        return self.inner.model_dir

    @property
    def manifest(self) -> Mapping[str, Any] | None:
        return self.inner.manifest

    def continuation_prompt(
        self, request: list[dict] | str, reply: str, *, truncate: bool = False, reserve: int = 0
    ) -> Prompt:
        return self.inner.continuation_prompt(request, reply, truncate=truncate, reserve=reserve)

    def chat_prompt(
        self, messages: list[dict], *, truncate: bool = False, reserve: int = 0, tools: ToolUse | None = None
    ) -> Prompt:
        if tools is None:
            return self.inner.chat_prompt(messages, truncate=truncate, reserve=reserve)
        return self.inner.chat_prompt(messages, truncate=truncate, reserve=reserve, tools=tools)

    def text_prompt(self, text: str | Sequence[int], *, truncate: bool = False, reserve: int = 0) -> Prompt:
        return self.inner.text_prompt(text, truncate=truncate, reserve=reserve)

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return self.inner.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token_id: int) -> bytes:
        return self.inner.token_bytes(token_id)

    def chat_text(self, messages: list[dict]) -> str:
        return self.inner.chat_text(messages)

    def apply_limits(self, limits: EngineLimits) -> None:
        self.inner.apply_limits(limits)

    def session_build(self, limits: EngineLimits) -> Callable[[], None] | None:
        return self.inner.session_build(limits)

    def retire_sessions(self) -> bool:
        return self.inner.retire_sessions()

    def unload(self) -> None:
        self.inner.unload()

    def batch_decoder(self, slots: int) -> BatchDecoding | None:
        return None  # every reply through generate(), where it is recorded

    def shrink_batch(self, slots: int) -> bool:
        return self.inner.shrink_batch(slots)

    def generate(
        self,
        prompt: Prompt,
        params: GenerationParams,
        *,
        cancel: CancelToken | None = None,
        step_hook: StepHook | None = None,
        resume: Handover | None = None,
    ) -> Iterator[TokenEvent | FinishEvent | Handover]:
        gen = FakeGeneration(params=params, prompt=prompt or Prompt([]), resumed=resume is not None)
        with self._cond:
            self.generations.append(gen)
            self._cond.notify_all()

        def at_cancel() -> None:
            if gen.tokens_at_cancel is None:
                gen.tokens_at_cancel = gen.tokens

        if cancel is not None:
            cancel.on_cancel(at_cancel)
        try:
            events = self.inner.generate(prompt, params, cancel=cancel, step_hook=step_hook, resume=resume)
            for event in events:
                if isinstance(event, Handover):
                    gen.handover = event
                elif isinstance(event, TokenEvent):
                    if self.fail_after_tokens is not None and gen.tokens >= self.fail_after_tokens:
                        raise RuntimeError("injected engine failure")
                    gen.tokens += 1
                else:
                    gen.finish = event
                yield event
        except BaseException as err:
            gen.error = err
            raise
        finally:
            with self._cond:
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[FakeGeneration]], bool], timeout: float = 5.0) -> bool:
        """Block until predicate(generations) holds (re-checked whenever a generation starts or ends)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.generations), timeout)


class FakeGovernor:
    """A gate through the real seam: publishes a state change at the third step and lowers threads."""

    memory_pressure = False
    pauses_new = False
    rung = None
    background = NoGate.background

    def __init__(self) -> None:
        self.steps = 0
        self.publish: Callable[[dict], None] | None = None

    def subscribe(self, callback: Callable[[dict], None]) -> None:
        self.publish = callback

    def before_job(self, cancel, enqueued_at) -> EngineLimits | None:
        return None

    def before_step(self, cancel=None) -> EngineLimits | None:
        self.steps += 1
        if self.steps == 3 and self.publish:
            self.publish({"level": "moderate", "reason": "test"})
            return EngineLimits(threads=1)
        return None

    def before_batch(self, cancel, enqueued_at, pass_s) -> None:
        return None

    def note_pass(self, tokens: int) -> None:
        return None

    def note_aside(self, wall_s: float, cpu_s: float) -> None:
        return None


class HoldGate:
    """No governor, except that the first job waits until `release` is set: the test queues every request
    first, so they all run in one batch whatever the machine's timing."""

    memory_pressure = False
    pauses_new = False
    rung = None
    background = NoGate.background

    def __init__(self) -> None:
        self.release = threading.Event()
        self.release.set()
        self.holding = threading.Event()  # a job waits for `release`

    def subscribe(self, callback: Callable[[dict], None]) -> None:
        return None

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        self.holding.set()
        self.release.wait(30)
        return None

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        return None

    def before_batch(self, cancel: CancelToken, enqueued_at: float, pass_s: float | None) -> None:
        return None

    def note_pass(self, tokens: int) -> None:
        return None

    def note_aside(self, wall_s: float, cpu_s: float) -> None:
        return None


class PaceGate:
    """A gate that holds a tokens/s pace as the governor's gate does, over another gate (`inner`, NoGate
    unless given): after each pass it idles the rest of the pass's tokens / pace (governor_gate.pace_idle:
    a batch's pass makes the tokens note_pass says, a step of the one-reply engine one), then asks `inner`.
    A pass is timed from the end of the last step, so neither the idle nor `inner`'s waits are in it. The
    idle is `sleep`, or by default a wait that ends when the client leaves (as the governor's gate waits).
    `idled` records every idle."""

    def __init__(
        self,
        tokens_per_second: float,
        inner: Gate | None = None,
        *,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.tokens_per_second = tokens_per_second
        self.inner: Gate = inner or NoGate()
        self.idled: list[float] = []
        self._sleep = sleep
        self._last_step: float | None = None
        self._tokens = 1
        self._cancel: CancelToken | None = None
        self._wake = threading.Event()

    @property
    def memory_pressure(self) -> bool:
        return self.inner.memory_pressure

    @property
    def pauses_new(self) -> bool:
        return self.inner.pauses_new

    @property
    def rung(self) -> str | None:
        return self.inner.rung

    @property
    def background(self) -> BackgroundWork:
        return self.inner.background

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Any:
        return self.inner.subscribe(callback)

    def before_job(self, cancel: CancelToken, enqueued_at: float) -> EngineLimits | None:
        limits = self.inner.before_job(cancel, enqueued_at)
        self._last_step, self._tokens = None, 1  # a job's first step has no pass before it
        return limits

    def note_pass(self, tokens: int) -> None:
        self._tokens = tokens
        self.inner.note_pass(tokens)

    def note_aside(self, wall_s: float, cpu_s: float) -> None:
        self.inner.note_aside(wall_s, cpu_s)

    def before_batch(self, cancel: CancelToken, enqueued_at: float, pass_s: float | None) -> int | None:
        return self.inner.before_batch(cancel, enqueued_at, pass_s)  # the pace is for tokens: not a batch

    def before_step(self, cancel: CancelToken) -> EngineLimits | None:
        if cancel is not self._cancel:  # a job's token, or a batch's (a fresh one after a row left)
            self._cancel, self._wake = cancel, threading.Event()
            cancel.on_cancel(self._wake.set)
        tokens, self._tokens = self._tokens, 1
        if self._last_step is not None and not cancel.cancelled:
            idle = pace_idle(tokens, self.tokens_per_second, time.monotonic() - self._last_step)
            if idle > 0:
                self.idled.append(idle)
                if self._sleep is not None:
                    self._sleep(idle)
                else:
                    self._wake.wait(idle)
        limits = self.inner.before_step(cancel)
        self._last_step = time.monotonic()
        return limits
