"""The engine contract the server's worker relies on. The real engine is models/runtime/engine.py, its batch
decoder models/runtime/batch.py; tests/server/fakes.py has a scripted engine that satisfies the same
protocol."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from models.types import (
    BatchEvent,
    CancelToken,
    FinishEvent,
    GenerationParams,
    Handover,
    PassStats,
    TokenEvent,
    ToolUse,
)


@dataclass(frozen=True)
class EngineLimits:
    """What the governor asks of the engine; applied between tokens and prefill chunks.
    None means "no limit / keep current". Every field is the governor's Limits field of the same name."""

    threads: int | None = None
    variant: str | None = None
    context_cap: int | None = None
    max_tokens: int | None = None
    # May the thread pools spin between runs? False: the governor paces, and a pool spinning through the
    # idle it leaves burns the thermal envelope on nothing. None: the engine's own setting (SIMMER_SPIN).
    # This is all the engine hears of the pace: no tokens/s here, because the gate
    # (server/serving/governor_gate.py) holds the pace, idling between passes, and no one else sleeps for it.
    spin: bool | None = None
    # The model the reply should run on. Another model's id, returned by the step hook, ends the
    # generation with a Handover event (the engine cannot switch model itself: the caller owns the models).
    model_id: str | None = None


# Whether an engine's sessions spin (onnxruntime's session.intra_op.allow_spinning), from its setting
# (SIMMER_SPIN), the governor's decision (EngineLimits.spin) and its threads:
#   one thread    -> no (no pool to spin: a session keyed "spinning" would be the same session built again
#                    every time the pace comes or goes)
#   setting "on"  -> spin (the operator's choice, whatever the governor says)
#   setting "off" -> never
#   setting "auto":
#     the governor says False (it paces: a CPU budget or a tokens/s pace) -> no
#     otherwise (unpaced: nominal, or no governor)                         -> spin
# The governor says False whenever it paces (governor/limits.py pool_spin), so the engine learns that its
# work is paced without being told the pace, which only the gate holds.
# The gate keys its cost meter with the same function (server/serving/governor_gate.py); the engine its
# sessions (models/runtime/engine.py session_key).
def pool_spins(setting: str, governor: bool | None, threads: int) -> bool:
    if threads <= 1:
        return False
    if setting != "auto":
        return setting == "on"
    return governor is not False


@dataclass(frozen=True)
class ChatTurns:
    """What a chat prompt renders: its messages (before the window) and the tools shown. A reply whose
    context fills (or whose cap the governor lowers) slides its window by whole turns from these, as the
    request's window does, instead of cutting the context at an arbitrary token."""

    messages: list[dict]
    tools: ToolUse | None = None


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    truncated: bool = False
    reply_tokens: int = 0  # a continuation prompt: how many of the last ids are the reply so far
    # chat_prompt's sliding window: how many turns (messages after the pinned system message, see
    # models/runtime/engine.py window_split) it dropped from the front; len(turns) when even the last turn
    # had to be cut mid-way. A summary of the dropped turns (server/serving/summary.py) keys on it.
    dropped: int = 0
    chat: ChatTurns | None = None  # a chat prompt's messages (None: a raw text, or a continuation)


StepHook = Callable[[], EngineLimits | None]
"""Called by the engine between prefill chunks and between decode tokens, on the worker thread.
It may block (a pause), raise models.errors.Cancelled, or return new limits (None = unchanged)."""


class BatchDecoding(Protocol):
    """Up to `slots` replies of one engine decoding together, as the worker drives them (the calls and their
    order: models/runtime/batch.py). Every call returns the events it produced; a FinishEvent or a RowError
    frees that slot."""

    last_pass: PassStats | None  # the last decode pass (None before the first)

    @property
    def engine(self) -> Engine:
        """The engine whose replies these are."""
        ...

    @property
    def active(self) -> list[int]:
        """The slots that hold a reply."""
        ...

    @property
    def free(self) -> int:
        """How many more replies may join."""
        ...

    @property
    def prefilling(self) -> list[int]:
        """Slots waiting for a prefill chunk, first come first."""
        ...

    @property
    def decoding(self) -> list[int]:
        """Slots the next step() advances."""
        ...

    def add(
        self,
        prompt: Prompt | None,
        params: GenerationParams,
        *,
        cancel: CancelToken | None = None,
        resume: Handover | None = None,
    ) -> int:
        """Take a slot for a reply (its prompt runs in later prefill() calls). Raises what generate() would
        before its first token."""
        ...

    def prefill(self, slot: int | None = None) -> list[BatchEvent]:
        """One prefill chunk of `slot` (by default the one waiting longest); its first token when done."""
        ...

    def step(self) -> list[BatchEvent]:
        """One forward pass: the next token of every decoding reply."""
        ...

    def cancel(self, slot: int) -> FinishEvent:
        """End a reply now (finish_reason "cancelled"); its slot is free at once."""
        ...

    def hand_over(self, slot: int, limits: EngineLimits) -> Handover:
        """The reply of `slot`, to go on on the model `limits` names; its slot is free at once."""
        ...

    def apply_limits(self, limits: EngineLimits) -> list[BatchEvent]:
        """The governor's limits for every reply of the batch, between passes."""
        ...


class Engine(Protocol):
    model_id: str
    variant: str  # active variant name
    variants: Sequence[str]  # installed variants, best quality first
    context_length: int  # the context cap in force (tokens)
    threads: int
    can_chat: bool  # False without a chat template: chat_prompt raises ModelNotChat
    vocab_size: int  # logits per position; token ids are 0..vocab_size-1 (logit_bias is checked against it)
    tokenizer_key: str  # equal for two models exactly when their token ids mean the same text

    @property
    def model_dir(self) -> Path | None:
        """The converted folder it was opened from (None: an engine with no folder, a test's)."""
        ...

    @property
    def manifest(self) -> Mapping[str, Any] | None:
        """The folder's manifest.json (None: none)."""
        ...

    def chat_prompt(
        self, messages: list[dict], *, truncate: bool = False, reserve: int = 0, tools: ToolUse | None = None
    ) -> Prompt:
        """Render the chat template and tokenize. Raises ContextLengthExceeded when the prompt
        plus `reserve` tokens does not fit and truncate is False; with truncate, a sliding window
        keeps the system message and the newest turns (Prompt.truncated = True). `tools` are shown to
        the model in its own format (models/runtime/tools.py); messages may carry tool_calls and
        role "tool" turns."""
        ...

    def text_prompt(self, text: str | Sequence[int], *, truncate: bool = False, reserve: int = 0) -> Prompt:
        """A completion's prompt: `text` tokenized, or token ids of this model's vocabulary as given (an id
        outside it is InvalidParameter naming its position). ContextLengthExceeded when it does not fit
        with `reserve` and truncate is False; with truncate, the newest tokens are kept."""
        ...

    def continuation_prompt(
        self, request: list[dict] | str, reply: str, *, truncate: bool = False, reserve: int = 0
    ) -> Prompt:
        """The prompt that continues a reply another model started: this model's own rendering of the
        request (chat messages or completion text), then the reply so far, tokenized as one text."""
        ...

    def generate(
        self,
        prompt: Prompt | None,
        params: GenerationParams,
        *,
        cancel: CancelToken | None = None,
        step_hook: StepHook | None = None,
        resume: Handover | None = None,
    ) -> Iterator[TokenEvent | FinishEvent | Handover]:
        """Run on the worker thread. Yields TokenEvents then exactly one FinishEvent (finish_reason
        "cancelled" when the cancel token fired), or a Handover when the step hook named another model.
        With `resume` (another engine's Handover) the reply goes on: from its token ids when the tokenizer
        is the same (`prompt` is not used), else from `prompt` (continuation_prompt)."""
        ...

    # The tokenizer side (llama.cpp's /tokenize, /detokenize, /apply-template): read-only, so any thread may
    # call these while the worker generates.
    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """The ids of `text`, as llama.cpp's tokenize(text, add_special, parse_special) gives them."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """A token's raw bytes (part of a UTF-8 character, maybe). Ids outside 0..vocab_size-1 raise
        IndexError."""
        ...

    def chat_text(self, messages: list[dict]) -> str:
        """The chat template rendered for `messages`, with the generation prompt: the text chat_prompt
        tokenizes. Raises ModelNotChat without a template."""
        ...

    def apply_limits(self, limits: EngineLimits) -> None:
        """Switch threads/variant/context cap outside a generation (inside one, return them from
        the step hook instead)."""
        ...

    def session_build(self, limits: EngineLimits) -> Callable[[], None] | None:
        """What applying `limits` would build (a session for other threads, spinning or variant), as a call
        to make on another thread first, or None when they build nothing. Applies nothing."""
        ...

    def retire_sessions(self) -> bool:
        """Drop the sessions kept past a swap: a session built beside the worker replaced the one a reply
        ran on, and the old one stays until this is called between replies, because its teardown holds the
        GIL (85 ms for a 1.5B model's) and a running reply would wait for it. True when any went."""
        ...

    def unload(self) -> None:
        """Free sessions and KV buffers (keep_alive expiry); the next generate() loads again."""
        ...

    def batch_decoder(self, slots: int) -> BatchDecoding | None:
        """The decoder of up to `slots` replies at once (in a batch, or taking turns), kept (with its KV
        rows) until unload() or shrink_batch(); None when this engine serves its replies one at a time (then
        generate() them)."""
        ...

    def shrink_batch(self, slots: int) -> bool:
        """Drop the batch decoder when it holds rows for more than `slots` replies and none runs (memory
        pressure): its KV rows go back now, batch_decoder builds one of the size asked next time. True if it
        went (False too for an engine that keeps none)."""
        ...
