"""Plain data shared by the engine and its callers (no web types, no onnxruntime)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

# The variant a model opens on: the fastest decode at llama.cpp's quality (both quantize activations to
# 8 bits per block); the exact `q4` stays available (SIMMER_VARIANT=q4, or a ladder rung).
NOMINAL_VARIANT = "q4-a8"

FinishReason = Literal["stop", "length", "cancelled", "error", "tool_calls"]

# What an installed model does (its manifest's "kind"): a generative model answers chats and completions,
# an embedding model (a sentence encoder) answers embeddings only.
KIND_GENERATION = "generation"
KIND_EMBEDDING = "embedding"


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. Defaults follow the OpenAI API."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off (llama.cpp/HF style, multiplicative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # any int64, negative included; None = a fresh draw per request
    logprobs: int | None = None  # None = no logprobs; k >= 0 = chosen token + top-k alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100 added to its logit)


@dataclass(frozen=True)
class GenerationParams:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None = until EOS or the context cap
    stop: tuple[str, ...] = ()
    truncate: bool = False  # sliding-window truncation instead of context_length_exceeded
    ignore_eos: bool = False  # benchmarks: generate exactly max_tokens (llama.cpp's ignore_eos)
    # Constrained decoding (models/runtime/constraint.py): an llguidance grammar the reply must follow
    # (structured output); a constrained reply ends at the grammar's end, ignore_eos or not.
    grammar: str | None = None
    tools: ToolUse | None = None  # tool calling: the engine renders the tools and builds the call grammar
    # Whose prompt this is, for prefix reuse: KV is reused only between requests of one scope (the server
    # derives it from the API key and the request's cache_salt; "" is the default, shared scope).
    cache_scope: str = ""


@dataclass(frozen=True)
class Tool:
    """A function the model may call (OpenAI's tools[].function)."""

    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object (None: any object)


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[Tool, ...]
    choice: str = "auto"  # "none", "auto", "required", or the name of the one function to call
    parallel: bool = True  # more than one call in a reply


@dataclass
class Timings:
    """Like llama.cpp's `timings` object. Milliseconds and tokens per second."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    prompt_per_second: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    predicted_per_second: float = 0.0
    ttft_ms: float = 0.0
    draft_n: int = 0  # speculative decoding: tokens drafted and verified, and how many were accepted
    draft_n_accepted: int = 0


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # completion tokens per model that produced them, in the order the reply ran on them (a reply the
    # governor moved to another model mid-way names both)
    by_model: dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call as it streams: the first delta of call `index` has its id and name, later
    ones add to its arguments (JSON text, complete once the call is)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `text` is the UTF-8-safe delta (may be "" while bytes are held back)."""

    token_id: int
    text: str
    index: int
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] | None = None
    token_text: str | None = None  # the token's own text, for logprobs
    elapsed_ms: float = 0.0  # since generate() was called: TTFT for the first token, pacing after
    tool_calls: tuple[ToolCallDelta, ...] = ()  # with tools: call text goes here instead of `text`


@dataclass(frozen=True)
class FinishEvent:
    """Always the last event of a generation."""

    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    truncated: bool = False
    variant: str | None = None
    text: str = ""  # any text flushed at the end (held-back bytes)
    summarized: bool = (
        False  # the dropped turns were in the prompt as a summary note (server/serving/summary.py)
    )
    tool_calls: tuple[ToolCallDelta, ...] = ()  # call deltas flushed at the end
    model_id: str | None = None  # the model that finished the reply
    # turns of the chat prompt's messages the window dropped from the front, before the reply and during it
    # (the context filled, or the governor lowered the cap): a summary of them keys on it (serving/summary.py)
    turns_dropped: int = 0


@dataclass(frozen=True)
class Handover:
    """The last event of a generation that stops so another model continues the reply (the step hook named
    another model). The caller passes it to the next engine's generate(resume=...): a model with the same
    tokenizer continues from the same token ids (its KV cache rebuilt once), another one from `text`."""

    model_id: str  # the model to continue on
    variant: str | None  # and its variant (None: its own choice)
    tokenizer_key: str  # the tokenizer the state's ids belong to
    text: str  # the reply so far as complete characters (shown, or held back for a possible stop)
    generated: int  # tokens generated, every model together
    state: Any  # the engine's own (models/runtime/reply.py)


@dataclass(frozen=True)
class RowError:
    """A reply of a batch that failed with `error` (a forward pass, or its own sampling): its slot is free
    again, the other replies go on. The caller reports the error to that reply's client as the one-reply
    path does."""

    error: Exception


# What a batch's call produced for one of its replies: (its slot, the event). A FinishEvent or a RowError
# frees the slot.
BatchEvent = tuple[int, TokenEvent | FinishEvent | RowError]


@dataclass(frozen=True)
class PassStats:
    """A batch's last decode pass: replies that got a token, rows run (with the ones riding along), its
    seconds. What a cost meter keys on: tokens per CPU-second rise with the batch."""

    replies: int
    rows: int
    seconds: float


class CancelToken:
    """Set from any thread; checked by the worker between tokens and prefill chunks."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            callbacks = list(self._callbacks)
        for cb in callbacks:
            cb()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def on_cancel(self, cb: Callable[[], None]) -> None:
        """Register a callback (e.g. RunOptions.terminate) run when cancelled."""
        with self._lock:
            self._callbacks.append(cb)
            already = self._event.is_set()
        if already:
            cb()
