"""Does JSON-schema output end? Replies over many seeds, with simmer's bounded grammar and with the peer
(the same schema compiled by llguidance as it is: unbounded numbers and strings). Prints JSON.

For each seed, both grammars in turn on one engine (interleaved), sampled as the server samples by default
(temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). Every reply that ends with `stop` must parse and
validate against the schema; the report counts the replies that ran into max_tokens (`length`) and what
they were writing when cut (the characters at the end: digits, a string, other).

    python -m bench.json_runaway --model-dir DIR [--seeds 50 --max-tokens 256]
    simmer bench json [--model ID]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import llguidance as llg

from models.errors import ModelNotChat
from models.runtime.constraint import JSON_LAYOUT, json_schema_grammar
from models.runtime.engine import load_engine
from models.types import FinishEvent, GenerationParams, SamplingParams, TokenEvent

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
PROMPT = [{"role": "user", "content": "Name a large city and its population, as JSON."}]
BASE_PROMPT = "A large city and its population, as JSON:\n"
MODES = ("bounded", "unbounded")


def unbounded_grammar(schema: dict[str, Any]) -> str:
    """The peer: the schema as llguidance compiles it without simmer's bounds (same layout)."""
    return llg.LLMatcher.grammar_from_json_schema(json.dumps({**schema, "x-guidance": JSON_LAYOUT}))


def cut_kind(text: str) -> str:
    """What a reply cut by max_tokens was writing: digits, a string, or something else."""
    tail = text.rstrip()[-12:]
    if tail and all(c in "0123456789.-eE+" for c in tail):
        return "digits"
    if text.count('"') % 2 == 1:  # an unclosed string (escaped quotes are rare enough for a report)
        return "string"
    return "other"


def one_reply(engine, prompt, grammar: str, seed: int, max_tokens: int) -> tuple[str, FinishEvent]:
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
    params = GenerationParams(sampling, max_tokens, grammar=grammar)
    text, finish = "", None
    for event in engine.generate(prompt, params):
        if isinstance(event, TokenEvent):
            text += event.text
        elif isinstance(event, FinishEvent):
            finish = event
            text += event.text
    assert finish is not None
    return text, finish


def run(model_dir: Path, *, seeds: int, max_tokens: int, threads: int, variant: str | None) -> dict:
    kwargs = {"variant": variant} if variant else {}
    engine = load_engine(model_dir, threads=threads, context_length=1024, **kwargs)
    try:
        prompt = engine.chat_prompt(PROMPT)
    except ModelNotChat:  # a base model (Gemma 3 270M): the same request as /v1/completions would send it
        prompt = engine.text_prompt(BASE_PROMPT)
    grammars = {"bounded": json_schema_grammar(SCHEMA), "unbounded": unbounded_grammar(SCHEMA)}
    validator = jsonschema.Draft202012Validator(SCHEMA)
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    started = time.perf_counter()
    for seed in range(seeds):
        for mode in MODES:
            text, finish = one_reply(engine, prompt, grammars[mode], seed, max_tokens)
            row: dict[str, Any] = {
                "seed": seed,
                "finish": finish.finish_reason,
                "tokens": finish.usage.completion_tokens,
            }
            if finish.finish_reason == "stop":
                try:
                    validator.validate(json.loads(text))
                    row["valid"] = True
                except (ValueError, jsonschema.ValidationError) as err:
                    row["valid"] = False
                    row["error"] = str(err)[:200]
                    row["text"] = text[:300]
            else:
                row["cut"] = cut_kind(text)
                row["tail"] = text[-40:]
            rows[mode].append(row)
    out: dict[str, Any] = {
        "model": engine.model_id,
        "variant": engine.variant,
        "threads": engine.threads,
        "schema": SCHEMA,
        "prompt": PROMPT[0]["content"] if prompt.chat is not None else BASE_PROMPT,
        "seeds": seeds,
        "max_tokens": max_tokens,
        "sampling": "temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (the server's defaults)",
        "wall_s": round(time.perf_counter() - started, 1),
    }
    for mode in MODES:
        got = rows[mode]
        stops = [r for r in got if r["finish"] == "stop"]
        lengths = [r for r in got if r["finish"] == "length"]
        out[mode] = {
            "stop": len(stops),
            "stop_valid": sum(r["valid"] for r in stops),
            "stop_invalid": [r for r in stops if not r["valid"]],
            "length": len(lengths),
            "length_cut_in": {k: sum(r["cut"] == k for r in lengths) for k in ("digits", "string", "other")},
            "other_finish": sorted({r["finish"] for r in got} - {"stop", "length"}),
            "median_tokens": statistics.median(r["tokens"] for r in got),
            "length_tails": [r["tail"] for r in lengths],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--variant", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    report = run(
        args.model_dir,
        seeds=args.seeds,
        max_tokens=args.max_tokens,
        threads=args.threads,
        variant=args.variant,
    )
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
