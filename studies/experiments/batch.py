"""Several streams on one engine: the batch decoder against the one-reply engine, in one process, interleaved.

    python -m studies.experiments.batch MODEL_DIR [--variant q4-a8] [--threads 2] [--tokens 128]
        [--streams 1,2,3,4] [--rounds 3] [--pad-variants q4-a8,q4] [--json OUT]

Each round runs, for N = 1..4 streams of `tokens` tokens each (chat prompts, ignore_eos, greedy), one after
another so that the machine's drift falls on every mode alike:
- `sequential`: today's path, DecoderEngine.generate one reply after another (what simmer's worker does with N
  clients today);
- `batch`: models/runtime/batch.py's BatchDecoder with the N replies added at once, driven as a scheduler
  would (a prefill chunk when one is due, else a decode pass).
Both start from an empty prefix cache. Reported per mode and N: aggregate tok/s (N x tokens over the wall
time, prefills included), decode tok/s per stream (the replies' own timings), TTFT p50/max, tokens per
CPU-second of the process; and the ratios batch/sequential, batch N / sequential 1.

Batch invariance: for each of `pad_variants`, one stream through the BatchDecoder unpadded and padded to two
rows (what a reply alone costs when its kernels sum one row differently; see models/runtime/batch.py),
interleaved, with whether that variant needs the padding (batch_traits) and whether both give the same
tokens as the one-reply engine.

Numbers from a shared machine: only the ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

QUESTIONS = (
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What are the main causes of inflation?",
    "Describe how a bicycle works.",
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_sequential(engine: Any, prompts: list[Any], params: Any) -> dict[str, Any]:
    from models.types import FinishEvent, TokenEvent

    tokens, ttfts, decode = 0, [], []
    cpu0, t0 = time.process_time(), time.perf_counter()
    for prompt in prompts:
        engine.reset_cache()
        start = time.perf_counter()
        first = None
        for event in engine.generate(prompt, params):
            if isinstance(event, TokenEvent):
                tokens += 1
                first = first or (time.perf_counter() - t0) * 1000  # from when all N clients asked
            elif isinstance(event, FinishEvent):
                decode.append(event.timings.predicted_per_second)
        ttfts.append(first if first is not None else (time.perf_counter() - start) * 1000)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return _summary(tokens, wall, cpu, ttfts, decode, [])


def run_batch(bd: Any, prompts: list[Any], params: Any) -> dict[str, Any]:
    from models.runtime.batch import RowError
    from models.types import FinishEvent, TokenEvent

    bd.reset_cache()
    tokens, ttfts, decode, ids = 0, {}, [], {}
    cpu0, t0 = time.process_time(), time.perf_counter()
    slots = [bd.add(p, params) for p in prompts]
    ids = {s: [] for s in slots}
    passes: list[float] = []
    while bd.active:
        prefill = bool(bd.prefilling)
        p0 = time.perf_counter()
        events = bd.prefill() if prefill else bd.step()
        if not prefill:
            passes.append(time.perf_counter() - p0)
        for slot, event in events:
            if isinstance(event, RowError):
                raise event.error
            if isinstance(event, TokenEvent):
                tokens += 1
                ids[slot].append(event.token_id)
                ttfts.setdefault(slot, (time.perf_counter() - t0) * 1000)
            elif isinstance(event, FinishEvent):
                decode.append(event.timings.predicted_per_second)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    out = _summary(tokens, wall, cpu, list(ttfts.values()), decode, passes)
    out["ids"] = [ids[s] for s in slots]
    return out


def _summary(
    tokens: int, wall: float, cpu: float, ttfts: list[float], decode: list[float], passes: list[float]
) -> dict[str, Any]:
    out = {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 2),
        "decode_tok_s_per_stream": round(statistics.median(decode), 2),
        "ttft_p50_ms": round(_percentile(ttfts, 0.5), 1),
        "ttft_max_ms": round(max(ttfts), 1),
        "tok_per_cpu_s": round(tokens / cpu, 2) if cpu > 0 else None,
    }
    if passes:
        out["decode_pass_ms_p50"] = round(statistics.median(passes) * 1000, 2)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from models.runtime.batch import BatchDecoder, batch_traits
    from models.runtime.engine import load_engine
    from models.types import GenerationParams, SamplingParams, TokenEvent

    streams = [int(n) for n in args.streams.split(",")]
    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=args.tokens, ignore_eos=True)
    engine = load_engine(
        Path(args.model_dir), variant=args.variant, threads=args.threads, context_length=1024
    )
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts = [prompts[i % len(prompts)] for i in range(max(streams))]
    bd = BatchDecoder(engine, max(streams))
    pad_engines = {
        v: load_engine(Path(args.model_dir), variant=v, threads=args.threads, context_length=1024)
        for v in args.pad_variants.split(",")
        if v
    }
    pad_decoders = {
        v: (BatchDecoder(e, 1, pad=False), BatchDecoder(e, 1, pad=True)) for v, e in pad_engines.items()
    }
    rounds: list[dict[str, Any]] = []
    for r in range(-1, args.rounds):  # round -1 warms every path up (sessions, KV pages) and is dropped
        one: dict[str, Any] = {}
        for n in streams:
            one[f"sequential_{n}"] = run_sequential(engine, prompts[:n], params)
            one[f"batch_{n}"] = run_batch(bd, prompts[:n], params)
        for v, (plain, padded) in pad_decoders.items():
            for name, dec in (("unpadded", plain), ("padded", padded)):
                one[f"{v}_single_{name}"] = run_batch(dec, prompts[:1], params)
        if r >= 0:
            rounds.append(one)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    keys = list(rounds[0])
    medians = {
        k: {
            m: statistics.median(rd[k][m] for rd in rounds)
            for m in rounds[0][k]
            if m not in ("ids", "tokens")
        }
        for k in keys
    }
    ratios: dict[str, Any] = {}
    base = [rd["sequential_1"]["aggregate_tok_s"] for rd in rounds]
    for n in streams:
        per_round = [
            rd[f"batch_{n}"]["aggregate_tok_s"] / rd[f"sequential_{n}"]["aggregate_tok_s"] for rd in rounds
        ]
        vs_one = [rd[f"batch_{n}"]["aggregate_tok_s"] / b for rd, b in zip(rounds, base, strict=True)]
        ratios[f"batch_{n}_vs_sequential_{n}"] = round(statistics.median(per_round), 3)
        ratios[f"batch_{n}_vs_single_stream_today"] = round(statistics.median(vs_one), 3)
    single = [
        rd["batch_1"]["decode_tok_s_per_stream"] / rd["sequential_1"]["decode_tok_s_per_stream"]
        for rd in rounds
    ]
    ratios["single_stream_decode_batch_vs_today"] = round(statistics.median(single), 3)
    invariance: dict[str, Any] = {}
    for v, e in pad_engines.items():
        cost = [
            rd[f"{v}_single_padded"]["decode_tok_s_per_stream"]
            / rd[f"{v}_single_unpadded"]["decode_tok_s_per_stream"]
            for rd in rounds
        ]
        today = [t.token_id for t in e.generate(prompts[0], params) if isinstance(t, TokenEvent)]
        invariance[v] = {
            "rows_alike": batch_traits(e.session()).rows_alike,
            "needs_padding": not batch_traits(e.session()).one_row_exact,
            "padded_decode_vs_unpadded": round(statistics.median(cost), 3),
            "unpadded_ids_equal_one_reply_engine": rounds[0][f"{v}_single_unpadded"]["ids"][0] == today,
            "padded_ids_equal_one_reply_engine": rounds[0][f"{v}_single_padded"]["ids"][0] == today,
        }
    batch_ids = {n: rounds[0][f"batch_{n}"]["ids"] for n in streams}
    return {
        "benchmark": "batch",
        "model_dir": str(args.model_dir),
        "variant": args.variant,
        "threads": args.threads,
        "tokens_per_stream": args.tokens,
        "rounds": args.rounds,
        "batch_pads_alone": bd.pads,
        "same_ids_alone_and_batched": all(
            ids == batch_ids[max(streams)][: len(ids)] for ids in batch_ids.values()
        ),
        "medians": medians,
        "ratios": ratios,
        "invariance": invariance,
        "per_round": [
            {k: {m: x for m, x in v.items() if m != "ids"} for k, v in rd.items()} for rd in rounds
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies.experiments.batch", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("model_dir")
    p.add_argument("--variant", default="q4-a8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", default="1,2,3,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pad-variants", default="q4-a8,q4", help="variants whose padding cost is measured")
    p.add_argument("--json", help="write the report here too")
    args = p.parse_args(argv)
    report = measure(args)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
