"""What one reply carries from token to token, and from one model to the next when the governor moves it.

A reply outlives the engine that started it: when the step hook names another model, the generation ends
with a Handover whose `state` is this object, and the next engine's generate(resume=...) picks it up.
Everything here is either independent of the vocabulary (the stop matcher, the RNG, the text so far, the
counts) or belongs to `tokenizer_key`'s vocabulary (ids, detokenizer, sampler), which a model with another
tokenizer replaces (see ReplyState.retokenized).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from models.protocol import ChatTurns
from models.runtime.constraint import Constraint
from models.runtime.sampling import Sampler, make_rng
from models.runtime.stops import StopMatcher
from models.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from models.runtime.tools import CallReader
from models.runtime.window import TurnWindow, window_split
from models.types import GenerationParams, Timings, Usage


@dataclass
class ReplyState:
    params: GenerationParams
    stops: StopMatcher
    rng: np.random.Generator
    usage: Usage
    truncated: bool
    # the vocabulary of `tokenizer_key`
    tokenizer_key: str
    history: list[int]  # prompt + reply, append-only (the sampler's view)
    ctx: list[int]  # what the model conditions on (a window of history)
    detok: IncrementalDetokenizer
    sampler: Sampler
    timings: Timings = field(default_factory=Timings)
    t_start: float = field(default_factory=time.perf_counter)
    decode_s: float = 0.0  # decode time on the engines before the current one
    generated: int = 0  # tokens generated, every model together
    text: list[str] = field(default_factory=list)  # complete characters produced (shown or held by stops)
    # structured output: the grammar's state (rebound to a new vocabulary at a handover) and the tool-call
    # reader (it reads text, so it stays)
    constraint: Constraint | None = None
    reader: CallReader | None = None
    # a chat prompt's turns (None: a raw text, a turn cut mid-way, or the context slid by tokens)
    window: TurnWindow | None = None
    turns_dropped: int = 0  # turns of the chat prompt's messages dropped from the front (see FinishEvent)

    @classmethod
    def start(
        cls,
        params: GenerationParams,
        tokenizer: Tokenizer,
        tokenizer_key: str,
        ids: list[int],
        truncated: bool,
        chat: ChatTurns | None = None,
        dropped: int = 0,
    ) -> ReplyState:
        rng = make_rng(params.sampling.seed)
        turns = None if chat is None else len(chat.messages) - len(window_split(chat.messages)[0])
        whole = turns is not None and dropped < turns  # else even the last turn was cut: no turn to drop
        return cls(
            params=params,
            stops=StopMatcher(params.stop),
            rng=rng,
            usage=Usage(prompt_tokens=len(ids)),
            truncated=truncated,
            tokenizer_key=tokenizer_key,
            history=list(ids),
            ctx=list(ids),
            detok=IncrementalDetokenizer(tokenizer),
            sampler=Sampler(params.sampling, rng, prompt_len=len(ids)),
            window=TurnWindow(chat.messages, chat.tools, dropped, len(ids)) if chat and whole else None,
            turns_dropped=dropped if chat else 0,
        )

    def retokenized(
        self, tokenizer: Tokenizer, tokenizer_key: str, ids: list[int], reply_tokens: int
    ) -> None:
        """Go on in another vocabulary from `ids` (this model's prompt, then the reply so far as it reads
        it). Bytes the old detokenizer held back (part of a character, never shown) are dropped: the new
        model writes that character itself. The stop matcher's held-back text is part of `ids` and stays
        held. The sampler keeps its RNG (same seed, same draws from here); its penalties count the ids of
        the new vocabulary, the last `reply_tokens` of them as generated."""
        self.tokenizer_key = tokenizer_key
        self.window = None  # the request and the reply as one text: its turns are no longer told apart
        self.history = list(ids)
        self.ctx = list(ids)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.sampler = Sampler(self.params.sampling, self.rng, prompt_len=len(ids) - reply_tokens)

    @property
    def reply_text(self) -> str:
        return "".join(self.text)
