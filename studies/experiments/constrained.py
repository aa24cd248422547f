"""What a JSON-schema constraint costs per decoded token, on a real model. Prints JSON.

Interleaved A/B/C rounds in one process on one engine: unconstrained (ignore_eos, as many tokens as the
constrained reply had), constrained with the mask computed during the forward pass (prefetch, the default)
and constrained with the mask computed in line. Decode time per token comes from the engine's own timings
(prefill excluded). On a shared machine only the ratios mean something.

    python -m studies.experiments.constrained --model-dir DIR

(DIR: a converted SmolLM2 folder, as `simmer list` shows)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from models.runtime.constraint import Constraint, ConstraintVocabulary, json_schema_grammar
from models.runtime.engine import load_engine
from models.types import FinishEvent, GenerationParams, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "fruits": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "color": {"enum": ["red", "green", "yellow"]}},
                "required": ["name", "color"],
                "additionalProperties": False,
            },
            "minItems": 12,
            "maxItems": 12,
        }
    },
    "required": ["fruits"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "List twelve fruits with their colors as JSON."}]


class TimedConstraint(Constraint):
    """Adds up the time the generation loop spends in the constraint (waiting for or computing the mask,
    unpacking it, advancing): its cost on the decode critical path."""

    spent_s = 0.0
    calls = 0

    def allowed(self):
        t0 = time.perf_counter()
        try:
            return super().allowed()
        finally:
            TimedConstraint.spent_s += time.perf_counter() - t0
            TimedConstraint.calls += 1

    def advance(self, token: int) -> None:
        t0 = time.perf_counter()
        try:
            super().advance(token)
        finally:
            TimedConstraint.spent_s += time.perf_counter() - t0


def per_token_ms(engine, prompt, params) -> tuple[float, int]:
    finish = None
    for event in engine.generate(prompt, params):
        if isinstance(event, FinishEvent):
            finish = event
    assert finish is not None
    t = finish.timings
    # the first token comes from the prefill's logits: decode steps are predicted_n - 1
    return t.predicted_ms / max(t.predicted_n - 1, 1), t.predicted_n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--variant", default="q4-a8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    engine = load_engine(args.model_dir, variant=args.variant, threads=args.threads, context_length=1024)
    t0 = time.perf_counter()
    vocab = ConstraintVocabulary.for_tokenizer(engine.tokenizer)
    vocab_s = time.perf_counter() - t0
    engine.constraint = lambda p: (  # type: ignore[method-assign]
        TimedConstraint(p.grammar, vocab, prefetch=engine.mask_prefetch) if p.grammar else None
    )
    prompt = engine.chat_prompt(PROMPT)
    grammar = json_schema_grammar(SCHEMA)
    sampling = SamplingParams(temperature=0.0)
    modes = ("constrained_prefetch", "constrained_inline")
    results: dict[str, list[float]] = {"free": [], **{m: [] for m in modes}}
    critical: dict[str, list[float]] = {m: [] for m in modes}
    tokens = 0
    for _ in range(args.rounds):
        for mode in modes:
            engine.mask_prefetch = mode == "constrained_prefetch"
            TimedConstraint.spent_s, TimedConstraint.calls = 0.0, 0
            params = GenerationParams(sampling, args.max_tokens, grammar=grammar)
            ms, tokens = per_token_ms(engine, prompt, params)
            results[mode].append(ms)
            critical[mode].append(TimedConstraint.spent_s * 1000 / max(TimedConstraint.calls, 1))
        free = GenerationParams(sampling, max_tokens=tokens, ignore_eos=True)
        results["free"].append(per_token_ms(engine, prompt, free)[0])
    median = {k: statistics.median(v) for k, v in results.items()}
    # ratios within each round (the same minute of a shared machine), then their median
    paired = {
        m: statistics.median(c / f for c, f in zip(results[m], results["free"], strict=True)) for m in modes
    }
    out = {
        "model": engine.model_id,
        "variant": engine.variant,
        "threads": engine.threads,
        "rounds": args.rounds,
        "tokens_per_reply": tokens,
        "vocabulary_build_s": round(vocab_s, 2),
        "median_ms_per_token": {k: round(v, 3) for k, v in median.items()},
        "ratio_of_medians": {m: round(median[m] / median["free"], 3) for m in modes},
        "median_of_paired_ratios": {m: round(v, 3) for m, v in paired.items()},
        # the constraint's own time on the decode path per token, and as a share of a free token
        "critical_ms_per_token": {m: round(statistics.median(v), 3) for m, v in critical.items()},
        "critical_share_of_free_token": {
            m: round(statistics.median(v) / median["free"], 4) for m, v in critical.items()
        },
        "all_ms_per_token": {k: [round(x, 3) for x in v] for k, v in results.items()},
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
