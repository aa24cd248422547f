"""Runtime tests' helpers: running an engine greedily and reading its text, prompts in chunks, the warm
prefix reuse to expect, driving a batch decoder, greedy decoding through onnxruntime-genai beside simmer's
engine, and the tools and schema several structured-output tests use."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime_genai as og  # a dev dependency: a missing one must fail, not skip

from models.protocol import Prompt
from models.runtime.batch import BatchDecoder, RowError
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.generation import passes_exact
from models.types import (
    FinishEvent,
    GenerationParams,
    SamplingParams,
    TokenEvent,
    Tool,
    ToolCallDelta,
)


def og_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy ids and the logits onnxruntime-genai chose each of them from."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens, batch_size=1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    ids, logits = [], []
    while not gen.is_done():
        logits.append(np.array(gen.get_logits()).reshape(-1))
        gen.generate_next_token()
        ids.append(int(gen.get_next_tokens()[0]))
    return ids, logits


def ours_greedy(folder: Path, prompt: list[int], new_tokens: int, **kw) -> list[int]:
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["filename"]
    engine = load_engine(folder, variant=Path(decoder).stem, threads=1, **kw)
    params = GenerationParams(
        sampling=SamplingParams(temperature=0.0), max_tokens=new_tokens, ignore_eos=True
    )
    return [e.token_id for e in engine.generate(Prompt(list(prompt)), params) if hasattr(e, "token_id")]


def assert_genai_runs_alike(folder: Path) -> None:
    """onnxruntime-genai, reading our genai_config.json, decodes the q4-a8 graph to our greedy ids."""
    cfg = json.loads((folder / "genai_config.json").read_text())
    assert cfg["model"]["decoder"]["filename"] == "q4-a8.onnx"
    model = og.Model(str(folder))
    for prompt in ([1, 5, 17, 40, 33, 9], [2, 3]):
        ids, _ = og_greedy(model, list(prompt), 6)
        assert ids == ours_greedy(folder, prompt, 6, context_length=64), prompt


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


GREEDY = SamplingParams(temperature=0.0)


def run(
    engine: DecoderEngine, prompt: Prompt, params: GenerationParams, **kw
) -> tuple[list[TokenEvent], FinishEvent]:
    events = list(engine.generate(prompt, params, **kw))
    assert isinstance(events[-1], FinishEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


def in_chunks(e: DecoderEngine, n: int) -> int:
    """`n` cached tokens as prefix reuse counts them: all, or whole prefill chunks where this CPU's passes of
    several positions depend on their number (session.cold_pass: ARM's kernels)."""
    return n if passes_exact(e.session()) else n - n % e.prefill_chunk


def warm_reuse(e: DecoderEngine, n: int) -> int:
    """What a prompt of `n` tokens reuses of itself, cached: all but reuse_tail, in_chunks."""
    return in_chunks(e, n - e.reuse_tail)


def text_of(tokens: list[TokenEvent], fin: FinishEvent) -> str:
    return "".join(t.text for t in tokens) + fin.text


WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)

TIME = Tool(
    "get_time",
    None,
    {
        "type": "object",
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)


def calls_of(tokens, fin) -> list[dict]:
    """OpenAI-style calls assembled from the deltas (as a client's stream helper does)."""
    calls: dict[int, dict] = {}
    for d in [c for t in tokens for c in t.tool_calls] + list(fin.tool_calls):
        call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        call["id"] = call["id"] or d.id
        call["name"] = call["name"] or d.name
        call["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


Events = list[TokenEvent | FinishEvent | RowError]


def drive(
    bd: BatchDecoder,
    replies: Mapping[str, tuple[Prompt | None, GenerationParams]],
    between: Callable[[BatchDecoder, dict[str, Events]], list | None] | None = None,
    **add,
) -> dict[str, Events]:
    """Add every reply, then prefill (a chunk per call) and decode until all are finished, as a
    scheduler would: a prefill chunk first when one is due, else a decode pass. `between` runs after each
    call (where a worker applies limits or cancels) and may return events of its own."""
    slots = {bd.add(prompt, params, **add): key for key, (prompt, params) in replies.items()}
    out: dict[str, Events] = {key: [] for key in replies}

    def take(events: list) -> None:
        for slot, event in events:
            assert not isinstance(event, RowError), event.error
            out[slots[slot]].append(event)
            if isinstance(event, FinishEvent):
                del slots[slot]

    while slots:
        take(bd.prefill() if bd.prefilling else bd.step())
        if between is not None:
            take(between(bd, out) or [])
    return out


def tokens(events: Events) -> list[tuple[int, float | None, object]]:
    return [(e.token_id, e.logprob, e.top_logprobs) for e in events if isinstance(e, TokenEvent)]


def finish(events: Events) -> FinishEvent:
    assert isinstance(events[-1], FinishEvent)
    return events[-1]


# -- several replies at once: the prompts and samplings they run, and their events compared ------------------
TEXTS = ["the cat sat on the mat", "once upon a time there was a", "what is the capital", "def fib(n):"]
SAMPLINGS = [
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=1.0, seed=5, logprobs=2),
    SamplingParams(temperature=1.3, top_p=0.9, seed=9, logprobs=2),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),
]


def anonymous(calls: tuple[ToolCallDelta, ...]) -> tuple[ToolCallDelta, ...]:
    return tuple(replace(c, id=None) for c in calls)  # a call's id is drawn afresh for each reply


def same_events(a: Events, b: Events) -> None:
    """Two runs of one reply: equal events but for the clocks and the tool calls' ids."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, TokenEvent):
            assert isinstance(y, TokenEvent)
            assert replace(x, elapsed_ms=0, tool_calls=anonymous(x.tool_calls)) == replace(
                y, elapsed_ms=0, tool_calls=anonymous(y.tool_calls)
            )
        else:
            assert isinstance(x, FinishEvent) and isinstance(y, FinishEvent)
            for field in ("finish_reason", "text", "truncated", "turns_dropped", "variant"):
                assert getattr(x, field) == getattr(y, field), field
            assert anonymous(x.tool_calls) == anonymous(y.tool_calls)
            assert x.usage.completion_tokens == y.usage.completion_tokens
            assert x.usage.cached_tokens == y.usage.cached_tokens
