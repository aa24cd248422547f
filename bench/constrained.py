"""What a JSON-schema constraint costs per decoded token, on a real model (issue 15). Prints JSON.

Interleaved A/B/C rounds in one process on one engine: unconstrained (ignore_eos, as many tokens as the
constrained reply had), constrained with the mask computed during the forward pass (prefetch, the default)
and constrained with the mask computed in line. Decode time per token comes from the engine's own timings
(prefill excluded). On a shared machine only the ratios mean something.

    python -m bench.constrained --model-dir ~/.cache/simmer-test/converted-v5/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from models.runtime.constraint import ConstraintVocabulary, json_schema_grammar
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
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args(argv)
    engine = load_engine(args.model_dir, variant=args.variant, threads=args.threads, context_length=1024)
    t0 = time.perf_counter()
    ConstraintVocabulary.for_tokenizer(engine.tokenizer)
    vocab_s = time.perf_counter() - t0
    prompt = engine.chat_prompt(PROMPT)
    grammar = json_schema_grammar(SCHEMA)
    sampling = SamplingParams(temperature=0.0)
    results: dict[str, list[float]] = {"free": [], "constrained_prefetch": [], "constrained_inline": []}
    tokens = 0
    for _ in range(args.rounds):
        for mode in ("constrained_prefetch", "constrained_inline"):
            engine.mask_prefetch = mode == "constrained_prefetch"
            ms, tokens = per_token_ms(
                engine, prompt, GenerationParams(sampling, args.max_tokens, grammar=grammar)
            )
            results[mode].append(ms)
        free = GenerationParams(sampling, max_tokens=tokens, ignore_eos=True)
        results["free"].append(per_token_ms(engine, prompt, free)[0])
    median = {k: statistics.median(v) for k, v in results.items()}
    out = {
        "model": engine.model_id,
        "variant": engine.variant,
        "threads": engine.threads,
        "rounds": args.rounds,
        "tokens_per_reply": tokens,
        "vocabulary_build_s": round(vocab_s, 2),
        "median_ms_per_token": {k: round(v, 3) for k, v in median.items()},
        "ratio_prefetch": round(median["constrained_prefetch"] / median["free"], 3),
        "ratio_inline": round(median["constrained_inline"] / median["free"], 3),
        "all_ms_per_token": {k: [round(x, 3) for x in v] for k, v in results.items()},
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
