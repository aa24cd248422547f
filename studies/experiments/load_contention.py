"""Does loading a model in a background thread spare a reply the wait for that load? (serving/summary.py)

The summary's idle work could load its model in a thread while the worker serves; a reply arriving then would
not wait for the load, but would share the device's cores with it. This probe measures, in one process and
interleaved round by round (the machine's speed drifts): a greedy reply of `--tokens` on the serving model
alone, the same reply while the other model loads in a thread, and that load alone (the longest a request
waits for a load on the worker thread). It prints each round and the medians.

    python -m studies.experiments.load_contention --serve DIR --load DIR [--tokens 48] [--rounds 6]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

PROMPT = "The history of the city begins"


def _open(folder: Path, threads: int) -> Any:
    from models.runtime.engine import load_engine

    return load_engine(folder, variant="q4-a8", threads=threads, context_length=512)


def reply_s(engine: Any, tokens: int) -> float:
    """Wall seconds of one greedy reply of `tokens` tokens (prompt included)."""
    from models.types import GenerationParams, SamplingParams

    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for _ in engine.generate(engine.text_prompt(PROMPT), params):
        pass
    return time.perf_counter() - t0


def load_s(folder: Path, threads: int) -> float:
    t0 = time.perf_counter()
    engine = _open(folder, threads)
    took = time.perf_counter() - t0
    engine.unload()
    return took


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=Path, required=True, help="the serving model's converted folder")
    ap.add_argument("--load", type=Path, required=True, help="the folder of the model loaded meanwhile")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    serving = _open(args.serve, args.threads)
    reply_s(serving, args.tokens)  # warm
    alone, beside, loads = [], [], []
    for r in range(args.rounds):
        loads.append(load_s(args.load, args.threads))
        alone.append(reply_s(serving, args.tokens))
        thread = threading.Thread(target=load_s, args=(args.load, args.threads))
        thread.start()
        beside.append(reply_s(serving, args.tokens))
        thread.join()
        print(
            f"round {r}: reply alone {alone[-1]:.2f} s, beside the load {beside[-1]:.2f} s; "
            f"load {loads[-1]:.2f} s"
        )
    delays = [b - a for a, b in zip(alone, beside, strict=True)]
    print(
        f"median: a background load delays the reply by {statistics.median(delays):.2f} s "
        f"(reply {statistics.median(alone):.2f} s alone); "
        f"the load alone takes {statistics.median(loads):.2f} s"
    )


if __name__ == "__main__":
    main()
