"""When a test may assert a model's greedy text: only where the text is decided on this CPU, that is where
every step's top-two logit gap is wider than what another CPU's kernels can move the logits by.

Two CPUs run the same graph with differently ordered sums: fp32 activations (the f32 and q4 variants) part
by about 1e-4 logits, int8 activations (q4-a8, and llama.cpp's own kernels) by 0.3-0.8 (README: the q4-a8
speculation probe). With a gap of at least WIDE here and at least WIDE there, the two argmaxes cannot
part unless the logits moved by more than WIDE between the machines. A near-tie (SmolLM2's chat reply to
"What is the capital of France?" starts "The" over "L" by 0.08 logits) is not decided: a test asserts
shapes there, or equality between two paths of one engine on one machine."""

from __future__ import annotations

from dataclasses import dataclass

from models.protocol import Engine, Prompt
from models.types import FinishEvent, GenerationParams, SamplingParams, TokenEvent

WIDE = {"f32": 0.1, "q4": 0.1, "q4-a8": 1.0}


@dataclass(frozen=True)
class Greedy:
    text: str
    ids: list[int]
    margins: list[float]  # per generated token: its logit minus the runner-up's
    finish: FinishEvent

    def decided(self, wide: float) -> bool:
        """Every step's argmax won by at least `wide` logits."""
        return bool(self.margins) and min(self.margins) >= wide


def greedy(engine: Engine, prompt: Prompt, max_tokens: int) -> Greedy:
    """The engine's greedy reply with each step's top-two gap (its logprobs: the model's own distribution,
    so the gap is the logit gap)."""
    params = GenerationParams(SamplingParams(temperature=0.0, logprobs=2), max_tokens=max_tokens)
    events = list(engine.generate(prompt, params))
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    tokens = [e for e in events[:-1] if isinstance(e, TokenEvent)]
    margins = []
    for t in tokens:
        top = t.top_logprobs or ()
        margins.append(top[0].logprob - top[1].logprob if len(top) >= 2 else float("inf"))
    return Greedy(
        "".join(t.text for t in tokens) + finish.text, [t.token_id for t in tokens], margins, finish
    )
